"""Training data across replica groups: the static shard, and exactly-once data under faults.

Without a Manager, `DistributedSampler` is torch's sampler over the (replica group, group rank)
grid of all processes: while a group is down its shard is not trained on (lossy, like torchft).

With `manager=`, it is exactly-once (docs/data.md). Every group holds the same committed data
position: the epoch, its seeded order, and which positions of that order are not consumed yet.
A step's samples are assigned from that position alone: the first `T` unconsumed positions
(T = participants x group batch, or `global_batch_size`) split in replica-rank order among the
step's participants, then among each group's ranks. Batches are drawn before the quorum (the
DataLoader prefetches), so each one is a prediction; after the quorum, `loss_weight()` checks it
against the assignment, and one small SUM allreduce tells every group which participants held
their assigned batch. Only those batches are consumed when the step commits; the others (a group
that died, healed, was a spare or predicted a different quorum) go back and are served first.
A group whose prediction was wrong multiplies its loss by 0, so no sample is trained twice.
The ranks of a group decide alike (each rank's vote reaches only the same rank of the other groups):
a group holds its assignment only when all its ranks do, judged from the group's shared prediction,
and a prediction depends only on committed state (outcomes and heals count once their step commits).
The position is registered with the Manager: it is healed with the model and checkpointed with
`state_dict()`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.data

from ft_core.errors import ConfigError, FTError

logger = logging.getLogger(__name__)

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint [start, end) ranges of positions in the epoch's order


def global_shard(replica_group_id: int, num_replica_groups: int, group_rank: int,
                 num_replicas: int) -> tuple[int, int]:
    """(shard index, shard count) for a process: groups are contiguous blocks of `num_replicas` shards."""
    if num_replica_groups < 1 or num_replicas < 1:
        raise ConfigError(f"num_replica_groups ({num_replica_groups}) and num_replicas ({num_replicas}) must be >= 1")
    if not 0 <= replica_group_id < num_replica_groups:
        raise ConfigError(f"replica_group_id {replica_group_id} (torchft's replica_rank) must be in "
                          f"[0, {num_replica_groups}); check REPLICA_GROUP_ID / NUM_REPLICA_GROUPS")
    if not 0 <= group_rank < num_replicas:
        raise ConfigError(f"group_rank {group_rank} must be in [0, {num_replicas})")
    return group_rank + num_replicas * replica_group_id, num_replicas * num_replica_groups


# ---- the exactly-once rule, as pure functions ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DataPosition:
    """The committed data position at the start of Manager step `step`: `epoch` and the positions of
    its order not consumed yet (`size` positions in all)."""

    epoch: int
    step: int
    size: int
    unconsumed: Ranges

    @classmethod
    def start(cls, epoch: int, step: int, size: int) -> DataPosition:
        return cls(epoch, step, size, ((0, size),) if size else ())

    def remaining(self) -> int:
        return sum(end - start for start, end in self.unconsumed)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "step": self.step, "size": self.size,
                "unconsumed": [x for r in self.unconsumed for x in r]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataPosition:
        flat = [int(x) for x in d["unconsumed"]]
        return cls(int(d["epoch"]), int(d["step"]), int(d["size"]),
                   tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2)))


@dataclasses.dataclass(frozen=True)
class StepShape:
    """How many samples a step takes: `batch_size` per process and `group_world_size` ranks per group,
    or a constant `global_batch_size` split among the participants."""

    batch_size: int
    group_world_size: int = 1
    global_batch_size: int | None = None

    def total(self, num_participants: int) -> int:
        if self.global_batch_size is not None:
            return self.global_batch_size
        return num_participants * self.group_world_size * self.batch_size


def _split(count: int, parts: int) -> list[int]:
    """`count` split in `parts` sizes differing by at most one, the larger first."""
    q, extra = divmod(count, parts)
    return [q + (1 if i < extra else 0) for i in range(parts)]


def _first(ranges: Ranges, count: int) -> list[int]:
    out: list[int] = []
    for start, end in ranges:
        take = min(end - start, count - len(out))
        out.extend(range(start, start + take))
        if len(out) == count:
            break
    return out


def _remove(ranges: Ranges, positions: Sequence[int]) -> Ranges:
    """`ranges` without `positions` (each a member of `ranges`)."""
    drop = sorted(positions)
    out: list[tuple[int, int]] = []
    i = 0
    for start, end in ranges:
        cur = start
        while i < len(drop) and drop[i] < end:
            p = drop[i]
            if p >= cur:
                if p > cur:
                    out.append((cur, p))
                cur = p + 1
            i += 1
        if cur < end:
            out.append((cur, end))
    merged: list[tuple[int, int]] = []
    for r in out:
        if merged and merged[-1][1] == r[0]:
            merged[-1] = (merged[-1][0], r[1])
        else:
            merged.append(r)
    return tuple(merged)


def step_pieces(pos: DataPosition, num_participants: int, shape: StepShape) -> list[list[tuple[int, ...]]]:
    """The step's assignment: `[participating rank][group rank]` -> positions of the epoch's order.
    A step never crosses an epoch: the epoch's last step takes what is left."""
    if num_participants < 1:
        return []
    take = _first(pos.unconsumed, min(shape.total(num_participants), pos.remaining()))
    pieces: list[list[tuple[int, ...]]] = []
    at = 0
    for group_size in _split(len(take), num_participants):
        ranks = []
        for rank_size in _split(group_size, shape.group_world_size):
            ranks.append(tuple(take[at:at + rank_size]))
            at += rank_size
        pieces.append(ranks)
    return pieces


def advance(pos: DataPosition, num_participants: int, held: Sequence[bool], shape: StepShape) -> DataPosition:
    """The position after a committed step: the pieces of participants that held theirs are consumed
    (`held[r]`); an epoch fully consumed gives way to the next."""
    pieces = step_pieces(pos, num_participants, shape)
    used = [p for r, ranks in enumerate(pieces) if r < len(held) and held[r] for piece in ranks for p in piece]
    left = _remove(pos.unconsumed, used)
    if not left:
        return DataPosition.start(pos.epoch + 1, pos.step + 1, pos.size)
    return DataPosition(pos.epoch, pos.step + 1, pos.size, left)


def epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    """The dataset indices of an epoch in training order (the same on every group)."""
    if not shuffle:
        return list(range(size))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(size, generator=g).tolist()


# ---- the sampler --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BatchRecord:
    """What one process trained on at one step attempt of epoch `epoch` (the committed position's):
    `valid` when it held its assigned batch (its loss counted; `indices` are then its samples, else
    empty: a prediction that missed, a non-participant, or the epoch's tail had nothing for it)."""

    step: int
    epoch: int
    indices: tuple[int, ...]
    participating_rank: int | None
    num_participants: int
    valid: bool
    held: tuple[bool, ...]  # per participating rank: held its assigned batch (what the step consumes if it commits)
    consumed: tuple[int, ...]  # the dataset indices the whole step consumes if it commits (this group rank's column)


@dataclasses.dataclass
class _Drawn:
    epoch: int
    group: tuple[tuple[int, ...], ...]  # the predicted pieces of every rank of this group (the same on each rank)
    positions: tuple[int, ...]  # this rank's: group[group_rank]
    indices: tuple[int, ...]
    num_participants: int  # the step it was drawn for, predicted: all of them hold theirs (unless stale)
    stale: bool = False  # drawn before a step that went otherwise than predicted: predicted to consume nothing
    void: bool = False  # drawn before a healed position was adopted: it cannot be the assignment


@dataclasses.dataclass
class _Outcome:
    step: int
    num_participants: int
    held: tuple[bool, ...]
    predicted: int | None  # the participants the batches drawn after it assumed all hold (None: it consumes nothing)
    resolved: bool = False  # those batches have learnt whether it went as they assumed


def group_holds(drawn_epoch: int, drawn_group: Sequence[Sequence[int]], pos: DataPosition,
                pieces: list[list[tuple[int, ...]]], rank: int | None) -> bool:
    """Whether a replica group holds its assignment: every one of its ranks drew its own piece. A rank
    decides it from the group's predicted pieces (identical on its ranks), never from its own piece alone,
    so the ranks of a group vote alike and consume alike (in an epoch's tail one rank's piece can match
    by chance, e.g. be empty both ways, while another's does not)."""
    if rank is None or rank >= len(pieces) or drawn_epoch != pos.epoch:
        return False
    return tuple(tuple(p) for p in drawn_group) == tuple(pieces[rank])


class DistributedSampler(torch.utils.data.distributed.DistributedSampler):
    """torch's DistributedSampler over the (replica group, group rank) grid of all processes; with
    `manager=` the exactly-once batch sampler of the module docstring.

    `replica_rank` is torchft's name for the replica group's index (`replica_group_id` here; in ft-lightning
    `replica_rank` is a group's position in the quorum); both spellings are accepted.

    Exactly-once use (each yielded item is a batch: pass it as `DataLoader(batch_sampler=...)`):

        sampler = DistributedSampler(ds, replica_rank=g, num_replica_groups=G, manager=manager, batch_size=32)
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=2)
        while sampler.epoch < epochs:
            for batch in loader:
                manager.start_quorum()
                loss = model(batch).mean() * sampler.loss_weight()   # once per step, before backward
                loss.backward()
                ...should_commit / optimizer.step
    """

    def __init__(self, dataset: Sized, replica_rank: int | None = None, num_replica_groups: int | None = None,
                 group_rank: int = 0, num_replicas: int = 1, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, *, replica_group_id: int | None = None, manager: Any = None,
                 batch_size: int | None = None, global_batch_size: int | None = None,
                 state_key: str = "data") -> None:
        if (replica_rank is None) == (replica_group_id is None) or num_replica_groups is None:
            raise ConfigError("DistributedSampler needs num_replica_groups and the replica group's index: "
                              "replica_group_id= (or torchft's replica_rank=), not both")
        group = replica_group_id if replica_group_id is not None else replica_rank
        assert group is not None
        rank, world = global_shard(group, num_replica_groups, group_rank, num_replicas)
        self.replica_group_id = group
        self.num_replica_groups = num_replica_groups
        self.group_rank = group_rank
        self.group_world_size = num_replicas
        super().__init__(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self._manager = manager
        if manager is None:
            if global_batch_size is not None:
                raise ConfigError("global_batch_size needs the exactly-once sampler: pass manager= as well")
            return
        if drop_last:
            raise ConfigError("drop_last=True drops samples; the exactly-once sampler (manager=) trains every "
                              "sample once per epoch, so leave drop_last=False")
        if batch_size is None and global_batch_size is None:
            raise ConfigError("the exactly-once sampler (manager=) yields batches: pass batch_size= (per process) "
                              "or global_batch_size=, and give it to DataLoader(batch_sampler=...)")
        if global_batch_size is not None and global_batch_size < num_replicas:
            raise ConfigError(f"global_batch_size={global_batch_size} is smaller than the {num_replicas} ranks "
                              f"of a replica group; use at least one sample per rank")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.shape = StepShape(batch_size or 1, num_replicas, global_batch_size)
        self._size = len(dataset)  # type: ignore[arg-type]
        if self._size == 0:
            raise ConfigError("the exactly-once sampler needs a non-empty dataset")
        self._lock = threading.Lock()
        self._pos = DataPosition.start(0, int(manager.current_step()), self._size)
        self._outcome: _Outcome | None = None  # this attempt's consumption, applied once the step commits
        self._healed: DataPosition | None = None  # a healed position, adopted once its step commits
        self._healed_keep = False  # loaded before this step's check (synchronous quorum): the check uses it
        self._async = bool(getattr(getattr(manager, "config", None), "use_async_quorum", True))
        self._drawn: collections.deque[_Drawn] = collections.deque()  # drawn, not yet checked (in order)
        self._predict = (0, 1)  # (participating rank, participants) expected next
        self._target_epoch = 0
        self._orders: dict[int, list[int]] = {}
        self.last_batch: BatchRecord | None = None
        manager.register_state_dict_fn(state_key, self._load_healed, self.state_dict)

    # ---- torch sampler protocol ----

    @property
    def exactly_once(self) -> bool:
        return self._manager is not None

    @property
    def epoch_of_next_batch(self) -> int:
        """The epoch the next batch belongs to (committed position; `epoch` says the same)."""
        with self._lock:
            self._settle()
            return self._pos.epoch

    def set_epoch(self, epoch: int) -> None:
        if self._manager is None:
            super().set_epoch(epoch)
            return
        with self._lock:
            self._settle()
            if epoch > self._pos.epoch and self._pos.remaining() == self._size and self._outcome is None \
                    and not self._drawn:  # nothing of the current epoch trained yet: start there
                self._pos = DataPosition.start(epoch, self._pos.step, self._size)
            # Otherwise an earlier epoch's unconsumed samples are served first (none is lost).
            self._target_epoch = max(epoch, self._pos.epoch)

    @property  # type: ignore[override]
    def epoch(self) -> int:
        """torch's epoch; in exactly-once mode the epoch of the next batch (the committed position's)."""
        if self.__dict__.get("_manager") is not None:
            return self.epoch_of_next_batch
        return self.__dict__.get("_epoch", 0)

    @epoch.setter
    def epoch(self, value: int) -> None:
        if self.__dict__.get("_manager") is not None:
            self.set_epoch(int(value))
        else:
            self.__dict__["_epoch"] = int(value)

    def __len__(self) -> int:
        if self._manager is None:
            return super().__len__()
        with self._lock:
            self._settle()
            left = self._pos.remaining() if self._pos.epoch >= self._target_epoch else self._size
        per_step = self.shape.total(1)  # at least one participant's share: an upper bound on the steps left
        return -(-left // per_step) + 1

    def __iter__(self) -> Iterator[Any]:
        if self._manager is None:
            return super().__iter__()
        return self._batches()

    def _batches(self) -> Iterator[list[int]]:
        with self._lock:
            self._resolve()
            if self._outcome is not None and self._manager.current_step() == self._outcome.step:
                self._outcome = None  # its step did not commit before this pass began: it consumed nothing
            self._drawn.clear()  # batches a previous pass drew and never trained are abandoned, not owed
            self._target_epoch = max(self._target_epoch, self._pos.epoch)
        while True:
            with self._lock:
                self._resolve()
                guess = self._predicted_position()
                if guess.epoch > self._target_epoch:
                    return
                rank, n = self._predict
                pieces = step_pieces(guess, n, self.shape)
                group = tuple(pieces[min(rank, len(pieces) - 1)]) if pieces else ()
                piece = group[self.group_rank] if group else ()
                order = self._order(guess.epoch)
                indices = tuple(order[p] for p in piece)
                self._drawn.append(_Drawn(guess.epoch, group, piece, indices, n))
            yield list(indices) if indices else [order[0]]  # an empty share still runs the step (weight 0)

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = self._orders[epoch] = epoch_order(self._size, epoch, self.seed, self.shuffle)
            while len(self._orders) > 2:  # the epoch being checked and the one being drawn
                del self._orders[min(self._orders)]
        return order

    def _predicted_position(self) -> DataPosition:
        """Where the next drawn batch's step will start if every step in flight commits as predicted: a
        function of the committed position and of the batches in flight alone, which every rank of the
        group has alike (a step's outcome counts once the group's commit vote applied it: `_settle`)."""
        guess = self._pos
        _, n = self._predict
        for drawn in self._drawn:
            if not drawn.stale:
                guess = advance(guess, n, [True] * n, self.shape)
        return guess

    # ---- the step ----

    def loss_weight(self) -> float:
        """Check this step's batch against the assignment (after the quorum) and tell the other groups;
        1.0 if it is this process's assigned batch, else 0.0: multiply the loss by it before backward.
        Every group in the quorum calls it exactly once per step, after drawing the step's batch."""
        manager = self._manager
        if manager is None:
            return 1.0
        with self._lock:
            self._resolve()
            self._outcome = None  # a previous attempt that did not commit consumed nothing
            if self._healed is not None and not self._healed_keep:
                self._healed = None  # nor did its heal: the Manager fetches it again
            self._healed_keep = False
            if not self._drawn:
                raise FTError("exactly-once sampler: loss_weight() called but no batch was drawn for this step; "
                              "call it once per step, after taking the step's batch from the DataLoader")
            drawn = self._drawn.popleft()
            pos = self._healed if self._healed is not None else self._pos
        n = int(manager.num_participants())
        rank = manager.participating_rank()
        pieces = step_pieces(pos, n, self.shape)
        held = not drawn.void and group_holds(drawn.epoch, drawn.group, pos, pieces, rank)
        votes = torch.zeros(max(n, 1), dtype=torch.int64)

        def own_vote() -> bool:  # the input, again: a redo (ft_core.redo) can reduce it again after a failure
            votes.zero_()
            if held and rank is not None:
                votes[rank] = 1
            return True

        own_vote()
        revote: list[Callable[[], None]] = []  # set once the outcome exists; a redo at the wait needs none
        on_redo = getattr(manager, "on_redo", None)  # a step redone without a lost peer re-sums the votes
        if on_redo is not None:  # said before issuing: a failure right after it must find the restore
            on_redo(votes, lambda: revote[0]() if revote else None, own_vote, next_reduction=True)
        manager.allreduce(votes, dist.ReduceOp.SUM).wait()
        outcome = _Outcome(pos.step, n, tuple(int(v) > 0 for v in votes.tolist()[:n]),
                           None if drawn.stale else drawn.num_participants)
        with self._lock:
            self._outcome = outcome
            if rank is not None:
                self._predict = (rank, n)
            else:  # healing or spare: next step it most likely takes part after the current ones
                self._predict = (n, n + 1)
        real = held and bool(drawn.positions)
        order = self._order(pos.epoch)
        consumed = tuple(order[p] for r, ranks in enumerate(pieces) if outcome.held[r]
                         for p in ranks[self.group_rank])
        self.last_batch = BatchRecord(pos.step, pos.epoch, drawn.indices if real else (), rank, n, real,
                                      outcome.held, consumed)
        revote.append(lambda: self._revote(votes, outcome, pieces, order))
        return 1.0 if real else 0.0

    def _revote(self, votes: torch.Tensor, outcome: _Outcome, pieces: list, order: list[int]) -> None:
        """The step was redone without a lost peer (ft_core.redo): its batch is not consumed, ours still are."""
        held = tuple(int(v) > 0 for v in votes.tolist()[:outcome.num_participants])
        with self._lock:
            if self._outcome is outcome:
                outcome.held = held
        consumed = tuple(order[p] for r, ranks in enumerate(pieces) if held[r] for p in ranks[self.group_rank])
        if self.last_batch is not None:
            self.last_batch = dataclasses.replace(self.last_batch, held=held, consumed=consumed)

    def _settle(self) -> None:
        """Apply this attempt's consumption (to its healed position, if it healed) once the Manager has
        committed its step: after the group's commit vote, so on every rank of the group alike (lock held).
        A heal whose step could not commit (too few participants) while every rank of the group loaded it
        is adopted by the Manager without the step on top (`step_rules.on_vote`, group_healed): the sampler
        then adopts the healed position alike, and that attempt consumed nothing."""
        healed = self._healed
        if healed is not None and self._manager.current_step() == healed.step:
            self._pos, self._healed = healed, None
            for drawn in self._drawn:  # predicted from the position before the heal
                drawn.void = True
            self._target_epoch = max(self._target_epoch, healed.epoch)
        out = self._outcome
        base = self._healed if self._healed is not None else self._pos
        if out is None or base.step != out.step or self._manager.current_step() != out.step + 1:
            return
        self._learn(out, committed=True)
        if self._healed is not None:
            for drawn in self._drawn:  # predicted from the position before the heal
                drawn.void = True
            self._healed = None
            self._target_epoch = max(self._target_epoch, base.epoch)
        self._pos = advance(base, out.num_participants, out.held, self.shape)
        self._outcome = None

    def _resolve(self) -> None:
        """Before a draw or a step's check (lock held): the last checked step is over, committed (applied)
        or not (it consumed nothing); the batches drawn after it learn which."""
        self._settle()
        if self._outcome is not None:
            self._learn(self._outcome, committed=False)

    def _learn(self, out: _Outcome, committed: bool) -> None:
        """Mark the batches in flight stale if step `out` went otherwise than they assumed: they are then
        predicted to consume nothing, so the next draws land where the steps after them will start.
        Groups with the same loader have as many batches in flight and see the same outcome, so their
        predictions meet again. Decided from the committed outcome only (a step that did not commit
        consumed nothing, whatever its votes said on this rank), so every rank of a group marks alike."""
        if out.resolved:
            return
        out.resolved = True
        if not committed:
            as_predicted = out.predicted is None
        elif out.predicted is None:
            as_predicted = not any(out.held)
        else:
            as_predicted = all(out.held) and out.num_participants == out.predicted
        if not as_predicted:
            for later in self._drawn:
                later.stale = True

    # ---- state ----

    def state_dict(self) -> dict[str, Any]:
        """The committed position (healed to peers, and for durable checkpoints)."""
        if self._manager is None:
            return {"epoch": self.epoch, "seed": self.seed}
        with self._lock:
            self._settle()
            return {"position": self._pos.to_dict(), "seed": self.seed, "shuffle": self.shuffle}

    def training_position(self) -> dict[str, Any] | None:
        """The data position this step's assignment is drawn from, as `state_dict()["position"]`: the
        committed one, or, with the synchronous quorum, the healed one while its heal (loaded at the
        quorum) waits for the step's commit. For checks that follow the position step by step (a ledger);
        None without a manager."""
        if self._manager is None:
            return None
        with self._lock:
            self._settle()
            pos = self._healed if self._healed is not None and self._healed_keep else self._pos
            return pos.to_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()` (a durable checkpoint)."""
        if self._manager is None:
            self.set_epoch(int(state["epoch"]))
            return
        with self._lock:
            self._check(state)
            self._pos = DataPosition.from_dict(state["position"])
            self._outcome = self._healed = None
            for drawn in self._drawn:
                drawn.void = True
            self._target_epoch = max(self._target_epoch, self._pos.epoch)
        logger.info("exactly-once sampler: resumed at epoch %d, step %d, %d samples left in the epoch",
                    self._pos.epoch, self._pos.step, self._pos.remaining())

    def _load_healed(self, state: dict[str, Any]) -> None:
        """The source's position at the start of this step, adopted (with this step's outcome applied to
        it) only if the step commits, as the Manager adopts the healed step: a heal that one rank of the
        group loaded and another failed to fetch leaves both ranks where they were."""
        with self._lock:
            self._check(state)
            self._settle()  # the previous step's outcome, if it committed
            self._healed = DataPosition.from_dict(state["position"])
            if self._async and self._outcome is not None:  # loaded at commit, after this step's check
                self._outcome.step = self._healed.step
            self._healed_keep = not self._async  # loaded at the quorum, before this step's check

    def _check(self, state: dict[str, Any]) -> None:
        size = int(state["position"]["size"])
        if size != self._size or int(state["seed"]) != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise ConfigError(f"exactly-once sampler state is for a dataset of {size} samples, seed {state['seed']}, "
                              f"shuffle {state['shuffle']}; this one has {self._size}, {self.seed}, {self.shuffle}: "
                              f"every group must use the same dataset, seed and shuffle")

    @property
    def replica_rank(self) -> int:
        """torchft's name of `replica_group_id`."""
        return self.replica_group_id
