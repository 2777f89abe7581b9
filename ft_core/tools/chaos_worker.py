"""One replica group of a chaos run (`ftl chaos`): a small Manager + DDP loop that logs everything the
harness checks, one JSON line at a time (flushed, since the process may be SIGKILLed at any instant).

    python -m ft_core.tools.chaos_worker --out DIR [--min-replicas 2 --timeout 5 ...]

Run by `ft_core.tools.chaos` through the Launcher (REPLICA_GROUP_ID, FT_RESTART_COUNT, FT_LIGHTHOUSE and
FT_TOKEN come from the environment). Each incarnation writes DIR/g<group>.i<incarnation>.jsonl with
records keyed by "kind":
- "ready": the process is up (replica_id, pid).
- "step": after each committed step: step, digest (sha256 of the raw bytes of every parameter and
  optimizer state tensor), participants, replica_ids, quorum_id, healed, time.
- "event": the Manager's structured events (quorum, heal, commit, error) as they happen.
- "send" / "recv_start" / "recv_done" / "recv_failed": the checkpoint transport at work (heals).
- "drop" / "delay": faults the chaos transport injected on this source.
- "step_error": a step raised (e.g. no lighthouse reachable); the loop goes on.
- "exit": the loop ended: the group committed the step the harness wrote to DIR/exit (every group
  stops after that same commit, so none is left waiting for a quorum).

The checkpoint transport is `ChaosHTTPTransport`: the production HTTPTransport with a fault hook on
its serving side (a delay before each request, a random dropped connection), so heals run slowly
enough to be interrupted and sometimes fail. It lives here, never in the production class.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import threading
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.nn.functional as F

from ft_core.checkpointing import HTTPTransport
from ft_core.ddp import DistributedDataParallel
from ft_core.errors import FTError
from ft_core.manager import Manager, WorldSizeMode
from ft_core.optim import OptimizerWrapper
from ft_core.process_groups import ProcessGroupGloo

EXIT_FILE = "exit"


class RecordLog:
    """Appends JSON records to one file, line-buffered and thread-safe (events arrive from threads)."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - owned for the process lifetime
        self._lock = threading.Lock()

    def write(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "time": time.time(), **fields}, default=str)
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


class EventRecorder(logging.Handler):
    """Copies the Manager's `ft_core.events` records into the log and keeps the latest quorum."""

    def __init__(self, log: RecordLog) -> None:
        super().__init__(level=logging.INFO)
        self._log = log
        self.last_quorum: dict[str, Any] = {}

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if not isinstance(event, dict):
            return
        if event.get("type") == "quorum":
            self.last_quorum = dict(event)
        self._log.write("event", event=event)


class ChaosHTTPTransport(HTTPTransport):
    """HTTPTransport whose server side delays every request and drops some connections (seeded)."""

    def __init__(self, log: RecordLog, *, delay_ms: float, drop: float, seed: int, **kwargs: Any) -> None:
        self._log = log
        self._delay_s = max(0.0, delay_ms) / 1000.0
        self._drop = min(max(drop, 0.0), 1.0)
        self._rng = random.Random(seed)
        self._rng_lock = threading.Lock()
        super().__init__(**kwargs)

    def acquire(self, step: int) -> Any:
        with self._rng_lock:
            drop = self._rng.random() < self._drop
            delay = self._rng.uniform(0.5, 1.5) * self._delay_s
        if drop:
            self._log.write("drop", step=step)
            raise ConnectionAbortedError("chaos: checkpoint request dropped")  # the handler closes the socket
        if delay:
            time.sleep(delay)
        return super().acquire(step)

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        self._log.write("send", step=step, dst_ranks=list(dst_ranks), address=self.metadata())
        super().send_checkpoint(dst_ranks, step, state_dict, timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        self._log.write("recv_start", step=step, src_rank=src_rank, source=metadata)
        try:
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        except Exception as exc:
            self._log.write("recv_failed", step=step, source=metadata, error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        self._log.write("recv_done", step=step, source=metadata)
        return state


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over the raw bytes of every parameter and optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(name.encode())
        h.update(param.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key in sorted(state):
            value = state[key]
            h.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    return h.hexdigest()


def batch(seed: int, step: int, rank: int | None, size: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic batch of one participant at one step (non-participants' gradients are zeroed)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + (rank if rank is not None else 97))
    x = torch.randn(size, features, generator=gen)
    y = torch.randn(size, 4, generator=gen)
    return x, y


def exit_step(path: str) -> int | float:
    """The step after which to exit, once the harness has written it to the exit file."""
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):  # not written yet, or being written
        return float("inf")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ft_core.tools.chaos_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder shared with the harness (logs, exit file)")
    p.add_argument("--min-replicas", type=int, default=2)
    p.add_argument("--timeout", type=float, default=5.0, help="collective and checkpoint timeout, seconds")
    p.add_argument("--quorum-timeout", type=float, default=15.0)
    p.add_argument("--connect-timeout", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0, help="model init and data seed (same on every group)")
    p.add_argument("--features", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.05, help="pause after each step, seconds")
    p.add_argument("--transport-delay-ms", type=float, default=0.0, help="chaos: delay per checkpoint request")
    p.add_argument("--transport-drop", type=float, default=0.0, help="chaos: probability a request is dropped")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    incarnation = int(os.environ.get("FT_RESTART_COUNT", "0"))
    log = RecordLog(os.path.join(args.out, f"g{group}.i{incarnation}.jsonl"))
    recorder = EventRecorder(log)
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.INFO)
    events.propagate = False  # recorded in the JSON log only
    events.addHandler(recorder)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    torch.manual_seed(args.seed)  # every group starts identical (init_sync=False relies on it)
    model = torch.nn.Sequential(torch.nn.Linear(args.features, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.timeout)
    transport = ChaosHTTPTransport(log, delay_ms=args.transport_delay_ms, drop=args.transport_drop,
                                   seed=zlib.crc32(f"{args.seed}/{group}/{incarnation}".encode()),
                                   timeout=timeout, num_chunks=0)
    manager = Manager(ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=save,
                      min_replica_size=args.min_replicas, use_async_quorum=True, init_sync=False,
                      timeout=timeout, quorum_timeout=timedelta(seconds=args.quorum_timeout),
                      connect_timeout=timedelta(seconds=args.connect_timeout),
                      world_size_mode=WorldSizeMode.DYNAMIC, replica_id=f"g{group}", rank=0, world_size=1,
                      checkpoint_transport=transport)
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner)
    log.write("ready", replica_id=manager.replica_id, pid=os.getpid(), group=group, incarnation=incarnation,
              address=transport.metadata())

    exit_file = os.path.join(args.out, EXIT_FILE)
    try:
        while manager.current_step() < exit_step(exit_file):
            step = manager.current_step()
            try:
                optimizer.zero_grad()
                x, y = batch(args.seed, step, manager.participating_rank(), args.batch_size, args.features)
                F.mse_loss(ddp(x), y).backward()
                optimizer.step()
            except FTError as exc:  # e.g. the lighthouse is down: this step does not commit, try the next
                log.write("step_error", step=step, error=f"{type(exc).__name__}: {exc}"[:500])
                time.sleep(0.2)
                continue
            if optimizer.committed:
                quorum = recorder.last_quorum
                log.write("step", step=manager.current_step(), digest=state_digest(model, inner),
                          participants=manager.num_participants(), quorum_id=quorum.get("quorum_id"),
                          replica_ids=quorum.get("replica_ids"), healed=bool(quorum.get("heal")))
            if args.step_sleep:
                time.sleep(args.step_sleep)
        log.write("exit", step=manager.current_step())
    finally:
        manager.shutdown(wait=False)
        log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
