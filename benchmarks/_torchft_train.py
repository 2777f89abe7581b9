"""One replica group (one process) of Meta's torchft, for the failure benchmark (benchmarks/heal.py).

torchft Manager + DistributedDataParallel + Optimizer on the 3.7M-parameter MLP (1024-2048-768-4,
AdamW, batch 32), torchft's defaults otherwise (async quorum, HTTP checkpoint transport, lighthouse
heartbeat timeout). Writes one JSON line per event to --step-log, in the format examples/train_ddp.py
uses, so the same harness reads both:
  {"event": "ready", "time", "started", "cpu"}  Manager constructed (started: before the imports;
                                              cpu: the process's CPU seconds until then)
  {"event": "commit", "step", "time"}         a committed step
  {"event": "heal", "quorum_time", "transfer_s", "load_s"}  after a healing step's state was loaded
--kill-file: SIGKILL this process at the next forward pass once the file exists.
--stop-file: stop once the file holds a step number and this group has reached it.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: the benchmark splits start-up from the rest

import argparse
import json
import logging
import os
import signal
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport


class LoopbackHTTPTransport(HTTPTransport):
    """torchft's HTTPTransport, advertising 127.0.0.1 instead of the host name (lookups can stall here)."""

    def address(self) -> str:
        return f"http://127.0.0.1:{self._server.socket.getsockname()[1]}/checkpoint/"


def _stop_step(path: str | None, default: int) -> int:
    if path and os.path.exists(path):
        with open(path) as f:
            text = f.read().strip()
        if text:
            return int(text)
    return default


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--replica-id", required=True)
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--kill-file", default=None)
    parser.add_argument("--stop-file", default=None)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 768),
                                torch.nn.ReLU(), torch.nn.Linear(768, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-4)
    log = open(args.step_log, "a", buffering=1)
    heal: dict[str, float] = {}

    def load_state(state: dict) -> None:
        started = time.perf_counter()
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])
        heal["load_s"] = time.perf_counter() - started
        log.write(json.dumps({"event": "heal", "time": time.time(), **heal}) + "\n")

    def save_state() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    timeout = timedelta(seconds=args.timeout)
    transport = LoopbackHTTPTransport(timeout=timeout, num_chunks=0)
    original_recv = transport.recv_checkpoint

    def timed_recv(*a, **kw):  # type: ignore[no-untyped-def]
        heal["quorum_time"] = time.time()  # the quorum (and the process group's reconfiguration) is done here
        started = time.perf_counter()
        out = original_recv(*a, **kw)
        heal["transfer_s"] = time.perf_counter() - started
        return out

    transport.recv_checkpoint = timed_recv  # type: ignore[method-assign]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state, state_dict=save_state,
                      min_replica_size=1, lighthouse_addr=args.lighthouse, replica_id=args.replica_id,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port, hostname="127.0.0.1",
                      timeout=timeout, checkpoint_transport=transport)
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    log.write(json.dumps({"event": "ready", "time": time.time(), "started": STARTED,
                          "cpu": time.process_time()}) + "\n")

    gen = torch.Generator().manual_seed(1234)
    features = torch.randn(256, 1024, generator=gen)
    labels = torch.randint(0, 4, (256,), generator=gen)
    index = 0
    while manager.current_step() < _stop_step(args.stop_file, args.steps):
        if args.kill_file and os.path.exists(args.kill_file):
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = features[index:index + 32], labels[index:index + 32]
        index = (index + 32) % 256
        optimizer.zero_grad()  # starts the quorum (in the background)
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        before = manager.current_step()
        optimizer.step()  # returns nothing: a commit shows as the step counter moving on
        if manager.current_step() > before:
            log.write(json.dumps({"event": "commit", "step": manager.current_step(), "time": time.time()}) + "\n")
    manager.shutdown()
    log.close()
    os._exit(0)  # skip slow interpreter teardown of gRPC/Rust threads


if __name__ == "__main__":
    main()
