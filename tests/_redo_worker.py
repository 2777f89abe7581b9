"""One replica group (one process) of the core API for tests/test_redo_step.py: a small MLP under
ft_core DDP + OptimizerWrapper, AdamW, each group its own data. The test steers it with files:

- `<workdir>/g<N>.kill` holding `POINT:STEP`: SIGKILL self at POINT of step STEP (or later):
  `forward` (after the step's quorum is issued, before the forward pass), `allreduce` (instead of
  issuing the step's first cross-group reduction, while the peers' are in flight), `second-allreduce`
  (instead of issuing its second, once the first completed everywhere: with --bucket-cap-mb, a DDP
  chunk delivered while a later one is in flight; it first writes `g<N>.dying.json`, its own
  `param_sums`), `reduced` (after the backward pass: every reduction of the step completed, before the
  vote) or `vote` (after the group's vote).
  `stall` kills nothing: at the `allreduce` point it writes `g<N>.stalled` (the step) and waits (at most
  90 s) while the file still says `stall`, then issues the reduction (the test cuts the host meanwhile);
- `<workdir>/hold` holding `STEP`: at the start of the forward pass of that step (or the first one after), wait (at most 20 s)
  until the Manager has recorded an error (the lost peer), so the kill lands inside this group's step
  before any of its reductions is issued;
- `<workdir>/hold_vote` holding `STEP`: unless a kill is armed here, after the backward pass of that step (or
  the first one after), wait (at most 20 s) until the lighthouse's notice of a lost peer reached the
  Manager, and record whether it did (`lost_before_vote`), so the loss lands after the gradients'
  reductions and before the rest of the step (--read-reduced's loss reduction, the vote). Each such rank
  first writes `reduced.g<N>.r<R>`, and a group whose kill is armed at `reduced` or `vote` dies only once
  every other group's ranks have (at most 20 s): a kill as soon as its own reductions completed could
  land while a slower survivor rank's were still in flight;
- `<workdir>/slow_issue` holding `STEP`: in that step, every cross-group reduction returns to its caller
  0.3 s after it was issued (as if the thread were preempted there);
- `<workdir>/stop` holding `STEP`: stop there.

With --ranks N the group has N ranks (one process each, --rank R, all meeting in the TCPStore the test
serves for this incarnation of the group, --store HOST:PORT): every rank reads the same files, so a kill
takes the whole group at the same point, and each rank writes its own files (`g<N>.r<R>.i<incarnation>...`).

The backward runs as `ddp.backward(loss)` (the loss divided for the average, ft_core.ddp.backward_scale),
or as a plain `loss.backward()` with --plain-backward. Every step also records four fixed random
projections of this group's own gradient (`local`, from a copy of the model) and of the reduced one
(`reduced`, right after backward): the reduction is linear, so `reduced` is the mean of the
participants' `local`.

With --bucket-cap-mb the DDP chunks are that small (several chunks), and each step also records the sum of
each parameter's own gradient (`param_sums`, from the copy) and of its reduced one (`reduced_param_sums`).

With --batchnorm each step also records the BatchNorm layer's running stats (their sums) before the
vote's sync (`own_buffers`) and after it (`buffers`); --sort-first N gives group N the replica id `aN`, so it
sorts first and is the groups' first participant, whose buffers every group takes.

With --read-reduced the loop reads reduced values before the vote, as real loops do: it averages its
loss across the groups (`manager.allreduce(...).wait()`, after the backward pass, or before it with
--loss-first) and clips the reduced gradients (`clip_grad_norm_`), and records both; after the step it
records the norm of the gradients the optimizer used.

Writes `g<N>.i<incarnation>.steps.jsonl` (one line per vote: step voted on, step after, committed, digest of parameters and
optimizer state, participants) and `...events.jsonl` (the Manager's structured events).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.train_ddp import JsonLines, state_digest
from ft_core.data import DistributedSampler
from ft_core.ddp import DistributedDataParallel
from ft_core.manager import Manager
from ft_core.optim import OptimizerWrapper
from ft_core.process_groups import ProcessGroupGloo


GROUPS = 3  # the test's replica groups


def read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except FileNotFoundError:
        return ""


def write_text(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def join_group(store: str, rank: int, ranks: int) -> None:
    """The group's own process group (DDP's, inside the group), in the store the test serves for it."""
    host, port = store.rsplit(":", 1)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=client, rank=rank, world_size=ranks, timeout=timedelta(seconds=30))


def reduced_loss(manager: Manager, loss: torch.Tensor) -> tuple[float, float]:
    """(this group's loss, the loss averaged across the groups), read at once, before the vote."""
    mine = loss.detach().reshape(1).clone()
    reduced = mine.clone()
    manager.allreduce(reduced).wait()
    return float(mine.item()), float(reduced.item())


def buffer_sums(layer: torch.nn.Module) -> list[float]:
    return [float(b.double().sum()) for b in layer.buffers() if b.is_floating_point()]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=1)
    p.add_argument("--rank", type=int, default=0, help="this process's rank inside its group")
    p.add_argument("--ranks", type=int, default=1, help="ranks per group")
    p.add_argument("--store", default="", help="with --ranks > 1: HOST:PORT of the group's TCPStore")
    p.add_argument("--workdir", required=True)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--exactly-once", action="store_true", help="draw batches from ft_core's exactly-once sampler")
    p.add_argument("--read-reduced", action="store_true", help="read the reduced loss and gradients before the vote")
    p.add_argument("--loss-first", action="store_true", help="with --read-reduced: reduce the loss before backward")
    p.add_argument("--max-norm", type=float, default=0.05)
    p.add_argument("--plain-backward", action="store_true", help="loss.backward() instead of ddp.backward(loss)")
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's bucket cap: several chunks when small")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm layer: running stats synced at the vote")
    p.add_argument("--sort-first", type=int, default=-1,
                   help="this group's replica id sorts before the others' ('a<N>'): participating rank 0, the "
                        "group whose buffers every group takes")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank_part = "" if args.ranks == 1 else f".r{args.rank}"
    name = f"g{args.group}{rank_part}.i{args.incarnation}"
    prefix = os.path.join(args.workdir, name)
    store_host, _, store_port = args.store.rpartition(":")
    if args.ranks > 1:
        join_group(args.store, args.rank, args.ranks)
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.INFO)
    events.addHandler(JsonLines(prefix + ".events.jsonl"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(64)] if args.batchnorm else []  # buffers: synced across groups before the vote
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), *norm, torch.nn.ReLU(), torch.nn.Linear(64, 32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 4))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    def load(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    manager = Manager(pg, load_state_dict=load, state_dict=lambda: {"model": model.state_dict(),
                                                                    "optim": inner.state_dict()},
                      replica_id=f"{'a' if args.group == args.sort_first else 'g'}{args.group}", rank=args.rank,
                      world_size=args.ranks,
                      store_addr=store_host or None, store_port=int(store_port) if store_port else None,
                      timeout=timedelta(seconds=args.timeout),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30))
    ddp = DistributedDataParallel(manager, model, **({} if args.bucket_cap_mb is None else
                                                     {"bucket_cap_mb": args.bucket_cap_mb}))
    optimizer = OptimizerWrapper(manager, inner)
    shadow = copy.deepcopy(model)
    numel = sum(q.numel() for q in model.parameters())
    directions = torch.randn(4, numel, generator=torch.Generator().manual_seed(5), dtype=torch.float64)

    def projections(grads: list[torch.Tensor]) -> list[float]:
        return (directions @ torch.cat([g.reshape(-1) for g in grads]).double()).tolist()

    def sums(grads: list[torch.Tensor]) -> list[float]:
        return [float(g.double().sum()) for g in grads]
    kill_file, hold_file = os.path.join(args.workdir, f"g{args.group}.kill"), os.path.join(args.workdir, "hold")

    def armed(point: str, at: int | None = None) -> bool:
        """At `point` of step `at` (default: the step in progress)."""
        what, _, step = read(kill_file).partition(":")
        return what == point and (manager.current_step() if at is None else at) >= int(step or 0)

    def die(point: str, at: int | None = None) -> None:
        print(f"SIGKILL self at step {manager.current_step() if at is None else at} during {point}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def before_forward(*_: object) -> None:
        if armed("forward"):
            manager.wait_quorum()  # the step's quorum holds this group: its loss is pushed to the others
            die("forward")
        hold = read(hold_file)
        if hold and manager.current_step() >= int(hold) and not held:
            held.append(manager.current_step())
            deadline = time.monotonic() + 20
            while manager.errored() is None and time.monotonic() < deadline:
                time.sleep(0.005)

    def survivors_reduced() -> None:
        """With hold_vote: wait until every rank of every other group has completed the step's reductions."""
        if not read(os.path.join(args.workdir, "hold_vote")):
            return
        markers = [os.path.join(args.workdir, f"reduced.g{g}.r{r}") for g in range(GROUPS) if g != args.group
                   for r in range(args.ranks)]
        deadline = time.monotonic() + 20
        while not all(os.path.exists(m) for m in markers) and time.monotonic() < deadline:
            time.sleep(0.005)

    held: list[int] = []
    seen: dict = {}  # what this step records (its row), read by a kill that writes it first
    hold_vote_at, held_vote = "", False  # the hold_vote file's step, read once (the test removes the file)
    ddp.register_forward_pre_hook(before_forward)
    issue = manager.allreduce
    issued: list = []  # this step's reductions: [(step, work)]

    def check_then_allreduce(tensor: torch.Tensor, *a: object, **kw: object) -> object:
        if armed("allreduce"):
            time.sleep(0.05)  # the peers' reductions are in flight, waiting for ours: it never comes
            die("allreduce")
        issued[:] = [i for i in issued if i[0] == manager.current_step()]
        if armed("second-allreduce") and len(issued) == 1:
            issued[0][1].wait()  # the first completed here, so every group sent its share
            write_text(os.path.join(args.workdir, f"g{args.group}.dying.json"), json.dumps(seen))
            time.sleep(0.2)  # the peers' first delivered, their second in flight, waiting for ours
            die("second-allreduce")
        if armed("stall"):
            write_text(os.path.join(args.workdir, f"g{args.group}.stalled"), str(manager.current_step()))
            deadline = time.monotonic() + 90
            while read(kill_file).startswith("stall") and time.monotonic() < deadline:
                time.sleep(0.02)
        work = issue(tensor, *a, **kw)
        issued.append((manager.current_step(), work))
        slow = read(os.path.join(args.workdir, "slow_issue"))
        if slow and manager.current_step() == int(slow):
            time.sleep(0.3)  # as if preempted right after issuing: the peer's loss lands before our next line
        return work

    manager.allreduce = check_then_allreduce  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(1000 + args.group + 100 * args.rank)
    sampler = None
    if args.exactly_once:
        data = torch.utils.data.TensorDataset(torch.randn(100000, 16, generator=torch.Generator().manual_seed(7)),
                                              torch.randint(0, 4, (100000,), generator=torch.Generator().manual_seed(8)))
        sampler = DistributedSampler(data, replica_group_id=args.group, num_replica_groups=GROUPS, manager=manager,
                                     batch_size=8, shuffle=False)
        batches = iter(torch.utils.data.DataLoader(data, batch_sampler=sampler))
    log = open(prefix + ".steps.jsonl", "a", buffering=1)  # noqa: SIM115 (open until exit)
    print(f"group {args.group} ready (replica_id {manager.replica_id})", flush=True)
    while True:
        stop = read(os.path.join(args.workdir, "stop"))
        if stop and manager.current_step() >= int(stop):
            break
        optimizer.zero_grad()
        if sampler is not None:
            x, y = next(batches)
        else:
            x = torch.randn(32, 16, generator=gen)
            y = torch.randint(0, 4, (32,), generator=gen)
        loss = F.cross_entropy(ddp(x), y)
        weight = sampler.loss_weight() if sampler is not None else 1.0
        if sampler is not None:
            loss = loss * weight
        seen.clear()
        shadow.load_state_dict(model.state_dict())
        shadow.zero_grad()
        (F.cross_entropy(shadow(x), y) * weight).backward()
        seen["local"] = projections([q.grad for q in shadow.parameters()])
        if args.bucket_cap_mb is not None:
            seen["param_sums"] = sums([q.grad for q in shadow.parameters()])
        if args.read_reduced and args.loss_first:
            seen["loss"], seen["reduced_loss"] = reduced_loss(manager, loss)
        if args.plain_backward:
            loss.backward()
        else:
            ddp.backward(loss)
        seen["reduced"] = projections([q.grad for q in model.parameters()])
        if args.bucket_cap_mb is not None:
            seen["reduced_param_sums"] = sums([q.grad for q in model.parameters()])
        if armed("reduced"):
            survivors_reduced()
            die("reduced")
        hold_vote_at = hold_vote_at or read(os.path.join(args.workdir, "hold_vote"))
        if hold_vote_at and manager.current_step() >= int(hold_vote_at) and not held_vote and not read(kill_file):
            held_vote = True  # once, and only in the survivors (no kill armed here)
            write_text(os.path.join(args.workdir, f"reduced.g{args.group}.r{args.rank}"), str(manager.current_step()))
            deadline = time.monotonic() + 20
            while not manager._redo.lost and time.monotonic() < deadline:
                time.sleep(0.005)
            seen["lost_before_vote"] = bool(manager._redo.lost)
        if args.read_reduced:
            if not args.loss_first:
                seen["loss"], seen["reduced_loss"] = reduced_loss(manager, loss)
            seen["norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_norm))
        step = manager.current_step()
        if args.batchnorm:
            seen["own_buffers"] = buffer_sums(norm[0])  # before the vote's sync takes the first participant's
        optimizer.step()
        if args.batchnorm:
            seen["buffers"] = buffer_sums(norm[0])
        if args.read_reduced:
            seen["used_norm"] = float(torch.linalg.vector_norm(torch.cat([q.grad.reshape(-1) for q in
                                                                          model.parameters()])))
        rec = sampler.last_batch if sampler is not None else None
        log.write(json.dumps({"step": step, "after": manager.current_step(), "committed": optimizer.committed,
                              "time": time.time(), "held": list(rec.held) if rec else None,
                              "consumed": list(rec.consumed) if rec else None,
                              "digest": state_digest(model, inner), "participants": manager.num_participants(),
                              "participating": manager.is_participating(),
                              **seen}) + "\n")
        if armed("vote", step):  # the step voted on, not the next one
            survivors_reduced()
            die("vote", step)
        time.sleep(0.01)
    with open(prefix + ".final.json", "w") as f:
        json.dump({"step": manager.current_step(), "digest": state_digest(model, inner)}, f)
    manager.shutdown()
    pg.shutdown()
    if args.ranks > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
