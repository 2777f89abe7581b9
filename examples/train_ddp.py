"""Fault-tolerant data-parallel training with a custom loop: Manager + DDP + OptimizerWrapper + sampler.

Run one replica group per command (each may die and be restarted at any time):

    ftl lighthouse --bind 127.0.0.1:29510 --min-replicas 1 &
    FT_LIGHTHOUSE=127.0.0.1:29510 REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 python examples/train_ddp.py --steps 100
    FT_LIGHTHOUSE=127.0.0.1:29510 REPLICA_GROUP_ID=1 NUM_REPLICA_GROUPS=2 python examples/train_ddp.py --steps 100

or with several ranks per group, one torchrun per group:

    FT_LIGHTHOUSE=... REPLICA_GROUP_ID=0 NUM_REPLICA_GROUPS=2 torchrun --standalone --nproc-per-node 2 \
        examples/train_ddp.py --steps 100

The `--kill-at STEP:POINT` flag SIGKILLs this process at a chosen point of a step (fault injection
for tests and benchmarks); `--digest-out` / `--step-log` / `--events` write machine-readable progress.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: the benchmark splits start-up from the rest

import argparse  # noqa: E402
import faulthandler  # noqa: E402
import gc  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ft_core.data import DistributedSampler  # noqa: E402
from ft_core.ddp import DistributedDataParallel  # noqa: E402
from ft_core.manager import Manager, WorldSizeMode  # noqa: E402
from ft_core.optim import OptimizerWrapper  # noqa: E402
from ft_core.process_groups import ProcessGroupGloo  # noqa: E402

KILL_POINTS = ("forward", "allreduce", "between_chunks", "should_commit", "send_checkpoint", "serve_checkpoint")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="train until the group has committed this many steps")
    p.add_argument("--transport", choices=("http", "pg"), default="http", help="checkpoint transport for healing")
    p.add_argument("--seed", type=int, default=0, help="model init seed (same on every group)")
    p.add_argument("--hidden", type=int, nargs="+", default=[64, 32], help="hidden layer widths")
    p.add_argument("--in-features", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dataset-size", type=int, default=4096)
    p.add_argument("--min-replicas", type=int, default=1, help="min_replica_size: participants needed to commit")
    p.add_argument("--spares", action="store_true", help="WorldSizeMode.FIXED_WITH_SPARES (min-replicas contribute)")
    p.add_argument("--sync-quorum", action="store_true", help="use_async_quorum=False: heal before the forward")
    p.add_argument("--no-init-sync", action="store_true", help="init_sync=False (groups must start identical)")
    p.add_argument("--timeout", type=float, default=10.0, help="collective/heal timeout, seconds")
    p.add_argument("--quorum-timeout", type=float, default=30.0)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step (slows the run down)")
    p.add_argument("--kill-at", default=None, help=f"STEP:POINT, POINT in {KILL_POINTS}: SIGKILL self there")
    p.add_argument("--kill-file", default=None, help="SIGKILL self at the point this file names (tests)")
    p.add_argument("--stop-file", default=None, help="once this file holds a step number, stop there")
    p.add_argument("--heal-delay", type=float, default=0.0,
                   help="fault injection: the first heal fetch starts this many seconds late (a slow restart)")
    p.add_argument("--digest-out", default=None, help="write the final model+optimizer digest (JSON) here")
    p.add_argument("--step-log", default=None, help="append one JSON line per committed step (step, digest)")
    p.add_argument("--no-step-digest", action="store_true",
                   help="leave the digest out of the step log (sha256 of the whole state, ~25 ms a step at 3.7M "
                        "parameters: benchmarks time the library, not this check)")
    p.add_argument("--events", default=None, help="append the Manager's structured events as JSON lines")
    return p.parse_args(argv)


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """sha256 over every parameter and optimizer state tensor, bit for bit."""
    h = hashlib.sha256()

    def feed(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            h.update(obj.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())  # the buffer, not a copy
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                h.update(str(key).encode())
                feed(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                feed(item)
        else:
            h.update(repr(obj).encode())

    feed(model.state_dict())
    feed(optimizer.state_dict()["state"])
    return h.hexdigest()


class JsonLines(logging.Handler):
    """Writes each ft_core event as one JSON line (flushed: the process may be SIGKILLed)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self._file = open(path, "a", buffering=1)

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if event is not None:
            self._file.write(json.dumps(event, default=str) + "\n")


def group_number(replica_group_id: str) -> int:
    digits = re.search(r"(\d+)$", replica_group_id)
    return int(digits.group(1)) if digits else 0


class KillSwitch:
    """Fault injection: SIGKILL this process at POINT, either from `--kill-at STEP:POINT` (the first
    time POINT is reached at a step >= STEP) or when `--kill-file` holds POINT (a test arms it)."""

    def __init__(self, manager: Manager, at: str | None, path: str | None) -> None:
        self.manager = manager
        self.step, self.point = -1, None
        if at:
            step_s, _, point = at.partition(":")
            if point not in KILL_POINTS:
                raise SystemExit(f"--kill-at POINT must be one of {KILL_POINTS}, got {point!r}")
            self.step, self.point = int(step_s), point
        self.path = path

    def armed(self, where: str) -> bool:
        if self.point == where and self.manager.current_step() >= self.step:
            return True
        if self.path and os.path.exists(self.path):
            with open(self.path) as f:
                return f.read().strip() == where
        return False

    def check(self, where: str) -> None:
        if self.armed(where):
            print(f"[fault injection] SIGKILL at step {self.manager.current_step()} during {where}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def install_kill(switch: KillSwitch, manager: Manager, ddp: torch.nn.Module) -> None:
    """Hook the kill switch into the four points of a step, and into a healer's fetch from this source."""
    ddp.register_forward_pre_hook(lambda *_: switch.check("forward"))
    issue = manager._allreduce_future
    issued: list[tuple[int, torch.futures.Future]] = []  # this step's reductions so far

    def issue_then_check(tensor: torch.Tensor, op: object = dist.ReduceOp.AVG, **kw: object) -> torch.futures.Future:
        issued[:] = [i for i in issued if i[0] == manager.current_step()]
        if len(issued) == 1 and switch.armed("between_chunks"):  # instead of the second: the first done everywhere
            try:
                issued[0][1].wait()
            except Exception as exc:  # noqa: BLE001 - it failed: the kill still lands, on a step already failing
                print(f"[fault injection] between_chunks: the first reduction failed ({exc})", flush=True)
            time.sleep(0.2)  # the peers' first is delivered, their second waits for ours
            switch.check("between_chunks")
        fut = issue(tensor, op, **kw)
        issued.append((manager.current_step(), fut))
        switch.check("allreduce")
        return fut

    manager._allreduce_future = issue_then_check  # type: ignore[method-assign]
    vote = manager._vote

    def vote_then_check(local: bool, timeout: object) -> bool:
        decision = vote(local, timeout)
        switch.check("should_commit")
        return decision

    manager._vote = vote_then_check  # type: ignore[method-assign]
    transport = manager.checkpoint_transport
    send = transport.send_checkpoint

    def send_then_check(dst_ranks: list[int], step: int, state_dict: object, timeout: object) -> None:
        send(dst_ranks, step, state_dict, timeout)
        if switch.armed("send_checkpoint"):  # only then: a source's vote waits for its staging (a benchmark's too)
            time.sleep(0.05)  # let the healing peer start fetching
            switch.check("send_checkpoint")

    transport.send_checkpoint = send_then_check
    acquire = getattr(transport, "acquire", None)  # the HTTP transport's server: a healer's request arrives
    if acquire is not None:

        def acquire_then_check(step: int) -> object:
            taken = acquire(step)
            if taken[0] is not None:  # a healer is fetching from this source now: die mid-transfer
                switch.check("serve_checkpoint")
            return taken

        transport.acquire = acquire_then_check


def delay_first_heal(manager: Manager, seconds: float) -> None:
    """Fault injection: the first heal fetch of this process starts `seconds` late, as a restarted
    process's does on a busy machine (its source may die meanwhile)."""
    sources = manager._heal_sources
    fetch = sources.fetch
    delayed = threading.Event()

    def late_fetch(*args: object, **kwargs: object) -> object:
        if not delayed.is_set():
            delayed.set()
            time.sleep(seconds)
        return fetch(*args, **kwargs)

    sources.fetch = late_fetch  # type: ignore[method-assign]


def stop_step(args: argparse.Namespace) -> int:
    """--steps, or the step written in --stop-file once a test writes it."""
    if args.stop_file and os.path.exists(args.stop_file):
        with open(args.stop_file) as f:
            text = f.read().strip()
        if text:
            return int(text)
    return args.steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    replica_group_id = os.environ.get("REPLICA_GROUP_ID", "0")
    num_groups = int(os.environ.get("NUM_REPLICA_GROUPS", "1"))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout * 3))
    if args.events:
        events = logging.getLogger("ft_core.events")
        events.setLevel(logging.DEBUG)  # every event: routine quorums and commits are DEBUG
        events.addHandler(JsonLines(args.events.format(rank=rank)))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # every thread's stack, when a test sees it stall

    torch.manual_seed(args.seed)
    widths = [args.in_features, *args.hidden]
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(widths[-1], 4))
    model = torch.nn.Sequential(*layers)
    inner_optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def save() -> dict:
        return {"model": model.state_dict(), "optim": inner_optimizer.state_dict()}

    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner_optimizer.load_state_dict(state["optim"])

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    transport = None  # the Manager's default: HTTPTransport
    if args.transport == "pg":
        from ft_core.checkpointing import PGTransport

        transport = PGTransport(pg, timeout=timedelta(seconds=args.timeout), device=torch.device("cpu"))
    manager = Manager(
        pg, load_state_dict=load, state_dict=save, checkpoint_transport=transport,
        min_replica_size=args.min_replicas, use_async_quorum=not args.sync_quorum,
        timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=args.quorum_timeout),
        world_size_mode=WorldSizeMode.FIXED_WITH_SPARES if args.spares else WorldSizeMode.DYNAMIC,
        replica_id=replica_group_id, init_sync=not args.no_init_sync, rank=rank, world_size=world_size)
    ddp = DistributedDataParallel(manager, model)
    optimizer = OptimizerWrapper(manager, inner_optimizer)
    if args.kill_at or args.kill_file:
        install_kill(KillSwitch(manager, args.kill_at, args.kill_file), manager, ddp)
    if args.heal_delay:
        delay_first_heal(manager, args.heal_delay)

    gen = torch.Generator().manual_seed(1234)
    features = torch.randn(args.dataset_size, args.in_features, generator=gen)
    labels = torch.randint(0, 4, (args.dataset_size,), generator=gen)
    dataset = torch.utils.data.TensorDataset(features, labels)
    sampler = DistributedSampler(dataset, replica_rank=group_number(replica_group_id) % max(num_groups, 1),
                                 num_replica_groups=max(num_groups, 1), group_rank=rank, num_replicas=world_size,
                                 seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    step_log = open(args.step_log.format(rank=rank), "a", buffering=1) if args.step_log else None
    print(f"group {replica_group_id} rank {rank}/{world_size}: ready in {time.time() - STARTED:.2f}s "
          f"(replica_id {manager.replica_id})", flush=True)
    if step_log:
        step_log.write(json.dumps({"event": "ready", "time": time.time(), "started": STARTED,
                                   "cpu": time.process_time()}) + "\n")

    epoch = 0
    while manager.current_step() < stop_step(args):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if manager.current_step() >= stop_step(args):
                break
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            ddp.backward(loss)  # loss.backward() works too; this divides by the loss (one pass less)
            optimizer.step()
            if optimizer.committed and step_log:
                row = {"event": "commit", "step": manager.current_step(), "time": time.time(),
                       "participants": manager.num_participants()}
                if not args.no_step_digest:
                    row["digest"] = state_digest(model, inner_optimizer)
                step_log.write(json.dumps(row) + "\n")
            if manager.current_step() % 10 == 0 and optimizer.committed and rank == 0:
                print(f"group {replica_group_id}: step {manager.current_step()} loss {loss.item():.4f} "
                      f"participants {manager.num_participants()}", flush=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        epoch += 1

    digest = state_digest(model, inner_optimizer)
    if args.digest_out:
        with open(args.digest_out.format(rank=rank), "w") as f:
            json.dump({"digest": digest, "step": manager.current_step(), "rank": rank,
                       "replica_id": manager.replica_id}, f)
    print(f"group {replica_group_id} rank {rank}: done at step {manager.current_step()} digest {digest[:16]}",
          flush=True)
    manager.finish()  # the normal end: a group restarted after it is refused instead of retraining the job alone
    manager.shutdown()
    pg.shutdown()
    if world_size > 1:
        dist.destroy_process_group()
    if step_log:
        step_log.write(json.dumps({"event": "shutdown", "time": time.time()}) + "\n")
        step_log.close()
    # Everything is closed; skip the interpreter's final full garbage collection over torch's
    # objects, which alone delays the exit by 0.3-1 s on a busy machine.
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
