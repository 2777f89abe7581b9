"""The configuration of `ftl chaos`: the run's settings (`ChaosConfig`), and the matrix of the
dimensions the step protocol must hold in, as 8 cells (the rows of the orthogonal array L8(2^7),
so every pair of dimensions meets in all four combinations), and which cell a seed runs. See
docs/chaos.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAULT_KINDS = ("kill", "hang", "lighthouse", "kill_heal_source", "kill_heal_receiver")
HEAL_KINDS = ("kill_heal_source", "kill_heal_receiver")
# with --network (the groups and two lighthouses on simulated hosts, ft_core.tools.netns): a group's host
# cut off, two groups blocked from each other (both still reach the lighthouse), a lighthouse's host cut off
NETWORK_KINDS = ("host_cut", "partition", "lighthouse_cut")


HEAL_FAULT_SLOTS = 2  # a heal fault may need a kill first, to provoke its heal: two slots of the fault budget
PROVOKES_PER_WAIT = 3  # an armed heal fault kills at most this often per heal_wait to provoke its heal


def provoke_due(now: float, provoked_at: float | None, heal_wait: float) -> bool:
    """Whether an armed heal fault may kill a group again to provoke its heal: at once the first time, then
    only a third of its wait after the last such kill. In between, the heals that come anyway get their turn:
    with worker faults a skipped vote heals a group every few seconds, while a provoked heal often cannot be
    faulted (its source is the only group holding the latest step, gap 2), and kill after kill kept a group
    down, which made every heal such a one, and spent the run's fault budget (seed 20799, cell c7: four
    provoking kills for one kill_heal_source, and no slot left for the hang)."""
    return provoked_at is None or now - provoked_at >= heal_wait / PROVOKES_PER_WAIT


def draw_kind(bag: list[str], slots_left: int) -> str:
    """Move the next fault kind to draw to the front of the round's `bag` and return it. A heal fault may
    need a kill first, to provoke the heal it waits for, and that kill takes a slot of the run's fault
    budget: with a single slot left, the first other kind in the bag goes first (a heal fault armed in
    the last slot could not provoke its heal and would be skipped)."""
    if bag[0] in HEAL_KINDS and slots_left < HEAL_FAULT_SLOTS:
        other = next((kind for kind in bag if kind not in HEAL_KINDS), None)
        if other is not None:
            bag.remove(other)
            bag.insert(0, other)
    return bag[0]


@dataclass(frozen=True)
class Cell:
    """One configuration of the job: the dimensions that the step protocol must hold in."""

    index: int
    ranks: int = 1  # ranks per replica group (the Launcher's torchrun environment)
    sync: bool = False  # use_async_quorum=False
    init_sync: bool = False  # init_sync=True, every group starting from other weights
    batchnorm: bool = False  # a model with BatchNorm buffers (ft_core DDP synchronises them)
    optimizers: int = 1  # two: two Manager steps per batch
    extremes: bool = False  # MAX and MIN reductions beside the gradient average
    worker_faults: bool = False  # skipped steps, failed loads and failed fetches on the healer

    @property
    def name(self) -> str:
        parts = [f"{self.ranks}rank", "sync" if self.sync else "async"]
        parts += [flag for flag, on in (("init_sync", self.init_sync), ("batchnorm", self.batchnorm),
                                        ("2optim", self.optimizers == 2), ("maxmin", self.extremes),
                                        ("worker_faults", self.worker_faults)) if on]
        return f"c{self.index}:" + "+".join(parts)

    def worker_args(self) -> list[str]:
        args = ["--model", "batchnorm" if self.batchnorm else "mlp", "--optimizers", str(self.optimizers),
                "--cell", self.name]
        args += [flag for flag, on in (("--sync", self.sync), ("--init-sync", self.init_sync),
                                       ("--extremes", self.extremes)) if on]
        if self.worker_faults:
            args += ["--skip-prob", str(SKIP_PROB), "--load-fail-prob", str(LOAD_FAIL_PROB),
                     "--recv-fail-prob", str(RECV_FAIL_PROB)]
        return args


SKIP_PROB = 0.03  # per step: the loop skips the vote (a skipped optimizer.step()), half the time its backward too
LOAD_FAIL_PROB = 0.25  # per healed-state load, per rank (so 2-rank groups see partial heals)
RECV_FAIL_PROB = 0.25  # per checkpoint fetch, per rank


def _orthogonal_rows() -> list[tuple[int, ...]]:
    """The 8 rows of the two-level orthogonal array L8(2^7): every pair of dimensions meets in all four
    combinations (twice), so 8 cells cover every pairwise interaction of the 7 dimensions."""
    return [tuple(((row & col).bit_count() & 1) for col in (4, 2, 1, 6, 5, 3, 7)) for row in range(8)]


MATRIX: tuple[Cell, ...] = tuple(
    Cell(index=i, ranks=1 + a, sync=bool(b), init_sync=bool(c), batchnorm=bool(d), optimizers=1 + e,
         extremes=bool(f), worker_faults=bool(g))
    for i, (a, b, c, d, e, f, g) in enumerate(_orthogonal_rows()))


def parse_matrix(text: str) -> tuple[int, ...]:
    """`all` or comma-separated cell indices (`3,5`) -> the indices the seed chooses among."""
    if text.strip() in ("", "all"):
        return tuple(range(len(MATRIX)))
    try:
        chosen = tuple(sorted({int(part.strip().lstrip("c").split(":")[0]) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError(f"--matrix takes 'all', 'list' or cell indices like 3,5 (got {text!r})") from None
    bad = [i for i in chosen if not 0 <= i < len(MATRIX)]
    if bad or not chosen:
        raise ValueError(f"--matrix: no cell {bad or text!r}; the cells are 0..{len(MATRIX) - 1} (ftl chaos --matrix list)")
    return chosen


def cell_for(seed: int, cells: tuple[int, ...]) -> Cell:
    """The cell a seed runs: seeds cycle through the allowed cells (seed 0 the first, seed 1 the next...)."""
    return MATRIX[cells[seed % len(cells)]]


def matrix_table() -> str:
    lines = ["cell  ranks  quorum  init_sync  batchnorm  optimizers  max/min  worker faults"]
    for c in MATRIX:
        lines.append(f"c{c.index:<4} {c.ranks:<6} {'sync' if c.sync else 'async':<7} {'on' if c.init_sync else 'off':<10} "
                     f"{'on' if c.batchnorm else 'off':<10} {c.optimizers:<11} {'on' if c.extremes else 'off':<8} "
                     f"{'on' if c.worker_faults else 'off'}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ChaosConfig:
    """One chaos run; every time is in seconds unless its name says otherwise."""

    out: str
    groups: int = 3
    faults: int = 200
    seed: int = 0
    duration: float = 4 * 3600.0  # hard wall-clock bound of the whole run
    min_replicas: int = 2
    timeout: float = 5.0  # collectives and checkpoint transfers
    quorum_timeout: float = 15.0
    heartbeat_timeout_ms: int = 3000
    join_timeout_ms: int = 1000
    interval: float = 3.0  # mean pause between faults
    min_progress_steps: int = 3  # the job advances this many steps between faults
    transport_delay_ms: float = 150.0
    transport_drop: float = 0.05
    quiet_steps: int = 15
    restart_delay: float = 0.5
    step_sleep: float = 0.05
    heal_wait: float = 90.0  # an armed heal fault gives up after this long
    stall: float = 180.0  # no group committing a new highest step for this long ends the run as failed
    kinds: tuple[str, ...] = FAULT_KINDS
    cells: tuple[int, ...] = tuple(range(len(MATRIX)))  # the matrix cells the seed chooses among
    ledger: bool = False  # data from the exactly-once DistributedSampler, ledger checked per epoch
    network: bool = False  # groups and lighthouses (primary + standby) on simulated hosts; NETWORK_KINDS allowed
    ordered: bool = False  # draw the kinds in the order given (each round), not shuffled
    spares: bool = False  # killed groups restart from warm spares (ftl launch --spares)
    dataset_size: int = 240
    token: str | None = field(default=None, repr=False)

    @property
    def cell(self) -> Cell:
        return cell_for(self.seed, self.cells)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.kinds) - set(FAULT_KINDS) - set(NETWORK_KINDS))
        needs_network = sorted(set(self.kinds) & set(NETWORK_KINDS)) if not self.network else []
        problems = [(self.groups >= 3, f"--groups must be >= 3 (got {self.groups})"),
                    (1 <= self.min_replicas < self.groups,
                     f"--min-replicas must be in 1..groups-1 (got {self.min_replicas} with {self.groups} groups)"),
                    (self.faults >= 0, f"--faults must be >= 0 (got {self.faults})"),
                    (not unknown, (f"unknown fault kinds {unknown}; choose from "
                                   f"{', '.join(FAULT_KINDS + NETWORK_KINDS)}")),
                    (not needs_network, f"fault kinds {needs_network} need --network (simulated hosts)"),
                    (not (self.spares and self.network), "--spares does not combine with --network: a group on a "
                     "simulated host is started through `ip netns exec`, which a spare cannot become"),
                    (bool(self.kinds), "at least one fault kind is needed"),
                    (bool(self.cells) and all(0 <= c < len(MATRIX) for c in self.cells),
                     f"cells must be among 0..{len(MATRIX) - 1} (got {self.cells})")]
        for ok, message in problems:
            if not ok:
                raise ValueError(message)
