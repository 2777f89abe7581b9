"""Render benchmark results: a markdown report (targets table first, then one table per benchmark),
PNG plots, and the README's results section."""

from __future__ import annotations

import math
import os
import re
from typing import Any

from benchmarks.targets import (
    CAPACITY_FACTOR,
    HEAL_GBPS,
    LOST_STEPS_KILLS,
    QUORUM_2,
    RESTART_S,
    STEP_RATIO,
    SURVIVOR_GAP_S,
)

README_BEGIN = "<!-- results:begin -->"
README_END = "<!-- results:end -->"
NA = "–"

# The reference: torchft as measured by the author on this kind of machine.
REFERENCE = {"overhead": "1.45x (107.8 vs 74.1 ms)", "p50_2": "2.4 ms", "p99_2": "4.7 ms", "gap": "5.2 s",
             "restart": "5.1 s", "heal": "0.8-2.1 GB/s", "p99_64": "99 ms"}
PHASES = [("start_imports_s", "start + imports"), ("quorum_s", "quorum"), ("transfer_s", "transfer"),
          ("load_s", "load"), ("rest_of_step_s", "rest of the first step")]


def _get(mapping: Any, key: Any) -> Any:
    """mapping[key], also when JSON turned an int key into a string."""
    if not isinstance(mapping, dict):
        return None
    if key in mapping:
        return mapping[key]
    return mapping.get(str(key))


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not math.isnan(float(value)) else None


def _fmt(value: Any, unit: str = "", digits: int = 3) -> str:
    v = _num(value)
    if v is None:
        return NA
    text = f"{v:.{digits}g}" if abs(v) < 1000 else f"{v:.0f}"
    return f"{text}{unit}"


def _ratio(a: Any, b: Any) -> str:
    x, y = _num(a), _num(b)
    return f"{x / y:.2f}x" if x is not None and y not in (None, 0.0) else NA


def _mark(value: Any, target: float, higher_is_better: bool = False) -> str:
    v = _num(value)
    if v is None:
        return ""
    return " ✓" if (v >= target if higher_is_better else v <= target) else " ✗"


def _ok(results: dict, name: str) -> dict | None:
    outcome = results["benchmarks"].get(name)
    return outcome["result"] if outcome and outcome.get("ok") else None


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


# ---------------------------------------------------------------- the targets table


def _largest_size(transfer: dict) -> tuple[str, dict] | tuple[None, None]:
    sizes = transfer.get("sizes") or {}
    if not sizes:
        return None, None
    label = max(sizes, key=lambda k: sizes[k].get("bytes", 0))
    return label, sizes[label]


EXTRA_GROUPS = (128, 256, 384, 512)  # also reported where measured


def _at_most(a: Any, b: Any) -> str:
    """✓ when ours (a) is at most torchft's (b) in the same run; no mark without both."""
    x, y = _num(a), _num(b)
    return "" if x is None or y is None else (" ✓" if x <= y else " ✗")


def _overhead_rows(overhead: dict) -> list[list[str]]:
    rows = []
    for model, entry in overhead["models"].items():
        ms, ratio = entry["step_ms"], entry.get("ratio_vs_baseline", {})
        limit = STEP_RATIO.get(model, STEP_RATIO["mlp3.7m"])
        for mode, name in (("ft", "core API"), ("lightning_ft", "Lightning"), ("accelerate_ft", "Accelerate")):
            if mode not in ms or mode not in ratio:
                continue
            base = overhead["baseline"][mode]
            torchft = mode == "ft" and "torchft" in ms and "torchft" in ratio
            rows.append([f"step time, {name}, {model} (2 groups x 1 process)", f"<= {limit:.2f}x its plain DDP",
                         f"{ratio[mode]:.2f}x ({ms[mode]:.1f} ms){_mark(ratio[mode], limit)}",
                         f"{ratio['torchft']:.2f}x ({ms['torchft']:.1f} ms)" if torchft else NA,
                         f"{overhead['labels'][base]} {ms[base]:.1f} ms",
                         _ratio(ms[mode], ms["torchft"]) if torchft else NA,
                         REFERENCE["overhead"] if mode == "ft" and model == "mlp3.7m" else NA])
    return rows


def _quorum_rows(quorum: dict, capacity: dict | None) -> list[list[str]]:
    rows = []
    ours, ref = quorum.get("ft_core", {}).get("steady", {}), quorum.get("torchft", {}).get("steady", {})
    for key, limit, ref_key in (("p50_ms", QUORUM_2["p50_ms"], "p50_2"), ("p99_ms", QUORUM_2["p99_ms"], "p99_2")):
        a, b = _get(_get(ours, 2), key), _get(_get(ref, 2), key)
        if a is None and b is None:
            continue
        rows.append([f"steady quorum {key[:3]}, 2 groups (raw client calls)", f"<= {limit:g} ms",
                     _fmt(a, " ms") + _mark(a, limit), _fmt(b, " ms"), NA, _ratio(a, b), REFERENCE[ref_key]])
    if not capacity:  # the 10 Hz figures come from capacity; without it, the back-to-back rounds at 64+
        for n in (64, *EXTRA_GROUPS):
            for key in ("p50_ms", "p99_ms"):
                a, b = _get(_get(ours, n), key), _get(_get(ref, n), key)
                if a is None and b is None:
                    continue
                rows.append([f"quorum {key[:3]}, {n} groups, back to back", "<= torchft's" if n == 64 else
                             "(reported)", _fmt(a, " ms") + (_at_most(a, b) if n == 64 else ""), _fmt(b, " ms"),
                             NA, _ratio(a, b), REFERENCE["p99_64"] if n == 64 and key == "p99_ms" else NA])
    return rows


def _capacity_rows(capacity: dict) -> list[list[str]]:
    rows = []
    ours, ref = capacity.get("ft_core", {}), capacity.get("torchft", {})
    for n in (64, *EXTRA_GROUPS):
        for key, name in (("p50_ms", "median"), ("p99_ms", "p99")):
            a, b = _get(_get(ours.get("series"), n), key), _get(_get(ref.get("series"), n), key)
            if a is None and b is None:
                continue
            rows.append([f"lighthouse, {n} groups at {capacity['hz']:g} Hz: quorum {name}",
                         "<= torchft's (same run)" if n == 64 else "(reported)",
                         _fmt(a, " ms") + (_at_most(a, b) if n == 64 else ""), _fmt(b, " ms"), NA, _ratio(a, b),
                         "19 ms" if n == 64 and key == "p50_ms" else "~30 ms" if n == 64 else NA])
    a, b = ours.get("max_groups_under_limit"), ref.get("max_groups_under_limit")
    mark = ""
    if _num(a) is not None and _num(b) is not None:
        mark = " ✓" if a >= CAPACITY_FACTOR * b else " ✗"
    note = f" ({ours['note']})" if ours.get("note") else ""
    rows.append([f"lighthouse capacity: groups at {capacity['hz']:g} Hz with p99 <= {capacity['limit_ms']:g} ms",
                 f">= {CAPACITY_FACTOR:g}x torchft's (same run)", (f"{a}" if a is not None else NA) + mark + note,
                 f"{b}" if b is not None else NA, NA, _ratio(a, b), NA])
    for n in (64, *EXTRA_GROUPS):  # the lighthouse's own CPU per round: load-independent, unlike the latencies
        a, b = (_get(_get(side.get("series"), n), "lighthouse_cpu_ms_per_round") for side in (ours, ref))
        if a is not None or b is not None:
            rows.append([f"lighthouse CPU per round, {n} groups at {capacity['hz']:g} Hz", "(reported)",
                         _fmt(a, " ms"), _fmt(b, " ms"), NA, _ratio(a, b), NA])
    return rows


def _failure_rows(failure: dict) -> list[list[str]]:
    ours, ref = failure["restart"], failure.get("torchft", {})
    rows = []
    for key, name, limit, ref_key in (("survivor_gap_s", "survivors' longest commit gap after SIGKILL", SURVIVOR_GAP_S,
                                       "gap"),
                                      ("total_s", "killed group: restart to first commit (3.7M params)", RESTART_S,
                                       "restart")):
        rows.append([name, f"<= {limit:g} s", _fmt(ours.get(key), " s") + _mark(ours.get(key), limit),
                     _fmt(ref.get(key), " s"), NA, _ratio(ours.get(key), ref.get(key)), REFERENCE[ref_key]])
    warm = failure.get("restart_warm")
    if isinstance(warm, dict) and "total_s" in warm:  # runs before 2026-12-05 had no warm spares
        rows.append(["killed group: restart to first commit, warm spare (`ftl launch --spares`)", f"<= {RESTART_S:g} s",
                     _fmt(warm["total_s"], " s") + _mark(warm["total_s"], RESTART_S), _fmt(ref.get("total_s"), " s"),
                     NA, _ratio(warm["total_s"], ref.get("total_s")), "torchft: no spares (cold restart)"])
    alone = failure.get("start_alone") or {}
    if "ours" in alone:
        a, b = alone["ours"], alone.get("torchft", {})
        rows.append(["a group started alone: spawn to Manager ready (CPU)", "(reported)",
                     f"{a['ready_s']:.2f} s ({a['cpu_s']:.2f})",
                     f"{b['ready_s']:.2f} s ({b['cpu_s']:.2f})" if b else NA, NA,
                     _ratio(a["ready_s"], b.get("ready_s")), NA])
    lost = failure.get("lost_steps")
    if isinstance(lost, dict):
        for mode, entry in lost.items():
            if mode == "target" or not isinstance(entry, dict) or "survivor_steps_lost" not in entry \
                    or "kills" not in entry:
                continue
            n, kills = entry["survivor_steps_lost"], entry["kills"]
            ok = " ✓" if n == 0 and kills >= LOST_STEPS_KILLS else " ✗" if n else ""
            rows.append([f"survivors' steps lost per SIGKILL ({mode})", f"0 in >= {LOST_STEPS_KILLS} kills",
                         f"{n} in {kills} kills{ok}", NA, NA, NA, "torchft: 0-1 per kill (issue)"])
    return rows


def targets_rows(results: dict) -> list[list[str]]:
    rows: list[list[str]] = []
    overhead = _ok(results, "overhead")
    if overhead:
        rows += _overhead_rows(overhead)
    quorum, capacity = _ok(results, "quorum_latency"), _ok(results, "capacity")
    if quorum:
        rows += _quorum_rows(quorum, capacity)
    if capacity:
        rows += _capacity_rows(capacity)
    failure = _ok(results, "failure")
    if failure:
        rows += _failure_rows(failure)
    transfer = _ok(results, "transfer")
    if transfer:
        label, row = _largest_size(transfer)
        if row:
            note = "" if label == "1GB" else f" (largest measured: {label}; the target is for 1 GB)"
            mark = _mark(row["http_fresh_gbps"], HEAL_GBPS, True) if label == "1GB" else ""
            rows.append([f"heal transfer, HTTP, fresh tensors, {label}{note}", f">= {HEAL_GBPS:g} GB/s for 1 GB",
                         _fmt(row["http_fresh_gbps"], " GB/s") + mark,
                         _fmt(row.get("torchft_http_gbps"), " GB/s"), f"raw TCP {_fmt(row['raw_tcp_gbps'], ' GB/s')}",
                         _ratio(row["http_fresh_gbps"], row.get("torchft_http_gbps")), REFERENCE["heal"]])
            if "http_first_gbps" in row:
                rows.append([f"same, the first fetch in a new process (a restarted replica's heal), {label}", "-",
                             _fmt(row["http_first_gbps"], " GB/s"), _fmt(row.get("torchft_first_gbps"), " GB/s"), "",
                             _ratio(row["http_first_gbps"], row.get("torchft_first_gbps")), ""])
    return rows


# ---------------------------------------------------------------- per-benchmark sections


def _overhead(res: dict) -> list[str]:
    target = res.get("target_ratio")
    said = (", ".join(f"{m} <= {r:g}x" for m, r in target.items()) if isinstance(target, dict)
            else f"<= {target}x" if target else "")
    lines = [f"Median step time per process; each job is 2 processes (plain: one DDP world of 2; ours and "
             f"torchft: 2 replica groups x 1 process), 1 torch thread each. Modes alternate within the run. "
             f"Target: {said} the plain baseline.", ""]
    for model, entry in res["models"].items():
        lines.append(f"**{model}** ({entry['params'] / 1e6:.2f}M parameters, batch 32, {entry['rounds']} round(s) of "
                     f"{entry['steps']} timed steps per mode)")
        lines.append("")
        rows = []
        for mode, ms in entry["step_ms"].items():
            base = res["baseline"].get(mode)
            rows.append([res["labels"][mode], f"{ms:.2f}", res["labels"][base] if base else "(baseline)",
                         f"{entry['ratio_vs_baseline'][mode]:.3f}x" if base else NA])
        lines += _table(["mode", "median step (ms)", "compared with", "ratio"], rows)
        if "ours_vs_torchft" in entry:
            lines += [f"Core API vs torchft: {entry['ours_vs_torchft']:.3f}x.", ""]
        lines += _overhead_detail(res, entry)
    return lines


def _overhead_detail(res: dict, entry: dict) -> list[str]:
    """Per phase, per thread and the lighthouse's CPU (core API, torch DDP, torchft), where measured."""
    phases, threads = entry.get("phases_ms") or {}, entry.get("thread_cpu_ms") or {}
    lines: list[str] = []
    if phases:
        names = ["zero_grad", "forward", "backward", "step", "cpu"]
        rows = [[res["labels"].get(m, m)] + [_fmt(p.get(n), digits=3) for n in names] for m, p in phases.items()]
        lines += ["Per phase (median ms; `cpu`: the process's CPU time per step, every thread):", ""]
        lines += _table(["mode", "zero_grad", "forward", "backward (+ reduction)", "step (vote + optimizer)",
                         "cpu"], rows)
    if threads:
        kinds = sorted({k for t in threads.values() for k in t}, key=lambda k: -max(t.get(k, 0) for t in
                                                                                      threads.values()))
        kinds = [k for k in kinds if max(t.get(k, 0) for t in threads.values()) >= 0.05]
        rows = [[k] + [_fmt(threads[m].get(k), digits=3) for m in threads] for k in kinds]
        lighthouse = entry.get("lighthouse_cpu_ms") or {}
        if lighthouse:
            rows.append(["lighthouse (driver process, per step of the job)"] +
                        [_fmt(lighthouse.get(m), digits=3) for m in threads])
        lines += ["CPU ms per timed step by thread (mean of the 2 ranks, 10 ms clock ticks):", ""]
        lines += _table(["thread"] + [res["labels"].get(m, m) for m in threads], rows)
    per_round, cpu = entry.get("ratio_per_round") or {}, entry.get("cpu_ratio_vs_baseline") or {}
    if per_round:
        rows = [[res["labels"].get(m, m), ", ".join(f"{r:.2f}" for r in rounds) + "x",
                 f"{cpu[m]:.2f}x" if m in cpu else NA] for m, rounds in per_round.items()]
        lines += ["Each round's step-time ratio (the jobs of a round run back to back), and the ratio of CPU per step "
                  "(every thread of a rank, median over the rounds; on 2 cores with both ranks CPU-bound, what a mode "
                  "adds shows there with less of the machine's drift):", ""]
        lines += _table(["mode", "step-time ratio per round", "CPU per step ratio"], rows)
    copies = entry.get("bucket_copies") or {}
    if copies:
        said = ", ".join(f"{res['labels'].get(m, m)} {n}" for m, n in copies.items())
        lines += [f"DDP buckets that took the copy path (whole run, incl. the first step before DDP rebuilds its "
                  f"buckets): {said}.", ""]
    load = entry.get("load_avg_1min")
    if load:
        lines += [f"1-minute load average during this model's jobs: {load['min']:g} to {load['max']:g} "
                  f"(2 cores; other users of the machine included).", ""]
    return lines


def _quorum(res: dict) -> list[str]:
    lines = [f"One `ManagerClient.quorum` round trip per group per round ({res['rounds']} rounds); the lighthouse "
             "in its own process, groups spread over worker processes. Membership: one group leaves or joins "
             "every round (ours only: torchft drops a dead group only after its 5 s heartbeat timeout).", ""]
    rows = []
    for n in res["groups"]:
        cells = [str(n)]
        for impl, mode in (("ft_core", "steady"), ("torchft", "steady"), ("ft_core", "membership")):
            stats = _get(res.get(impl, {}).get(mode, {}), n)
            cells += [_fmt(_get(stats, "p50_ms")), _fmt(_get(stats, "p99_ms"))]
        rows.append(cells)
    return lines + _table(["groups", "ours p50 (ms)", "ours p99", "torchft p50", "torchft p99",
                           "ours, membership change p50", "p99"], rows)


def _failure(res: dict) -> list[str]:
    ours, ref = res["restart"], res.get("torchft", {})
    lines = ["Three replica groups (one process each) train the 3.7M-parameter MLP (AdamW, batch 32); one is "
             "SIGKILLed in its forward pass and restarted at once. Phases of the restarted process, from its spawn "
             f"(median of {ours['repeats']}); torchft runs with its defaults through the same harness "
             "(benchmarks/_torchft_train.py).", ""]
    warm = res.get("restart_warm") or {}
    rows = [[name, _fmt(ours.get(key), " s"), _fmt(warm.get(key), " s"), _fmt(ref.get(key), " s")]
            for key, name in PHASES]
    if "start_imports_cpu_s" in ours:  # runs before 2026-12-05 (session 19) did not record it
        rows.insert(1, ["- the restarted process's CPU until then", _fmt(ours["start_imports_cpu_s"], " s"), NA,
                        _fmt(ref.get("start_imports_cpu_s"), " s")])
    rows.append(["**restart to first commit**", _fmt(ours["total_s"], " s"), _fmt(warm.get("total_s"), " s"),
                 _fmt(ref.get("total_s"), " s")])
    rows.append(["**survivors' longest commit gap**", _fmt(ours["survivor_gap_s"], " s"),
                 _fmt(warm.get("survivor_gap_s"), " s"), _fmt(ref.get("survivor_gap_s"), " s")])
    for key, name in (("survivor_gap_kill_s", "- of which before the restarted process was ready (the kill)"),
                      ("survivor_gap_rejoin_s", "- of which after it (its join and heal)"),
                      ("survivor_step_s", "survivors' median step before the kill")):
        if key in ours:  # runs before 2026-12-04 did not split the gap
            rows.append([name, _fmt(ours.get(key), " s"), _fmt(warm.get(key), " s"), _fmt(ref.get(key), " s")])
    rows.append(["checkpoint received", _fmt(ours.get("nbytes", 0) / 1e6, " MB"), NA, NA])
    if warm:
        lines[-2] += (" Warm spare: the restart is a spare process that had imported torch and ft_core before the "
                      "kill (`ftl launch --spares`), timed from its activation.")
    lines += _table(["phase", "ours, cold", "ours, warm spare", "torchft"], rows)
    if "skipped" in ref:
        lines += [f"torchft: {ref['skipped']}.", ""]
    alone = res.get("start_alone") or {}
    if alone:
        said = "; ".join(f"{impl} ready {a['ready_s']:.2f} s after spawn, "
                         f"{a['cpu_s']:.2f} s of CPU" for impl, a in alone.items())
        lines += [f"The same group started with no other group running (its lighthouse only; median of "
                  f"{next(iter(alone.values()))['repeats']}, alternating): {said}. Ours restarts beside survivors "
                  "that keep training on the same cores; torchft's survivors wait for its restart (their gap above).",
                  ""]
    vote = res.get("vote")
    if vote:
        lines += [f"Commit vote (`should_commit`, 1 rank per group) in steady state: p50 {vote['p50_ms']:.3f} ms, "
                  f"p99 {vote['p99_ms']:.3f} ms over {vote['steps']} steps.", ""]
    return lines


def _transfer(res: dict) -> list[str]:
    torchft = "torchft_http" in res.get("kinds", [])
    first = "http_first" in res.get("kinds", [])
    lines = [f"Checkpoint transfer on loopback, source in its own process; best of {res['reps']} (GB/s, median "
             "in brackets). Fresh: the receiver allocates new tensors, several fetches in one process; in place: "
             "into existing tensors; first: one fetch in a new process each time, as a restarted replica heals "
             "(all its memory is new to it; a later fetch in one process can reuse pages the previous one freed, "
             "which flatters the fresh column of a transport allocating per tensor).", ""]
    kinds = ["raw_tcp", "http_fresh", "http_inplace", "pg"] + (["http_first"] if first else [])
    kinds += (["torchft_http"] + (["torchft_first"] if first else [])) if torchft else []
    rows = []
    for label, row in res["sizes"].items():
        cells = [label]
        for kind in kinds:
            cells.append(f"{_fmt(row[kind + '_gbps'])} ({_fmt(row[kind + '_median_gbps'])})")
        if torchft:
            cells.append(_ratio(row["http_fresh_gbps"], row["torchft_http_gbps"]))
            if first:
                cells.append(_ratio(row["http_first_gbps"], row["torchft_first_gbps"]))
        rows.append(cells)
    names = {"raw_tcp": "raw TCP (ceiling)", "http_fresh": "ours HTTP fresh", "http_inplace": "ours HTTP in place",
             "pg": "ours PG (Gloo)", "http_first": "ours, first fetch", "torchft_http": "torchft HTTPTransport",
             "torchft_first": "torchft, first fetch"}
    header = ["size"] + [names[kind] for kind in kinds]
    if torchft:
        header += ["ours fresh / torchft"] + (["ours first / torchft first"] if first else [])
    return lines + _table(header, rows)


def _capacity(res: dict) -> list[str]:
    lines = [f"Every group runs a quorum at {res['hz']:g} Hz; the count grows until p99 passes "
             f"{res['limit_ms']:g} ms.", ""]
    rows = []
    for impl, name in (("ft_core", "ours"), ("torchft", "torchft")):
        entry = res.get(impl)
        if not entry:
            continue
        for n, stats in entry["series"].items():
            rows.append([name, str(n), _fmt(stats["p50_ms"]), _fmt(stats["p99_ms"]),
                         str(stats.get("rounds_over_period", NA))])
        lines_note = entry.get("note") or ""
        rows.append([f"**{name}: max groups under the limit**", f"**{entry['max_groups_under_limit']}**",
                     "", "", lines_note])
    return lines + _table(["impl", "groups", "p50 (ms)", "p99 (ms)", "rounds late / note"], rows)


SECTIONS = {"overhead": ("Healthy-path overhead", _overhead), "quorum_latency": ("Quorum latency", _quorum),
            "failure": ("Failure: survivors' gap and restart to first commit", _failure),
            "transfer": ("Heal transfer throughput", _transfer), "capacity": ("Lighthouse capacity", _capacity)}


def _load_text(load: dict | None) -> str:
    """', foreign CPU 0.1 cores, load average 1.9-2.3': what else the machine ran meanwhile."""
    if not load:
        return ""
    foreign = load.get("foreign_cpu_cores")
    avg = load.get("load_avg_1min") or {}
    text = f"; CPU used by other processes meanwhile: {foreign:g} cores" if foreign is not None else ""
    return text + (f"; 1-minute load average {avg['min']:.1f}-{avg['max']:.1f}" if avg else "")


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [f"Run on {m['date']}: {m['cpus']} CPUs ({m['processor']}), {m['platform']}, Python {m['python']}, "
             f"torch {m['torch']}, torchft {m.get('torchft') or 'not installed'}"
             f"{'; quick run (`--quick`)' if results.get('quick') else '; full run'}.", ""]
    rows = targets_rows(results)
    if rows:
        lines += ["### Targets", ""]
        lines += _table(["measurement", "target", "ours", "torchft (this run)", "plain baseline",
                         "ours / torchft", "torchft (issue's reference)"], rows)
        lines += ["✓ / ✗: target met / not met in this run. Lower is better except for throughput and capacity.", ""]
    for name, outcome in results["benchmarks"].items():
        title, render = SECTIONS.get(name, (name, None))
        lines += [f"### {title}", ""]
        if not outcome["ok"]:
            lines += [f"Failed after {outcome['seconds']} s: `{outcome['error']}`", ""]
            continue
        lines += render(outcome["result"]) if render else [f"`{outcome['result']}`", ""]
        lines += [f"({outcome['seconds']} s{_load_text(outcome.get('machine_load'))})", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots


def plots(results: dict, out_dir: str) -> list[str]:
    """overhead.png, quorum_latency.png, transfer.png, failure.png: each where its benchmark succeeded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)

    overhead = _ok(results, "overhead")
    if overhead:
        models = overhead["models"]
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, (model, entry) in zip(axes[0], models.items()):
            modes = list(entry["step_ms"])
            colors = ["#999999" if m not in overhead["baseline"] else "#dd8452" if m == "torchft" else "#4c72b0"
                      for m in modes]
            bars = ax.bar([overhead["labels"][m] for m in modes], [entry["step_ms"][m] for m in modes], color=colors)
            for bar, mode in zip(bars, modes):
                ratio = entry["ratio_vs_baseline"].get(mode)
                if ratio is not None:
                    ax.annotate(f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8)
            ax.set_title(f"median step time, {model} (grey: plain baseline)")
            ax.set_ylabel("ms per step")
            ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        save(fig, "overhead.png")

    quorum = _ok(results, "quorum_latency")
    if quorum:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for impl, mode, color in (("ft_core", "steady", "#4c72b0"), ("torchft", "steady", "#dd8452"),
                                  ("ft_core", "membership", "#55a868")):
            series = quorum.get(impl, {}).get(mode)
            if not series:
                continue
            ns = sorted(int(n) for n in series)
            name = ("ours" if impl == "ft_core" else "torchft") + ("" if mode == "steady" else ", membership change")
            for key, style in (("p50_ms", "-o"), ("p99_ms", "--s")):
                ax.plot(ns, [_get(_get(series, n), key) for n in ns], style, color=color, label=f"{name} {key[:3]}")
        ax.axhline(30, color="red", linewidth=0.8, linestyle=":", label="target p99 at 64 groups (30 ms)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replica groups")
        ax.set_ylabel("quorum round trip (ms)")
        ax.set_title("quorum latency vs number of groups")
        ax.legend(fontsize=7)
        save(fig, "quorum_latency.png")

    transfer = _ok(results, "transfer")
    if transfer:
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        sizes = sorted(transfer["sizes"].items(), key=lambda kv: kv[1]["bytes"])
        xs = [row["bytes"] / 1e6 for _, row in sizes]
        names = {"raw_tcp": "raw TCP (ceiling)", "http_fresh": "ours HTTP, fresh", "http_inplace": "ours HTTP, in place",
                 "pg": "ours PG (Gloo)", "torchft_http": "torchft HTTPTransport", "http_first": "ours, first fetch",
                 "torchft_first": "torchft, first fetch"}
        for kind in transfer.get("kinds", ["raw_tcp", "http_fresh", "http_inplace", "pg"]):
            ax.plot(xs, [row[kind + "_gbps"] for _, row in sizes], "-o", label=names.get(kind, kind))
        ax.axhline(HEAL_GBPS, color="red", linewidth=0.8, linestyle=":", label=f"target {HEAL_GBPS:g} GB/s (1 GB)")
        ax.set_xscale("log")
        ax.set_xlabel("checkpoint size (MB)")
        ax.set_ylabel("GB/s (best of reps)")
        ax.set_title("heal transfer throughput on loopback")
        ax.legend(fontsize=7)
        save(fig, "transfer.png")

    failure = _ok(results, "failure")
    if failure:
        bars = [("ours", failure["restart"])]
        if "total_s" in failure.get("torchft", {}):
            bars.append(("torchft", failure["torchft"]))
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": [3, 1]})
        colors = ["#4c72b0", "#55a868", "#c44e52", "#8172b3", "#937860"]
        for y, (name, data) in enumerate(bars):
            left = 0.0
            for (key, label), color in zip(PHASES, colors):
                width = float(data.get(key) or 0.0)
                ax1.barh(y, width, left=left, color=color, label=label if y == 0 else None)
                left += width
        ax1.axvline(RESTART_S, color="red", linewidth=0.8, linestyle=":", label=f"target {RESTART_S:g} s")
        ax1.set_yticks(range(len(bars)), [name for name, _ in bars])
        ax1.set_xlabel("seconds from the restart's spawn to its first commit")
        ax1.set_title("killed group: restart to first commit")
        ax1.legend(fontsize=7, loc="lower right")
        ax2.bar([name for name, _ in bars], [float(d.get("survivor_gap_s") or 0.0) for _, d in bars],
                color=["#4c72b0", "#dd8452"][: len(bars)])
        ax2.axhline(SURVIVOR_GAP_S, color="red", linewidth=0.8, linestyle=":")
        ax2.set_ylabel("seconds")
        ax2.set_title("survivors' longest gap")
        save(fig, "failure.png")
    return written


def update_readme(markdown_text: str, readme_path: str) -> None:
    """Replace the text between the results markers (append the section if absent)."""
    text = open(readme_path).read() if os.path.exists(readme_path) else "# Benchmarks\n"
    images = "\n".join(f"![{name}](results/{name}.png)" for name in ("overhead", "quorum_latency", "transfer", "failure")
                       if os.path.exists(os.path.join(os.path.dirname(readme_path), "results", f"{name}.png")))
    block = f"{README_BEGIN}\n{markdown_text}\n{images}\n{README_END}"
    if README_BEGIN in text and README_END in text:
        text = re.sub(re.escape(README_BEGIN) + ".*?" + re.escape(README_END), lambda _: block, text, flags=re.DOTALL)
    else:
        text = text.rstrip() + "\n\n## Latest results\n\n" + block + "\n"
    with open(readme_path, "w") as fh:
        fh.write(text)
