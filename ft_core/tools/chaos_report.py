"""The options of `ftl chaos`, the summary of a run (OUT/summary.json) and the verdict table it prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections import Counter
from typing import Any

from ft_core.tools.chaos_checks import (
    Incarnation,
    divergent_commits,
    heal_fault_outcomes,
    heal_stats,
    ledger,
    membership_changes,
    quorum_regressions,
    under_replicated_steps,
)
from ft_core.tools.chaos_matrix import FAULT_KINDS, NETWORK_KINDS, ChaosConfig


def ledger_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The data ledger per epoch (steps, lost: complete epochs only, duplicated, conflicting steps), with
    consecutive epochs of the same counts on one line."""
    runs: list[list[Any]] = []  # [first epoch, last epoch, min steps, max steps, counts]
    for epoch, row in sorted(((int(e), r) for e, r in rows.items())):
        counts = (row["lost"] if row["complete"] else "-", row["duplicated"], row["conflicts"], row["complete"])
        if runs and runs[-1][4] == counts and runs[-1][1] == epoch - 1:
            runs[-1][1], runs[-1][2], runs[-1][3] = epoch, min(runs[-1][2], row["steps"]), max(runs[-1][3], row["steps"])
        else:
            runs.append([epoch, epoch, row["steps"], row["steps"], counts])
    lines = []
    for first, last, low, high, (lost, duplicated, conflicts, complete) in runs:
        which = f"epoch {first}" if first == last else f"epochs {first}..{last}"
        steps = f"{low}" if low == high else f"{low}-{high}"
        lines.append(f"{which}: {steps} steps{' each' if first != last else ''}, lost {lost}, duplicated {duplicated}, "
                     f"conflicting steps {conflicts}" + ("" if complete else " (incomplete)"))
    return lines


def network_lines(outcomes: list[dict[str, Any]]) -> list[str]:
    """One line per network fault: what, how long, and what the groups did during and after it."""
    lines = []
    for o in outcomes:
        line = f"{o['index']} {o['kind']} {o['target']} {o['seconds']:.1f}s: {o['commits_during']} steps committed during"
        if o["kind"] == "host_cut":
            line += f"; the cut group committed {o['cut_commits']} while cut, rejoined {o['rejoined']}, healed " \
                    f"{o['healed']}"
        elif o["kind"] == "partition":
            line += f"; committed together while blocked {o['pair_commits']}, excluded {o['excluded']}, both " \
                    f"rejoined {o['rejoined']}"
        elif o["kind"] == "lighthouse_cut":
            line += f", {o['commits_after_failover']} of them after the failover time"
        lines.append(line)
    return lines


def print_summary(console: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="ftl chaos", show_header=False)
    table.add_row("verdict", "[bold green]PASS[/]" if summary["ok"] else "[bold red]FAIL[/]")
    table.add_row("cell", summary["cell"] + (" on simulated hosts (--network)" if summary.get("network") else ""))
    table.add_row("invariants", f"{summary['divergent_commits']} divergent commits, "
                                f"{summary['under_replicated_commits']} under-replicated commits, {summary['wrong_reductions']} "
                                f"wrong reductions, {summary['wedged_groups']} wedged groups, {summary['hangs']} hangs; "
                                f"reductions checked {json.dumps(summary['reductions_checked'])}")
    if summary.get("ledger") is not None:
        rows = summary["ledger"]
        complete = [r for r in rows.values() if r["complete"]]
        table.add_row("data ledger", f"{len(complete)} complete epochs of {len(rows)}: lost "
                                     f"{sum(r['lost'] for r in complete)}, duplicated "
                                     f"{sum(r['duplicated'] for r in rows.values())}, conflicting steps "
                                     f"{sum(r['conflicts'] for r in rows.values())}; "
                                     f"{summary.get('membership_changes', 0)} membership changes")
        table.add_row("ledger per epoch", "\n".join(ledger_lines(rows)) or "no step logged its samples")
    table.add_row("faults", f"{summary['faults_injected']} of {summary['faults_requested']} "
                            f"{json.dumps(summary['faults_by_kind'])}")
    if summary["faults_skipped"]:
        table.add_row("skipped", json.dumps(summary["faults_skipped"]))
    if summary.get("network_faults"):
        table.add_row("network faults", "\n".join(network_lines(summary["network_faults"])))
    t = summary["transfers"]
    table.add_row("heals", f"{t['heals_loaded']} loaded; transfers {t['recv_start']} started, {t['recv_done']} "
                           f"done, {t['recv_failed']} failed; {t['drop']} requests dropped")
    table.add_row("worker faults", f"{t['skip']} skipped steps, {t['load_failed']} failed loads, "
                                   f"{t['recv_injected']} failed fetches (injected)")
    table.add_row("heal faults", json.dumps(summary["heal_faults"]))
    table.add_row("steps", f"max {summary['max_step']} (target {summary['target_step']}), "
                           f"{summary['commits_logged']} commits logged over {summary['incarnations']} processes")
    if summary.get("quorum_regressions"):
        first = summary["quorum_regressions"][0]
        table.add_row("forked history", f"{len(summary['quorum_regressions'])} quorum(s) (first 20 listed) issued below "
                                        f"a committed step; first: quorum {first['quorum_id']} at max_step "
                                        f"{first['max_step']} after step {first['highest_committed']} had committed, "
                                        f"members {', '.join(first['replica_ids'])}")
    table.add_row("quorum ids", f"up to {summary['max_quorum_id']}; {summary.get('membership_changes', 0)} "
                                f"membership changes; lighthouse started {summary['lighthouse_starts']} times")
    table.add_row("time", f"{summary['seconds']} s")
    console.print(table)
    for problem in summary["problems"][:50]:
        console.print(f"[red]- {problem}[/red]", highlight=False)


def summarize(run: Any, incarnations: list[Incarnation], problems: list[str],
              network_faults: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of a finished run (`ChaosRun`): verdict, counts, the faults, the ledger."""
    cfg = run.cfg
    steps = [r for inc in incarnations for r in inc.steps]
    quorum_ids = [q for inc in incarnations for q in inc.quorum_ids()]
    checked = Counter(name for r in steps for name in (r.get("reduce") or {}))
    return {
        "ok": not problems,
        "problems": problems,
        "cell": cfg.cell.name,
        "divergent_commits": divergent_commits(incarnations),
        "under_replicated_commits": len(under_replicated_steps(incarnations, cfg.min_replicas)),
        "wrong_reductions": sum(1 for p in problems if p.startswith("wrong reduction")),
        "wedged_groups": sum(1 for p in problems if p.startswith("wedged") or "did not complete: group" in p
                             or ("ended" in p and "not done" in p)),
        "hangs": sum(1 for p in problems if p.startswith("no progress") or "at its deadline" in p),
        "reductions_checked": dict(checked),
        "ledger": {str(k): v for k, v in ledger(incarnations, cfg.dataset_size).items()} if cfg.ledger
        else None,
        "membership_changes": membership_changes(incarnations),
        "quorum_regressions": quorum_regressions(incarnations)[:20],  # the first ones: a forked history's start
        "network": cfg.network,
        "network_faults": network_faults,
        "faults_injected": len(run.faults),
        "faults_requested": cfg.faults,
        "faults_by_kind": dict(Counter(f.kind for f in run.faults)),
        "faults_skipped": dict(run.skipped),
        "stranded_at_exit": list(run.stranded),
        "target_step": run.target,
        "max_step": max((int(r["step"]) for r in steps), default=0),
        "commits_logged": len(steps),
        "incarnations": len(incarnations),
        "max_quorum_id": max(quorum_ids, default=0),
        "lighthouse_starts": run.lighthouse.starts,
        "transfers": heal_stats(incarnations),
        "heal_faults": heal_fault_outcomes([dataclasses.asdict(f) for f in run.faults], incarnations),
        "seconds": round(time.monotonic() - run.started, 1),
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k != "token"},
        "faults": [dataclasses.asdict(f) for f in run.faults],
    }


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """The options of `ftl chaos` (`description`: its help text)."""
    p = argparse.ArgumentParser(prog="ftl chaos", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ChaosConfig(out="")
    p.add_argument("--groups", type=int, default=d.groups, help=f"replica groups (default {d.groups})")
    p.add_argument("--faults", type=int, default=d.faults, help=f"faults to inject (default {d.faults})")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the fault schedule")
    p.add_argument("--duration", type=float, default=d.duration,
                   help=f"hard bound of the whole run in seconds (default {d.duration:.0f}); faults stop at 80%%")
    p.add_argument("--min-replicas", type=int, default=d.min_replicas, help="participants needed to commit")
    p.add_argument("--out", default="chaos-run", help="folder for logs and summary.json (default chaos-run)")
    p.add_argument("--interval", type=float, default=d.interval, help="mean seconds between faults")
    p.add_argument("--timeout", type=float, default=d.timeout, help="collective/heal timeout of the workers")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=d.heartbeat_timeout_ms)
    p.add_argument("--transport-delay-ms", type=float, default=d.transport_delay_ms,
                   help="delay per checkpoint request on every source")
    p.add_argument("--transport-drop", type=float, default=d.transport_drop,
                   help="probability a checkpoint request is dropped")
    p.add_argument("--kinds", default=None,
                   help=f"comma-separated fault kinds to draw from (default {','.join(FAULT_KINDS)}, with --network "
                        f"also {','.join(NETWORK_KINDS)})")
    p.add_argument("--quiet-steps", type=int, default=d.quiet_steps, help="steps trained after the last fault")
    p.add_argument("--ledger", action="store_true",
                   help="train on the exactly-once DistributedSampler (ft_core.data) and check its ledger per epoch "
                        "(lost, duplicated samples); default: synthetic batches")
    p.add_argument("--spares", action="store_true",
                   help="restart killed groups from warm spares (torch and ft_core imported ahead), as "
                        "`ftl launch --spares` does")
    p.add_argument("--network", action="store_true",
                   help="run the groups and two lighthouses (primary + standby) on simulated hosts and add the "
                        "network faults host_cut, partition, lighthouse_cut (needs root, `ip netns`, nft; "
                        "skipped with exit status 3 where they cannot run)")
    p.add_argument("--matrix", default="all",
                   help="'list' prints the matrix cells and exits; 'all' (default) or cell indices like 3,5: the "
                        "cells the seed chooses among (seed k runs the k-th of them, modulo their number)")
    return p
