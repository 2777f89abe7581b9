"""Fault-tolerant training with Hugging Face Accelerate: a small classifier on CPU.

One replica group = one `accelerate launch`. Start a lighthouse, then each group:

    ftl lighthouse --bind 127.0.0.1:29510 &
    ftl accelerate launch --lighthouse 127.0.0.1:29510 --num-replica-groups 2 --replica-group-id 0 \\
        examples/accelerate_train.py --steps 200 &
    ftl accelerate launch --lighthouse 127.0.0.1:29510 --num-replica-groups 2 --replica-group-id 1 \\
        examples/accelerate_train.py --steps 200

Kill either group (Ctrl-C, `kill -9`) and start it again: the other keeps training, and the
restarted one heals from it and ends with identical weights. The only changes from a plain
Accelerate script are the `FaultTolerantAccelerator` and looping until `accelerator.ft_step`
(committed steps, the same on every group) reaches the goal, since a group that heals jumps ahead.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch
import torch.nn.functional as F
from accelerate.utils import set_seed

from ft_lightning.accelerate import FaultTolerantAccelerator


def make_dataset(n: int = 1024, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Points in the plane, labelled by the quadrant pattern (XOR): not linearly separable."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=gen)
    y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()
    return torch.utils.data.TensorDataset(x, y)


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


class Progress:
    """Samples the job has trained on. Registered for checkpointing, so a healed group inherits it
    (any object with plain-data state_dict()/load_state_dict() can be)."""

    def __init__(self) -> None:
        self.samples = 0

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.samples = int(state["samples"])


class HealLog(logging.Handler):
    """Prints this process's quorum changes and heals (the Manager's structured events)."""

    def __init__(self, accelerator: FaultTolerantAccelerator) -> None:
        super().__init__(logging.INFO)
        self.accelerator = accelerator
        self.heals = 0

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        manager = self.accelerator.ft_manager
        if not event or manager is None or event.get("replica_id") != manager.replica_id \
                or event.get("group_rank") != manager.group_rank:
            return
        if event["type"] == "heal":
            self.heals += 1
            self.accelerator.print(f"healed at step {event['step']} from replica rank "
                                   f"{event['source_replica_rank']} ({event['nbytes']} bytes, "
                                   f"{event['seconds']:.3f}s)", flush=True)
        elif event["type"] == "quorum" and event.get("changed"):
            self.accelerator.print(f"quorum {event['quorum_id']}: {event['num_participants']} participating "
                                   f"group(s), max_step {event['max_step']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200, help="committed optimizer steps to train for")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (to watch it)")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out-dir", default=None,
                        help="write group<G>_rank<R>.pt (final state) and .json (counters) here")
    args = parser.parse_args()
    torch.set_num_threads(1)

    accelerator = FaultTolerantAccelerator(gradient_accumulation_steps=args.grad_accum)
    heal_log = HealLog(accelerator)
    events = logging.getLogger("ft_core.events")
    events.setLevel(logging.INFO)
    events.propagate = False
    events.addHandler(heal_log)

    set_seed(args.seed)  # every group starts from the same weights (and the first quorum syncs them anyway)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps * accelerator.num_processes)
    loader = torch.utils.data.DataLoader(make_dataset(seed=args.seed), batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    samples_per_group_step = args.batch_size * args.grad_accum * accelerator.num_processes

    group = accelerator.ft.replica_group_id
    windows = micro_batches = 0
    epoch = 0
    while accelerator.ft_step < args.steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro_batches += 1
            if not accelerator.sync_gradients:
                continue
            windows += 1
            step = accelerator.ft_step
            if accelerator.optimizer_step_was_skipped:
                accelerator.print(f"group {group}: step not committed (still at step {step})", flush=True)
            else:
                progress.samples += samples_per_group_step * accelerator.ft_manager.num_participants()
                if step % args.log_every == 0 or step == args.steps:
                    accelerator.print(f"group {group}: step {step} loss {loss.item():.4f} "
                                      f"lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if step >= args.steps:
                break
        epoch += 1

    with torch.no_grad():
        data = make_dataset(seed=args.seed).tensors
        accuracy = (accelerator.unwrap_model(model)(data[0]).argmax(-1) == data[1]).float().mean().item()
    accelerator.print(f"group {group}: done at step {accelerator.ft_step}, accuracy {accuracy:.3f}, "
                      f"{accelerator.ft_stats}", flush=True)
    if args.out_dir:
        name = os.path.join(args.out_dir, f"group{group}_rank{accelerator.process_index}")
        torch.save({"model": accelerator.unwrap_model(model).state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict()}, name + ".pt")
        with open(name + ".json", "w") as f:
            json.dump({**accelerator.ft_stats, "windows": windows, "micro_batches": micro_batches,
                       "heals": heal_log.heals, "accuracy": accuracy, "samples": progress.samples,
                       "settings": {k: v for k, v in accelerator.ft.settings().items() if k != "token"},
                       "sources": accelerator.ft.sources}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
