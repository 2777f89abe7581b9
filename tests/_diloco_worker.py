"""One replica group of Streaming DiLoCo (or, with --local-sgd, LocalSGD) as a process, for
tests/test_diloco_processes.py.

Trains a small MLP (two fragments) on per-group synthetic data; after each fragment sync appends
{"step", "committed"} to --log. A test arms a SIGKILL by writing a point into --kill-file:
"inner" (after an inner step), "sync" (pseudo-gradient allreduce in flight, before the vote),
"reduction" (instead of issuing this group's first pseudo-gradient reduction of a sync all three
groups take part in, while the peers' are in flight) or "heal" (this group's quorum says it heals:
killed before fetching). Every redo the Manager reports is printed as a line `redo {event}`.
Once --stop-file holds a step number, the group stops after the sync that reaches it and writes
--final: its step, global copies and outer optimizer state (exact values, to compare across groups).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from datetime import timedelta

import torch
from torch import nn

from _worker_faults import die_in_reduction

from ft_core.local_sgd import DiLoCo, LocalSGD
from ft_core.manager import Manager
from ft_core.process_groups import ProcessGroupGloo


def armed(path: str, point: str) -> bool:
    try:
        with open(path) as f:
            return f.read().strip() == point
    except FileNotFoundError:
        return False


def die_if_armed(path: str, point: str) -> None:
    if armed(path, point):
        print(f"SIGKILL during {point}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class KillOnHeal(logging.Handler):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if event and event.get("type") == "quorum" and event.get("heal"):
            die_if_armed(self.path, "heal")
        if event and event.get("type") == "redo":
            print("redo " + json.dumps(event, default=str), flush=True)


def stop_step(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (FileNotFoundError, ValueError):
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica-id", required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--final", required=True)
    p.add_argument("--kill-file", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--fragments", type=int, default=2)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--delay", type=int, default=1)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--step-sleep", type=float, default=0.03)
    p.add_argument("--local-sgd", action="store_true", help="LocalSGD (the parameters averaged) instead of DiLoCo")
    args = p.parse_args()
    torch.set_num_threads(1)
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.INFO)
    events.addHandler(KillOnHeal(args.kill_file))
    # the "reduction" point: instead of issuing a reduction of a sync all 3 groups take part in
    die_in_reduction(lambda m: m.num_participants() == 3 and armed(args.kill_file, "reduction"),
                     lambda m: "SIGKILL during reduction")

    torch.manual_seed(0)  # the same initial model in every group (a restarted one too)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    fragments = [model[0], model[2]] if args.fragments == 2 else [model]
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    timeout = timedelta(seconds=5)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(pg, lighthouse_addr=args.lighthouse, replica_id=args.replica_id, use_async_quorum=False,
                      timeout=timeout, quorum_timeout=timedelta(seconds=30), connect_timeout=timeout,
                      min_replica_size=2)
    manager.register_state_dict_fn("default", lambda s: (model.load_state_dict(s["model"]),
                                                         inner.load_state_dict(s["inner"])),
                                   lambda: {"model": model.state_dict(), "inner": inner.state_dict()})
    rng = torch.Generator().manual_seed(1000 + sum(map(ord, args.replica_id)))
    if args.local_sgd:
        algorithm: DiLoCo | LocalSGD = LocalSGD(manager, model, inner, sync_every=args.sync_every)
        inner_steps = [0]
        inner.register_step_post_hook(lambda *_: inner_steps.__setitem__(0, inner_steps[0] + 1))
        cycle_start = lambda: inner_steps[0] % args.sync_every == 0  # noqa: E731
    else:
        algorithm = diloco = DiLoCo(manager, fragments, inner, outers, sync_every=args.sync_every,
                                    fragment_sync_delay=args.delay, fragment_update_alpha=args.alpha)
        cycle_start = lambda: diloco.local_step == 0  # noqa: E731
        orig_prepare = [f.prepare_sync for f in diloco.fragments]
        for f, prepare in zip(diloco.fragments, orig_prepare):
            def prepared(prepare=prepare) -> None:
                prepare()
                die_if_armed(args.kill_file, "sync")
            f.prepare_sync = prepared
    with open(args.log, "a") as log, algorithm:
        while True:
            if cycle_start():
                target = stop_step(args.stop_file)
                if target is not None and manager.current_step() >= target:
                    break
            x = torch.randn(16, 4, generator=rng)
            y = x.sum(dim=1, keepdim=True).sin()
            inner.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            before = manager.current_step()
            inner.step()  # DiLoCo's hook prepares / syncs a fragment when it is due
            die_if_armed(args.kill_file, "inner")
            if cycle_start():
                log.write(json.dumps({"step": manager.current_step(), "committed": manager.current_step() > before})
                          + "\n")
                log.flush()
            time.sleep(args.step_sleep)
    state = manager.healing_state()["user"]
    final = {"step": manager.current_step(), "fragments": {},
             "model": {n: t.tolist() for n, t in model.state_dict().items()} if args.local_sgd else {}}
    for key, value in state.items():
        if key.startswith("StreamingDiLoCoFragment_"):
            final["fragments"][key] = {
                "original_parameters": {n: t.tolist() for n, t in value["original_parameters"].items()},
                "outer_optimizer": {str(i): {k: v.tolist() for k, v in s.items()}
                                    for i, s in value["outer_optimizer"]["state"].items()}}
    with open(args.final + ".tmp", "w") as f:
        json.dump(final, f)
    os.replace(args.final + ".tmp", args.final)
    manager.shutdown()
    pg.shutdown()


if __name__ == "__main__":
    main()
