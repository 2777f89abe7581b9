"""One replica group of a chaos run (`ftl chaos`): a small Manager + DDP loop that logs everything the
harness checks, one JSON line at a time (flushed, since the process may be SIGKILLed at any instant).

    python -m ft_core.tools.chaos_worker --out DIR [--min-replicas 2 --timeout 5 ...]

Run by `ft_core.tools.chaos` through the Launcher (REPLICA_GROUP_ID, FT_RESTART_COUNT, FT_LIGHTHOUSE,
FT_TOKEN and torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT come from the environment). Each rank
of each incarnation writes DIR/g<group>.r<rank>.i<incarnation>.jsonl with records keyed by "kind":
- "ready": the process is up (replica_id, pid, rank, the matrix cell it runs).
- "step": after each committed step: step, digest (sha256 of the raw bytes of every parameter,
  optimizer state tensor and buffer), participants, replica_ids, quorum_id, healed, time, and
  "reduce": {name: [got, expected]} for the step's reductions checked against their expected value
  (the average of the participants' ranks, and with --extremes their MAX and MIN).
- with --ledger (ft_core.data.DistributedSampler's exactly-once mode over a dataset of --dataset-size
  indexed samples), each "step" record also carries "epoch" and "consumed": the dataset indices that
  the committed step consumed in this rank's column (the same on every group that committed it).
- "skip": the loop skipped this step's vote on purpose (--skip-prob), as a loop that skips
  `optimizer.step()` does, half of the time its backward too ("backward": true, as for a NaN loss);
  "load_failed": an injected failure of the healed-state load.
- "event": the Manager's structured events (quorum, heal, commit, error) as they happen.
- "send" / "recv_start" / "recv_done" / "recv_failed": the checkpoint transport at work (heals).
- "drop" / "recv_injected": faults the chaos transport injected (a dropped request on the source, a
  failed fetch on the healer).
- "step_error": a step raised (e.g. no lighthouse reachable); the loop goes on.
- "exit": the loop ended: the group committed the step the harness wrote to DIR/exit (every group
  stops after that same commit, so none is left waiting for a quorum).

The checkpoint transport is `ChaosHTTPTransport`: the production HTTPTransport with a fault hook on
its serving side (a delay before each request, a random dropped connection), so heals run slowly
enough to be interrupted and sometimes fail, and on its receiving side (a fetch that fails before it
starts, --recv-fail-prob). It lives here, never in the production class. The load failures are the
worker's own load_state_dict fn raising (--load-fail-prob): both go through the public API only.

The matrix dimensions (`ftl chaos --matrix`): ranks per group (the Launcher's torchrun environment),
--sync (use_async_quorum=False), --init-sync (then every group starts from other weights, so only
init_sync makes them identical), --model batchnorm (BatchNorm buffers, synchronised by ft_core DDP),
--optimizers 2 (two optimizers, one Manager step each: the step's parity picks the optimizer, so the
loop position is part of the committed state and a healed group continues with the right one),
--extremes (MAX and MIN reductions beside the gradient average), and the injected faults above.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import itertools
import json
import logging
import os
import random
import signal
import sys
import threading
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ReduceOp

from ft_core import net, settings
from ft_core.checkpointing import HTTPTransport
from ft_core.data import DistributedSampler
from ft_core.ddp import DistributedDataParallel
from ft_core.errors import FTError
from ft_core.manager import Manager, WorldSizeMode
from ft_core.process_groups import ProcessGroupGloo
from ft_core.tools.chaos_checks import reduced_as_expected

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
        super().__init__(level=logging.DEBUG)  # every event: routine ones (a quorum that changed nothing) are DEBUG
        self._log = log
        self.last_quorum: dict[str, Any] = {}
        self.redo: dict[str, Any] | None = None  # the latest replayed redo (ft_core.redo); the loop clears it per step

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if not isinstance(event, dict):
            return
        if event.get("type") == "quorum":
            self.last_quorum = dict(event)
        elif event.get("type") == "redo" and event.get("replayed"):
            self.redo = dict(event)
        self._log.write("event", event=event)


class ChaosHTTPTransport(HTTPTransport):
    """HTTPTransport whose server side delays every request and drops some connections (seeded)."""

    def __init__(self, log: RecordLog, *, delay_ms: float, drop: float, seed: int, recv_fail: float = 0.0,
                 **kwargs: Any) -> None:
        self._log = log
        self._delay_s = max(0.0, delay_ms) / 1000.0
        self._drop = min(max(drop, 0.0), 1.0)
        self._recv_fail = min(max(recv_fail, 0.0), 1.0)
        self._rng = random.Random(seed)
        self._recv_rng = random.Random(seed + 1)
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
        if self._recv_fail and self._recv_rng.random() < self._recv_fail:
            self._log.write("recv_injected", step=step, source=metadata)
            self._log.write("recv_failed", step=step, source=metadata, error="chaos: injected fetch failure")
            raise ConnectionError("chaos: injected failure while fetching the checkpoint")
        try:
            state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        except Exception as exc:
            self._log.write("recv_failed", step=step, source=metadata, error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        self._log.write("recv_done", step=step, source=metadata)
        return state


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def state_digest(model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> str:
    """sha256 over the raw bytes of every parameter, buffer and optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for name, param in model.named_parameters():
        h.update(name.encode())
        h.update(_tensor_bytes(param))
    for name, buf in model.named_buffers():  # BatchNorm running stats and num_batches_tracked
        h.update(f"buffer.{name}".encode())
        h.update(_tensor_bytes(buf))
    for number, optimizer in enumerate(optimizers):
        for index, state in sorted(optimizer.state_dict()["state"].items()):
            for key in sorted(state):
                value = state[key]
                h.update(f"{number}.{index}.{key}".encode())
                h.update(_tensor_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def extreme_value(seed: int, participants: int, rank: int) -> float:
    """What participant `rank` of `participants` contributes to the MAX/MIN check (negative, so zeros
    would show). Not a function of the step: a group that healed in sync mode participates while its
    current_step() is still the pre-heal one (the healed step is adopted at commit)."""
    return -1.0 - float(zlib.crc32(f"{seed}/{participants}/{rank}".encode()) % 1000)


def build_model(kind: str, features: int, hidden: int) -> torch.nn.Module:
    if kind == "batchnorm":
        return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(hidden, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.Tanh(),
                                   torch.nn.Linear(hidden, 4))
    return torch.nn.Sequential(torch.nn.Linear(features, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 4))


def batch(seed: int, step: int, rank: int | None, size: int, features: int,
          group_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The deterministic batch of one participant at one step (non-participants' gradients are zeroed);
    each rank of a group has its own data, so rank r of every group is compared with rank r only."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + (rank if rank is not None else 97)
                                        + group_rank * 7919)
    x = torch.randn(size, features, generator=gen)
    y = torch.randn(size, 4, generator=gen)
    return x, y


def indexed_batch(seed: int, indices: list[int], features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of dataset indices (each derived from its index alone, like a real dataset)."""
    xs, ys = [], []
    for i in indices:
        gen = torch.Generator().manual_seed(seed * 1_000_003 + 7 * i + 1)
        xs.append(torch.randn(features, generator=gen))
        ys.append(torch.randn(4, generator=gen))
    return torch.stack(xs), torch.stack(ys)


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
    p.add_argument("--sync", action="store_true", help="use_async_quorum=False")
    p.add_argument("--init-sync", action="store_true", help="init_sync=True, every group starting from other weights")
    p.add_argument("--model", default="mlp", choices=("mlp", "batchnorm"))
    p.add_argument("--optimizers", type=int, default=1, choices=(1, 2), help="optimizers, one Manager step each")
    p.add_argument("--extremes", action="store_true", help="MAX and MIN reductions beside the gradient average")
    p.add_argument("--skip-prob", type=float, default=0.0, help="chaos: probability a step skips its vote")
    p.add_argument("--load-fail-prob", type=float, default=0.0, help="chaos: probability a healed-state load raises")
    p.add_argument("--recv-fail-prob", type=float, default=0.0, help="chaos: probability a checkpoint fetch fails")
    p.add_argument("--cell", default="", help="the matrix cell's name, for the records")
    p.add_argument("--ledger", action="store_true", help="data from the exactly-once DistributedSampler; log "
                                                         "each committed step's consumed indices")
    p.add_argument("--dataset-size", type=int, default=240, help="samples per epoch with --ledger")
    return p.parse_args(argv)


def issue_reductions(manager: Manager, seed: int, extremes: bool) -> dict[str, float]:
    """This step's checked reductions, issued beside the gradient average: {name: result}. A participant
    sends its rank (AVG) and its `extreme_value` (MAX, MIN); non-participants send the op's identity, so
    the result is the participants' alone (see `expected_reductions`)."""
    rank = manager.participating_rank()
    n = manager.num_participants()
    tensors = {"avg": torch.tensor([float(rank) if rank is not None else 12345.0], dtype=torch.float64)}
    works = [manager.allreduce(tensors["avg"])]
    if extremes:
        for name, op in (("max", ReduceOp.MAX), ("min", ReduceOp.MIN)):
            tensors[name] = torch.tensor([extreme_value(seed, n, rank) if rank is not None else 777.0],
                                         dtype=torch.float64)
            works.append(manager.allreduce(tensors[name], op))
    for work in works:
        work.wait()
    return {name: float(t.item()) for name, t in tensors.items()}


def expected_reductions(got: dict[str, float], seed: int, n: int, redo: dict[str, Any] | None = None,
                        issued: tuple[int, int | None] | None = None) -> dict[str, list[float]]:
    """{name: [got, expected]} once the step committed with `n` participants, which had ranks 0..n-1.

    A step redone without a lost group (`redo`: its replayed redo event; `issued`: the participants and this
    group's rank when it issued the reductions) holds two kinds of values (docs/guarantees.md, "Redone
    steps"): the step's first `kept` reductions stood as the old quorum reduced them, and the rest were
    replayed among the survivors, from the inputs they issued for the old quorum (their old ranks), divided
    by the survivors' count. So the checked reductions (in the order issued) must be a prefix that stood
    (none if `kept` is 0), then the rest as one set of `n` old ranks, this group's among them, reduces them.
    Which old ranks survived this group cannot see: the first such split that explains every value is the
    expectation; if none does, the plain one (every reduction replayed by the first such set)."""
    if redo is None or issued is None or issued[1] is None:
        plain = _expected(seed, n, range(n))
        return {name: [value, plain[name]] for name, value in got.items()}
    old, mine = issued
    names = list(got)
    whole = _expected(seed, old, range(old))
    sets = [_expected(seed, old, ranks) for ranks in itertools.combinations(range(old), n) if mine in ranks]
    splits = [(k, e) for k in (range(len(names) + 1) if redo.get("kept") else [0]) for e in sets or [whole]]
    for k, survivors in splits + splits[:1]:  # the fallback: the first split, reported as it is
        expected = {name: (whole if i < k else survivors)[name] for i, name in enumerate(names)}
        if all(reduced_as_expected(got[name], expected[name]) for name in names):
            break
    return {name: [got[name], expected[name]] for name in names}


def _expected(seed: int, n: int, ranks: Any) -> dict[str, float]:
    """AVG, MAX and MIN over the inputs that participants `ranks` of `n` contribute."""
    ranks = list(ranks)
    values = [extreme_value(seed, n, r) for r in ranks]
    return {"avg": sum(ranks) / len(ranks) if ranks else 0.0, "max": max(values, default=0.0),
            "min": min(values, default=0.0)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness dumps every stack when the job stalls
    group = os.environ.get("REPLICA_GROUP_ID", "0")
    incarnation = int(os.environ.get("FT_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    log = RecordLog(os.path.join(args.out, f"g{group}.r{rank}.i{incarnation}.jsonl"))
    recorder = EventRecorder(log)
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.DEBUG)
    events.propagate = False  # recorded in the JSON log only
    events.addHandler(recorder)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    # Without init_sync every group must start identical (same seed); with it, each group and rank starts
    # from other weights and only the initial heal makes them identical.
    torch.manual_seed(args.seed * 7 + rank + ((1 + int(group)) * 1009 * (1 + incarnation) if args.init_sync else 0))
    model = build_model(args.model, args.features, args.hidden)
    params = list(model.parameters())
    if args.optimizers == 2:  # a "generator" and a "head", one Manager step each
        split = len(params) - 2
        inners = [torch.optim.AdamW(params[:split], lr=1e-3), torch.optim.SGD(params[split:], lr=1e-2, momentum=0.9)]
    else:
        inners = [torch.optim.AdamW(params, lr=1e-3)]
    fault_rng = random.Random(zlib.crc32(f"faults/{args.seed}/{group}/{incarnation}/{rank}".encode()))

    def save() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": [o.state_dict() for o in inners]}

    def load(state: dict[str, Any]) -> None:
        if args.load_fail_prob and fault_rng.random() < args.load_fail_prob:
            log.write("load_failed", step=manager.current_step())
            raise RuntimeError("chaos: injected failure while loading the healed state")
        model.load_state_dict(state["model"])
        for o, sd in zip(inners, state["optim"]):
            o.load_state_dict(sd)

    timeout = timedelta(seconds=args.timeout)
    group_store = None
    if world_size > 1 and rank == 0:  # what torchrun's agent does: host the group's TCPStore at MASTER_PORT
        group_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=args.connect_timeout))
    # the checkpoint server advertises and binds what the Manager's own servers do (FT_HOST, else the route
    # toward the lighthouse: loopback on one machine, the host's address on simulated hosts)
    host = net.advertised_host(settings.value("FT_HOST"), settings.value("FT_LIGHTHOUSE"))
    transport = ChaosHTTPTransport(log, delay_ms=args.transport_delay_ms, drop=args.transport_drop,
                                   seed=zlib.crc32(f"{args.seed}/{group}/{incarnation}/{rank}".encode()),
                                   recv_fail=args.recv_fail_prob, timeout=timeout, num_chunks=0, hostname=host,
                                   bind=net.format_host_port(net.bind_host(host, settings.value("FT_BIND_ALL")), 0))
    manager = Manager(ProcessGroupGloo(timeout=timeout), load_state_dict=load, state_dict=save,
                      min_replica_size=args.min_replicas, use_async_quorum=not args.sync, init_sync=args.init_sync,
                      timeout=timeout, quorum_timeout=timedelta(seconds=args.quorum_timeout),
                      connect_timeout=timedelta(seconds=args.connect_timeout),
                      world_size_mode=WorldSizeMode.DYNAMIC, replica_id=f"g{group}", rank=rank, world_size=world_size,
                      checkpoint_transport=transport)
    ddp = DistributedDataParallel(manager, model)
    log.write("ready", replica_id=manager.replica_id, pid=os.getpid(), group=group, incarnation=incarnation,
              rank=rank, world_size=world_size, address=transport.metadata(), cell=args.cell)

    exit_file = os.path.join(args.out, EXIT_FILE)
    attempts: dict[int, int] = {}
    sampler = None
    if args.ledger:
        sampler = DistributedSampler(range(args.dataset_size), replica_group_id=int(group),
                                     num_replica_groups=int(os.environ.get("NUM_REPLICA_GROUPS", "3")),
                                     group_rank=rank, num_replicas=world_size, seed=args.seed, manager=manager,
                                     batch_size=args.batch_size)

    def batches() -> Any:
        """What each Manager step trains on: the sampler's batches (epoch after epoch), or synthetic ones."""
        while True:
            if sampler is None:
                yield None
                continue
            empty = True
            for drawn in sampler:
                empty = False
                yield drawn
            if empty:  # an iteration with nothing to train: say so (the harness reports the stall), no spin
                log.write("sampler_empty", step=manager.current_step(), epoch=sampler.epoch)
                time.sleep(0.5)

    def one_step(drawn: list[int] | None) -> tuple[bool, dict[str, Any]]:
        step = manager.current_step()
        recorder.redo = None  # set if this step is redone
        manager.start_quorum()  # one Manager step per optimizer step (two per batch with --optimizers 2)
        for o in inners:
            o.zero_grad()
        if drawn is None:
            x, y = batch(args.seed, step // args.optimizers, manager.participating_rank(), args.batch_size,
                         args.features, rank)
            weight = 1.0
        else:
            weight = sampler.loss_weight()  # once per step, after the quorum and before backward
            x, y = indexed_batch(args.seed, list(drawn) or [0], args.features)
            weight = weight if drawn else 0.0
        loss = F.mse_loss(ddp(x), y) * weight
        # a skipped optimizer step (e.g. a GradScaler inf), half of them with the backward skipped too (a NaN
        # loss): every rank of the group draws the same, and only a step's first attempt may skip (a skipped
        # step is retried, never skipped forever)
        attempts[step] = attempts.get(step, 0) + 1
        skip = random.Random(zlib.crc32(f"skip/{args.seed}/{group}/{incarnation}/{step}".encode()))
        skipping = args.skip_prob and attempts[step] == 1 and skip.random() < args.skip_prob
        if skipping and skip.random() < 0.5:
            log.write("skip", step=step, backward=True)
            return False, {}
        if (step + int(group)) % 2:  # groups mix both ways of dividing their shares in one step (ft_core.ddp)
            ddp.backward(loss)
        else:
            loss.backward()
        issued = (manager.num_participants(), manager.participating_rank())
        got = issue_reductions(manager, args.seed, args.extremes)
        if skipping:
            log.write("skip", step=step)
            return False, {}
        extra: dict[str, Any] = {}
        if sampler is not None and sampler.last_batch is not None and sampler.last_batch.participating_rank \
                is not None:  # a participant's view of the step (a healer's position is the stale one)
            record = sampler.last_batch
            extra = {"epoch": record.epoch, "consumed": list(record.consumed)}
        if not manager.should_commit():
            return False, {}
        # the step committed is current_step() - 1 (a healed group adopted its source's step), so its
        # parity picks the same optimizer on every group
        inners[(manager.current_step() - 1) % len(inners)].step()
        extra["reduce"] = expected_reductions(got, args.seed, manager.num_participants(), recorder.redo, issued)
        return True, extra

    try:
        for drawn in batches():
            if manager.current_step() >= exit_step(exit_file):
                break
            try:
                committed, extra = one_step(drawn)
            except FTError as exc:  # e.g. the lighthouse is down: this step does not commit, try the next
                log.write("step_error", step=manager.current_step(), error=f"{type(exc).__name__}: {exc}"[:500])
                time.sleep(0.2)
                continue
            if committed:
                quorum = recorder.last_quorum
                log.write("step", step=manager.current_step(), digest=state_digest(model, *inners),
                          participants=manager.num_participants(), quorum_id=quorum.get("quorum_id"),
                          replica_ids=quorum.get("replica_ids"), healed=bool(quorum.get("heal")), **extra)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        log.write("exit", step=manager.current_step())
    finally:
        manager.shutdown(wait=False)
        log.close()
        del group_store
    return 0


if __name__ == "__main__":
    sys.exit(main())
