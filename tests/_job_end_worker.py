"""One replica group training a tiny model with the core API until --steps, then `manager.finish()`.

Logs the engine's INFO lines to stderr (as a script that sets up logging would), prints one line per
committed step and `done at step N` at the end. `--fail-loads` makes every heal's load fail (a healer
that keeps its own state), `--end-file` ends the loop after the first step that finds that file. A
JobFinishedError is not caught: the process ends with its traceback and exit 1, as a user's script would.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from datetime import timedelta

import torch

from ft_core import Manager
from ft_core.process_groups import ProcessGroupGloo


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--start-step", type=int, default=0, help="resume with this much committed progress")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--fail-loads", action="store_true", help="every heal's load fails (prints 'injected load failure')")
    p.add_argument("--end-file", default="", help="end after the first step that finds this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("ft_core").setLevel(logging.INFO)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))

    def load(state: dict) -> None:
        if args.fail_loads:
            print("injected load failure", flush=True)
            raise RuntimeError("injected load failure")
        model.load_state_dict(state)

    manager = Manager(pg, load_state_dict=load, state_dict=model.state_dict,
                      min_replica_size=args.min_replicas, replica_id=f"replica_group_{args.group}",
                      timeout=timedelta(seconds=5), quorum_timeout=timedelta(seconds=args.quorum_timeout),
                      connect_timeout=timedelta(seconds=10))
    if args.start_step:
        manager.load_state_dict({"step": args.start_step, "batches_committed": args.start_step})
    x = torch.randn(8, 4)
    while manager.current_step() < args.steps:
        manager.start_quorum()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for param in model.parameters():
            manager.allreduce(param.grad).wait()
        if manager.should_commit():
            opt.step()
            print(f"committed step {manager.current_step()}", flush=True)
        time.sleep(args.step_sleep)
        if args.end_file and os.path.exists(args.end_file):
            break
    manager.finish()
    print(f"done at step {manager.current_step()}", flush=True)
    manager.shutdown()
    pg.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
