"""The demo's training script, one process per replica group: a character-level GRU language model
learning Python's own language reference (`pydoc_data.topics`, shipped with Python; no download),
trained by Lightning through the fault-tolerant strategy.

Run it under `ftl launch` (which sets FT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS):
    ftl launch --groups 3 --kill-every 10 -- -m ft_lightning.demo.train --max-steps 300 --events runs/ev

It writes one JSON line per event to EVENTS/<group>.jsonl (format in ft_lightning/demo/report.py)
and ends with a digest of its final weights, so a driver can check every group ended identical.
Training stops once the committed step reaches --max-steps, or the step written to --stop-file
(by `ftl demo`, when its time is up); every group stops at that same committed step.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import logging
import os
import sys
import threading
import time
import typing
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

import lightning.pytorch as pl

from ft_lightning import FaultTolerantDDPStrategy
from ft_lightning._events import attach_console

VOCAB = "\n" + "".join(chr(c) for c in range(32, 127))  # 96 symbols; anything else reads as "?"
UNKNOWN = VOCAB.index("?")


def load_corpus(max_chars: int = 400_000) -> str:
    """A few hundred KB of English that ships with every Python: the help topics of the language reference."""
    try:
        from pydoc_data.topics import topics

        text = "\n".join(topics[key] for key in sorted(topics))
    except ImportError:  # some distributions strip pydoc_data: fall back to stdlib source code
        text = "\n".join(inspect.getsource(m) for m in (argparse, inspect, typing))
    return text[:max_chars]


def encode(text: str) -> torch.Tensor:
    lookup = {ch: i for i, ch in enumerate(VOCAB)}
    return torch.tensor([lookup.get(ch, UNKNOWN) for ch in text], dtype=torch.long)


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


class CharWindows(IterableDataset):
    """Endless random windows of the corpus: (input, next-character target), seeded per group."""

    def __init__(self, ids: torch.Tensor, seq_len: int, seed: int) -> None:
        self.ids, self.seq_len, self.seed = ids, seq_len, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            start = int(torch.randint(0, len(self.ids) - self.seq_len - 1, (1,), generator=gen))
            window = self.ids[start:start + self.seq_len + 1]
            yield window[:-1], window[1:]


class CharGRU(pl.LightningModule):
    """Embedding -> GRU -> next-character logits (about 85k parameters: one CPU thread trains it fast)."""

    def __init__(self, lr: float = 3e-3, embed: int = 48, hidden: int = 128) -> None:
        super().__init__()
        self.lr = lr
        self.embed = nn.Embedding(len(VOCAB), embed)
        self.rnn = nn.GRU(embed, hidden, batch_first=True)
        self.head = nn.Linear(hidden, len(VOCAB))
        self.last_loss: float | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).reshape(-1, len(VOCAB)), y.reshape(-1))
        self.last_loss = float(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    @torch.no_grad()
    def sample(self, prompt: str = "The ", length: int = 160, temperature: float = 0.7, seed: int = 0) -> str:
        gen = torch.Generator().manual_seed(seed)
        ids = encode(prompt).tolist()
        out, h = self.rnn(self.embed(torch.tensor([ids])))
        for _ in range(length):
            probs = torch.softmax(self.head(out[:, -1]) / temperature, dim=-1)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
            ids.append(nxt)
            out, h = self.rnn(self.embed(torch.tensor([[nxt]])), h)
        return decode(ids)


def weights_digest(module: nn.Module) -> str:
    """sha256 over every tensor of the state dict (names and bytes, sorted by name)."""
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


class EventLog:
    """Appends one JSON object per line and flushes it, so a reader sees whole records as they happen."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file = None
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
            if self._file.tell() > 0:
                self._file.write("\n")  # a killed predecessor may have left half a line

    def write(self, event: str, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": event, "t": time.time(), **fields}) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class FTEventRecorder(logging.Handler):
    """Turns the Manager's structured events (logger "ft_core.events") into demo records."""

    def __init__(self, log: EventLog, model: CharGRU) -> None:
        super().__init__(level=logging.DEBUG)  # commits and unchanged quorums are DEBUG events
        self.log, self.model = log, model
        self.quorum_id: int | None = None
        self.heal_to: int | None = None  # the step the last quorum told this group to heal to
        self.healed_this_step = False

    def emit(self, record: logging.LogRecord) -> None:
        ev = getattr(record, "ft_event", None)
        if not isinstance(ev, dict) or ev.get("group_rank", 0) != 0:
            return
        kind = ev.get("type")
        if kind == "quorum":
            self.quorum_id = ev.get("quorum_id")
            self.heal_to = ev.get("max_step") if ev.get("heal") else None
            self.log.write("quorum", step=ev.get("step"), quorum_id=self.quorum_id,
                           num_participants=ev.get("num_participants"), heal=bool(ev.get("heal")),
                           replica_rank=ev.get("replica_rank"), max_step=ev.get("max_step"))
        elif kind == "heal":
            self.healed_this_step = True
            step = self.heal_to if self.heal_to is not None else ev.get("step")  # adopted later, at commit
            self.log.write("heal", step=step, seconds=ev.get("seconds"), nbytes=ev.get("nbytes"),
                           source=ev.get("source_replica_rank"))
        elif kind == "commit":
            # A healing group computed its loss with the weights it then replaced: not worth plotting.
            loss = None if self.healed_this_step else self.model.last_loss
            self.log.write("commit", step=ev.get("step"), committed=bool(ev.get("committed")),
                           loss=loss, quorum_id=self.quorum_id,
                           num_participants=ev.get("num_participants"),
                           state="healed" if self.healed_this_step else "training")
            self.healed_this_step = False
        elif kind == "error":
            self.log.write("error", step=ev.get("step"), message=str(ev.get("message"))[:500])


class StopAtStep(pl.Callback):
    """Stops every group at the same committed step: --max-steps, or the number in --stop-file."""

    def __init__(self, max_steps: int | None, stop_file: str | None) -> None:
        self.max_steps, self.stop_file = max_steps, stop_file
        self.final_step: int | None = None

    def target(self) -> int | None:
        if self.stop_file and os.path.exists(self.stop_file):
            try:
                with open(self.stop_file, encoding="utf-8") as f:
                    return int(f.read().strip())
            except ValueError:  # being written; the driver renames it into place, so this is rare
                return self.max_steps
        return self.max_steps

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        target = self.target()
        step = trainer.strategy.manager.current_step()
        if target is not None and step >= target:
            self.final_step = step
            trainer.should_stop = True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ft_lightning.demo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--events", default=None, help="folder for <group>.jsonl event files")
    p.add_argument("--max-steps", type=int, default=None, help="stop at this committed step")
    p.add_argument("--stop-file", default=None, help="stop at the committed step written in this file")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds a collective, vote or checkpoint fetch may take (FT_TIMEOUT_SEC overrides); "
                        "a step of this model takes ~0.1 s, so 5 s bounds a hang without false alarms")
    args = p.parse_args(argv)
    if args.max_steps is None and args.stop_file is None:
        p.error("give --max-steps N or --stop-file PATH, or training never ends")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    incarnation = int(os.environ.get("FT_RESTART_COUNT", "0"))
    rank = int(os.environ.get("RANK", "0"))
    log = EventLog(os.path.join(args.events, f"{group}.jsonl") if args.events and rank == 0 else None)
    log.write("start", group=group, incarnation=incarnation, pid=os.getpid())

    torch.manual_seed(args.seed)  # same initial weights everywhere (healing at step 0 makes sure anyway)
    model = CharGRU(lr=args.lr)
    data = CharWindows(encode(load_corpus()), args.seq_len, seed=args.seed * 1_000_003 + group * 7919 + incarnation)
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=0)
    recorder = FTEventRecorder(log, model)
    attach_console()  # membership changes, heals and failed steps as one line each in the group's log
    events_logger = logging.getLogger("ft_core.events")
    events_logger.setLevel(logging.DEBUG)  # every quorum and commit (routine ones are DEBUG events)
    events_logger.addHandler(recorder)
    stopper = StopAtStep(args.max_steps, args.stop_file)
    trainer = pl.Trainer(
        strategy=FaultTolerantDDPStrategy(timeout=timedelta(seconds=args.timeout)), accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), max_epochs=-1, max_steps=-1,
        callbacks=[stopper], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0)
    try:
        trainer.fit(model, train_dataloaders=loader)
    finally:
        events_logger.removeHandler(recorder)
    digest = weights_digest(model)
    text = model.sample()
    log.write("end", step=stopper.final_step, weights_sha256=digest, loss=model.last_loss, sample=text)
    log.close()
    print(f"group {group}: stopped at step {stopper.final_step}, weights sha256 {digest[:16]}", flush=True)
    print(f"group {group} writes: {text!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
