"""The demo's record: per-group JSONL events in, `report.json` and `report.png` out.

Each replica group writes one JSON object per line to `OUT/groups/<group>.jsonl` (see train.py):
  {"event": "start", "t", "group", "incarnation"}
  {"event": "quorum", "t", "step", "quorum_id", "num_participants", "heal"}
  {"event": "heal", "t", "step", "seconds", "nbytes"}
  {"event": "commit", "t", "step", "committed", "loss", "quorum_id", "num_participants", "state"}
  {"event": "error", "t", "message"}
  {"event": "end", "t", "step", "weights_sha256"}
`GroupSeries` folds them up; `build_report` turns the series and the injected kills into numbers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class GroupSeries:
    """Everything one replica group reported, in arrival order, across its incarnations."""

    group: int
    time: list[float] = field(default_factory=list)  # committed steps only
    step: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    num_participants: list[int] = field(default_factory=list)
    quorum_id: list[int] = field(default_factory=list)
    incarnation_of: list[int] = field(default_factory=list)
    heals: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    uncommitted: int = 0
    end: dict[str, Any] | None = None
    incarnation: int = -1
    last_quorum: dict[str, Any] | None = None
    healing: bool = False  # the current quorum asked this group to heal and it has not loaded yet
    trained_since_start: bool = False  # committed a step as a participant in the current incarnation

    def add(self, rec: Mapping[str, Any]) -> None:
        """Fold one JSONL record in."""
        kind = rec.get("event")
        if kind == "start":
            self.incarnation = int(rec.get("incarnation", self.incarnation + 1))
            self.starts.append(dict(rec))
            self.last_quorum, self.healing, self.trained_since_start, self.end = None, False, False, None
        elif kind == "quorum":
            self.last_quorum = dict(rec)
            self.healing = bool(rec.get("heal"))
        elif kind == "heal":
            self.heals.append({**rec, "incarnation": self.incarnation})
            self.healing = False
        elif kind == "commit":
            if not rec.get("committed", True):
                self.uncommitted += 1
                return
            self.time.append(float(rec["t"]))
            self.step.append(int(rec["step"]))
            self.loss.append(float(rec["loss"]) if rec.get("loss") is not None else math.nan)
            self.num_participants.append(int(rec.get("num_participants", 0)))
            self.quorum_id.append(int(rec.get("quorum_id", -1)))
            self.incarnation_of.append(self.incarnation)
            self.healing = False
            self.trained_since_start = True
        elif kind == "error":
            self.errors.append(dict(rec))
        elif kind == "end":
            self.end = dict(rec)

    @property
    def last_step(self) -> int | None:
        return self.step[-1] if self.step else None

    @property
    def last_loss(self) -> float | None:
        """The latest loss worth showing (a healing step's loss is NaN: computed on replaced weights)."""
        return next((x for x in reversed(self.loss) if not math.isnan(x)), None)

    def commits_after(self, t: float) -> bool:
        return bool(self.time) and self.time[-1] > t


def parse_lines(lines: Iterable[str]) -> list[dict[str, Any]]:
    """JSON objects from complete lines; a torn or foreign line is skipped, not fatal."""
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def load_series(groups_dir: str, num_groups: int) -> dict[int, GroupSeries]:
    """Read every group's JSONL file (missing files give empty series)."""
    series = {g: GroupSeries(g) for g in range(num_groups)}
    for g in range(num_groups):
        path = os.path.join(groups_dir, f"{g}.jsonl")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                for rec in parse_lines(f):
                    series[g].add(rec)
    return series


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def step_times(series: Mapping[int, GroupSeries]) -> list[tuple[int, float]]:
    """(step, first time any group committed it), sorted by step: the job's progress."""
    first: dict[int, float] = {}
    for s in series.values():
        for t, step in zip(s.time, s.step):
            if step not in first or t < first[step]:
                first[step] = t
    return sorted(first.items())


def longest_commit_gap(series: Mapping[int, GroupSeries]) -> float:
    """Longest wait between two consecutive committed steps of the job (how long failures stalled it)."""
    times = [t for _, t in step_times(series)]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def job_step_at(series: Mapping[int, GroupSeries], t: float) -> int:
    """Highest step any group had committed by time `t` (0 before the first commit)."""
    best = 0
    for step, when in step_times(series):
        if when <= t:
            best = max(best, step)
    return best


def failure_outcomes(series: Mapping[int, GroupSeries], kills: Sequence[Mapping[str, Any]],
                     restart: bool = True) -> list[dict[str, Any]]:
    """Per kill: did training go on without the victim, did the victim come back, how long it took.

    A failure is survived when another group committed a step after it and the victim trained
    again afterwards (or restarts were off).
    """
    out = []
    for k in kills:
        t, victim = float(k["time"]), int(k["group"])
        others_went_on = any(s.commits_after(t) for g, s in series.items() if g != victim)
        back = [when for when in series[victim].time if when > t] if victim in series else []
        recovery = (back[0] - t) if back else None
        survived = others_went_on and (bool(back) or not restart)
        out.append({**k, "step": job_step_at(series, t), "survived": survived, "others_went_on": others_went_on,
                    "recovery_s": None if recovery is None else round(recovery, 3)})
    return out


def weights_verdict(series: Mapping[int, GroupSeries]) -> tuple[bool | None, dict[int, Any]]:
    """(True: every group ended at the same step with the same weight digest; False: they differ; None: not
    compared, because some group did not end with a digest; per-group {step, sha256})."""
    finals = {g: ({"step": s.end.get("step"), "weights_sha256": s.end.get("weights_sha256")} if s.end else None)
              for g, s in series.items()}
    ended = [f for f in finals.values() if f is not None and f["weights_sha256"] is not None]
    if not finals or len(ended) != len(finals):
        return None, finals
    return len({(f["step"], f["weights_sha256"]) for f in ended}) == 1, finals


def weights_text(identical: bool | None, finals: Mapping[Any, Any] | None = None) -> str:
    """The verdict in words: a comparison that did not happen is never called a difference."""
    if identical is None:
        missing = sorted(str(g) for g, f in (finals or {}).items() if not f or not f.get("weights_sha256"))
        why = f": group(s) {', '.join(missing)} did not finish" if missing else ""
        return f"not compared{why}"
    return "identical in every group" if identical else "NOT identical"


def failure_notes(outcomes: Sequence[Mapping[str, Any]], started_at: float) -> list[str]:
    """Why each injected failure counts as not survived, one line each."""
    notes = []
    for o in outcomes:
        if o["survived"]:
            continue
        when = f"{float(o['time']) - started_at:.1f}s"
        why = ("no other group committed a step after it" if not o.get("others_went_on", True)
               else f"group {o['group']} did not train again before the end")
        notes.append(f"failure {o['index']} (group {o['group']} killed at {when}): not survived, {why}")
    return notes


def build_report(series: Mapping[int, GroupSeries], kills: Sequence[Mapping[str, Any]], *,
                 started_at: float, duration_s: float, kill_every: float | None, seed: int | None,
                 restart: bool = True, ok_launch: bool = True) -> dict[str, Any]:
    """The numbers the demo promises, plus per-group series for plotting."""
    outcomes = failure_outcomes(series, kills, restart)
    heals = [h for s in series.values() for h in s.heals if is_recovery_heal(h)]
    heal_secs = [float(h["seconds"]) for h in heals if h.get("seconds") is not None]
    recoveries = [o["recovery_s"] for o in outcomes if o["recovery_s"] is not None]
    identical, finals = weights_verdict(series)
    steps = step_times(series)
    survived = sum(1 for o in outcomes if o["survived"])
    report = {
        "groups": len(series),
        "duration_s": duration_s,
        "kill_every_s": kill_every,
        "seed": seed,
        "started_at": started_at,
        "failures_injected": len(outcomes),
        "failures_survived": survived,
        "heals": len(heals),  # a group behind the others loaded a live peer's state
        "initial_syncs": sum(1 for s in series.values() for h in s.heals if not is_recovery_heal(h)),
        "steps_committed": steps[-1][0] if steps else 0,
        "uncommitted_steps": sum(s.uncommitted for s in series.values()),
        "heal_time_s": {"p50": _round(percentile(heal_secs, 50)), "max": _round(max(heal_secs, default=None))},
        "recovery_time_s": {"p50": _round(percentile(recoveries, 50)), "max": _round(max(recoveries, default=None))},
        "longest_commit_gap_s": round(longest_commit_gap(series), 3),
        "weights_identical": identical,  # None: not compared (a group did not finish)
        "weights": weights_text(identical, finals),
        "failure_notes": failure_notes(outcomes, started_at),
        "final": {str(g): f for g, f in finals.items()},
        "failures": outcomes,
        "series": {str(g): _series_json(s, started_at) for g, s in series.items()},
    }
    report["success"] = bool(ok_launch and identical is True and survived == len(outcomes))
    return report


def is_recovery_heal(heal: Mapping[str, Any]) -> bool:
    """A heal of a restarted group: at step 0 every group copies the first one's initial weights, and a
    group that started late catches up once; neither is a failure healed."""
    return bool(heal.get("step")) and int(heal.get("incarnation", 1) or 0) > 0


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _series_json(s: GroupSeries, t0: float) -> dict[str, Any]:
    return {
        "t": [round(t - t0, 3) for t in s.time],
        "step": s.step,
        "loss": [None if math.isnan(x) else round(x, 5) for x in s.loss],
        "num_participants": s.num_participants,
        "quorum_id": s.quorum_id,
        "incarnation": s.incarnation_of,
        "restarts": max(0, len(s.starts) - 1),
        "heals": [{"t": round(float(h["t"]) - t0, 3), "step": h.get("step"), "seconds": h.get("seconds"),
                   "nbytes": h.get("nbytes")} for h in s.heals],
        "errors": len(s.errors),
    }


def write_report(report: Mapping[str, Any], out_dir: str) -> tuple[str, str]:
    """Write report.json and report.png into `out_dir`; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, "report.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    png_path = os.path.join(out_dir, "report.png")
    plot_report(report, png_path)
    return json_path, png_path


def plot_report(report: Mapping[str, Any], path: str) -> None:
    """Loss against step with failure and heal markers; groups in the quorum against time; who trained when."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_part, ax_time) = plt.subplots(
        3, 1, figsize=(10, 9), constrained_layout=True, gridspec_kw={"height_ratios": [3, 1.6, 1.4]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    t0 = float(report.get("started_at", 0.0))
    groups = sorted(report["series"].items(), key=lambda kv: int(kv[0]))
    failures = report.get("failures", [])
    heal_style = {"marker": "^", "color": "tab:green", "ms": 9, "mec": "black", "ls": "none"}

    for g, s in groups:
        color = colors[int(g) % len(colors)]
        for n, segment in enumerate(_segments(s)):  # one line per incarnation: a restart is a visible break
            ax_loss.plot([s["step"][i] for i in segment], [_nan(s["loss"][i]) for i in segment], color=color, lw=1.1,
                         alpha=0.85, label=f"group {g}" if n == 0 else None)
        for h in s["heals"]:
            if h["step"]:  # the initial weight copy at step 0 is not a recovery
                ax_loss.plot([h["step"]], [_loss_at(s, h["step"])], **heal_style)
    for i, k in enumerate(failures):
        ax_loss.axvline(k["step"], color="tab:red", ls="--", lw=1, alpha=0.7,
                        label="failure (SIGKILL)" if not i else None)
    ax_loss.plot([], [], label="heal", **heal_style)
    ax_loss.set(xlabel="committed step", ylabel="training loss", title=_title(report))

    job = _job_participants(report)  # per committed step of the job: when, and how many groups took part
    if job:
        ax_part.step([t for t, _ in job], [n for _, n in job], where="post", color="black", lw=1.5,
                     label="groups in the quorum")
    for i, k in enumerate(failures):
        ax_part.axvline(float(k["time"]) - t0, color="tab:red", ls="--", lw=1, alpha=0.7,
                        label="failure (SIGKILL)" if not i else None)
    ax_part.set(ylabel="participants", ylim=(0, int(report.get("groups", 1)) + 0.5))
    ax_part.yaxis.get_major_locator().set_params(integer=True)

    for row, (g, s) in enumerate(groups):  # a bar while the group commits steps, a gap while it is down
        color = colors[int(g) % len(colors)]
        ax_time.broken_barh(_busy_spans(s["t"]), (row - 0.35, 0.7), color=color, alpha=0.75)
        for h in s["heals"]:
            if h["step"]:
                ax_time.plot([h["t"]], [row], **heal_style)
    rows = {int(g): row for row, (g, _) in enumerate(groups)}
    for k in failures:
        ax_time.plot([float(k["time"]) - t0], [rows.get(int(k["group"]), 0)], marker="X", color="tab:red", ms=10,
                     mec="black", ls="none")
    ax_time.plot([], [], marker="X", color="tab:red", mec="black", ls="none", label="SIGKILL")
    ax_time.plot([], [], label="heal", **heal_style)
    ax_time.set(xlabel="seconds since launch", yticks=list(rows.values()),
                yticklabels=[f"group {g}" for g in rows], ylim=(-0.6, len(rows) - 0.4))
    ax_time.sharex(ax_part)
    for ax in (ax_loss, ax_part, ax_time):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _job_participants(report: Mapping[str, Any]) -> list[tuple[float, int]]:
    first: dict[int, tuple[float, int]] = {}
    for s in report["series"].values():
        for t, step, n in zip(s["t"], s["step"], s["num_participants"]):
            if step not in first or t < first[step][0]:
                first[step] = (t, n)
    return [first[step] for step in sorted(first)]


def _busy_spans(times: Sequence[float], gap_s: float = 1.5) -> list[tuple[float, float]]:
    """(start, width) of the runs of commits with no pause longer than `gap_s`."""
    spans: list[tuple[float, float]] = []
    start = prev = None
    for t in times:
        if start is None:
            start = prev = t
        elif t - prev > gap_s:
            spans.append((start, max(prev - start, 0.05)))
            start = t
        prev = t
    if start is not None:
        spans.append((start, max(prev - start, 0.05)))
    return spans


def _title(report: Mapping[str, Any]) -> str:
    same = report.get("weights") or weights_text(report.get("weights_identical"))
    return (f"{report['groups']} replica groups  |  failures injected {report['failures_injected']}, "
            f"survived {report['failures_survived']}  |  heals {report['heals']}  |  final weights {same}")


def _segments(s: Mapping[str, Any]) -> list[list[int]]:
    segs: list[list[int]] = []
    for i, inc in enumerate(s["incarnation"]):
        if not segs or s["incarnation"][segs[-1][-1]] != inc:
            segs.append([])
        segs[-1].append(i)
    return segs


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _loss_at(s: Mapping[str, Any], step: int) -> float:
    """The first loss worth plotting at or after `step` (where a heal marker sits on the curve)."""
    for st, loss in zip(s["step"], s["loss"]):
        if st >= step and loss is not None:
            return loss
    return math.nan
