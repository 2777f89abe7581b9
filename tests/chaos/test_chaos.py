"""Chaos: seeded fault schedules against a real job (lighthouse child process, 3 replica groups of
ft_core.tools.chaos_worker under the Launcher), then the checks of ft_core.tools.chaos_checks.

The bounded variant runs in CI (one fault of each kind) in one cell of the matrix (ft_core.tools.chaos.MATRIX):
the cell is chosen by the run's seed, which is the day number (UTC) unless FT_CHAOS_SEED is set, so
successive days' CI runs cycle through the 8 cells; a failure names its seed and cell, and
`ftl chaos --seed N` reruns that cell. The long one (`ftl chaos`, 200 faults) is marked slow and runs
only with FT_RUN_SLOW=1. The rules themselves are table-tested here too.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import child_env

from ft_core.tools.chaos import FAULT_KINDS, NETWORK_KINDS, ChaosConfig, ChaosRun
from ft_core.tools.chaos_checks import (
    UNDER_REPLICATED,
    Incarnation,
    LogTail,
    check_completion,
    check_digests,
    check_group_ranks,
    check_min_replicas,
    check_monotonic,
    check_reductions,
    divergent_commits,
    format_steps,
    heal_fault_outcomes,
    membership_changes,
    network_fault_outcomes,
    parse_log_name,
)
from ft_core.tools.chaos_matrix import MATRIX, cell_for, draw_kind, parse_matrix, provoke_due
from ft_core.tools.chaos_network import network_order, network_unavailable
from ft_core.tools.chaos_processes import leftovers
from ft_core.tools.chaos_report import ledger_lines
from ft_core.tools.chaos_worker import expected_reductions, extreme_value
from ft_core.tools.netns import Namespaces, NetnsError


def step(n: int, digest: str = "d", participants: int = 2, t: float = 0.0) -> dict:
    return {"kind": "step", "step": n, "digest": f"{digest}{n}", "participants": participants, "time": t}


def quorum(qid: int) -> dict:
    return {"kind": "event", "event": {"type": "quorum", "quorum_id": qid}}


def inc(group: str, number: int, *records: dict, rank: int = 0) -> Incarnation:
    return Incarnation(group, number, list(records), rank)


# ------------------------------------------------------------------ the rules, as tables

@pytest.mark.parametrize("incarnations, expected", [
    ([inc("0", 0, step(1), step(2)), inc("1", 0, step(1), step(2))], []),
    ([inc("0", 0, step(1), step(2)), inc("1", 0, step(2, "x"))], ["step(s) 2"]),
    ([inc("0", 0, step(1), step(2), step(3)), inc("0", 1, step(2, "x"), step(3, "x"))], ["step(s) 2..3"]),
    ([inc("0", 0, step(5)), inc("1", 3, step(5))], []),  # a restarted group that healed agrees
])
def test_digests_must_agree_for_every_committed_step(incarnations, expected):
    problems = check_digests(incarnations)
    assert len(problems) == len(expected)
    for problem, fragment in zip(problems, expected):
        assert fragment in problem and "divergence" in problem


def test_digests_are_compared_rank_by_rank():
    # rank 1 of a group holds other shards/data than rank 0: it is compared with rank 1 of the others only
    incs = [inc("0", 0, step(1, "a")), inc("0", 0, step(1, "b"), rank=1),
            inc("1", 0, step(1, "a")), inc("1", 0, step(1, "c"), rank=1)]
    problems = check_digests(incs)
    assert len(problems) == 1 and "group 0 incarnation 0 rank 1" in problems[0] and "group 1 incarnation 0 rank 1" \
        in problems[0]
    assert divergent_commits(incs) == 1


@pytest.mark.parametrize("reduce, wrong", [
    ({"avg": [0.5, 0.5], "max": [-3.0, -3.0], "min": [-9.0, -9.0]}, []),
    ({"avg": [50.5, 1.0]}, ["AVG"]),  # a healer's stale gradient counted in the divisor
    ({"avg": [0.5, 0.5], "max": [0.0, -5.0], "min": [0.0, -7.0]}, ["MAX", "MIN"]),  # zeros from a healer
])
def test_every_checked_reduction_of_a_committed_step_has_its_expected_value(reduce, wrong):
    record = step(4)
    record["reduce"] = reduce
    problems = check_reductions([inc("0", 0, record)])
    assert len(problems) == len(wrong)
    for problem, op in zip(problems, wrong):
        assert f"wrong {op}" in problem and "step 4" in problem


def test_expected_reductions_are_the_participants_alone():
    values = [extreme_value(0, 3, r) for r in range(3)]
    got = {"avg": 1.0, "max": max(values), "min": min(values)}
    assert expected_reductions(got, 0, 3) == {"avg": [1.0, 1.0], "max": [max(values)] * 2,
                                              "min": [min(values)] * 2}
    assert all(v < 0 for v in values)  # a zero (a healer's contribution under MAX) can never be right


def survivors_values(old: int, ranks: tuple[int, ...]) -> dict[str, float]:
    values = [extreme_value(0, old, r) for r in ranks]
    return {"avg": sum(ranks) / len(ranks), "max": max(values), "min": min(values)}


REPLAYED = {"type": "redo", "replayed": True, "reductions": 4, "kept": 1}


@pytest.mark.parametrize("got, issued, n, ok", [
    # found by ftl chaos (c1, seed 36301, min_replicas 1): group 1 of 3 killed mid-step, groups 0 and 2 replayed
    # the checked reductions from their old inputs (ranks 0 and 2 of 3) and divided by 2
    (survivors_values(3, (0, 2)), (3, 0), 2, True),
    (survivors_values(3, (0, 2)), (3, 2), 2, True),
    (survivors_values(2, (1,)), (2, 1), 1, True),  # a lone survivor: its own values
    # the AVG completed before the loss and stood (the old quorum's), MAX and MIN were replayed
    ({"avg": 1.0, **{k: v for k, v in survivors_values(3, (0, 2)).items() if k != "avg"}}, (3, 0), 2, True),
    # wrong: replayed values divided by the old count, a set without this group, a value no split explains
    ({**survivors_values(3, (0, 2)), "avg": 2 / 3}, (3, 0), 2, False),
    (survivors_values(3, (1, 2)), (3, 0), 2, False),
    ({**survivors_values(3, (0, 2)), "min": survivors_values(3, (0, 1, 2))["min"] - 1}, (3, 0), 2, False),
])
def test_a_replayed_step_is_checked_against_the_survivors_old_inputs(got, issued, n, ok):
    checked = expected_reductions(got, 0, n, REPLAYED, issued)
    assert list(checked) == list(got)
    assert all(pair[0] == got[name] for name, pair in checked.items())
    matches = all(abs(pair[0] - pair[1]) <= 1e-9 * max(1.0, abs(pair[1])) for pair in checked.values())
    assert matches == ok, checked


@pytest.mark.parametrize("rank0, rank1, wedged", [
    ([1, 2, 3], [1, 2, 3], False),
    ([1, 2, 3, 4], [1, 2, 3], False),  # killed: rank 1 did not log step 4 before the SIGKILL
    ([1, 2, 5, 6], [1, 2, 3, 4, 5, 6], True),  # the ranks took different steps: a partial heal
])
def test_the_ranks_of_a_group_commit_the_same_steps(rank0, rank1, wedged):
    problems = check_group_ranks([inc("0", 0, *map(step, rank0)), inc("0", 0, *map(step, rank1), rank=1)])
    assert bool(problems) is wedged
    assert not problems or "wedged: group 0 incarnation 0 rank 1" in problems[0]


@pytest.mark.parametrize("name, parsed", [("g2.r1.i3.jsonl", ("2", 1, 3)), ("g0.i4.jsonl", ("0", 0, 4)),
                                          ("summary.json", None), ("lighthouse.log", None)])
def test_log_names(name, parsed):
    assert parse_log_name(name) == parsed


@pytest.mark.parametrize("records, problem", [
    ([step(1), step(2), step(3)], None),
    ([step(1), step(3), step(2)], "committed step 2 after step 3"),
    ([step(1), step(1)], "committed step 1 after step 1"),
    ([quorum(1), quorum(4), quorum(4), quorum(9)], None),  # a restarted lighthouse continues above
    ([quorum(5), quorum(2)], "quorum id went backward from 5 to 2"),
])
def test_steps_strictly_increase_and_quorum_ids_never_go_back(records, problem):
    problems = check_monotonic([inc("0", 0, *records)])
    assert problems == [] if problem is None else (len(problems) == 1 and problem in problems[0])


@pytest.mark.parametrize("participants, min_replicas, bad", [(2, 1, False), (None, 1, True)])
def test_every_commit_logs_its_participants(participants, min_replicas, bad):
    record = step(1)
    record["participants"] = participants
    assert bool(check_min_replicas([inc("0", 0, record)], min_replicas)) is bad


@pytest.mark.parametrize("steps_by_group, killed_after, low", [
    ({"0": [1, 2], "1": [1, 2]}, None, []),
    ({"0": [1, 2, 3], "1": [1, 2], "2": [1, 3]}, None, []),  # a healer committed 3 with its source
    ({"0": [1, 2, 3, 4], "1": [1, 2]}, None, ["3..4"]),  # group 0 committed 3 and 4 alone
    ({"0": [1, 2, 3], "1": [1, 2]}, "1", []),  # group 1 was killed after 2: it may have committed 3 unlogged
])
def test_no_step_commits_unless_min_replicas_groups_commit_it(steps_by_group, killed_after, low):
    incs = [inc(g, 0, *map(step, steps), *([] if g == killed_after else [{"kind": "exit"}]))
            for g, steps in steps_by_group.items()]
    problems = check_min_replicas(incs, 2)
    assert len(problems) == len(low)
    for problem, fragment in zip(problems, low):
        assert problem.startswith(UNDER_REPLICATED) and fragment in problem


@pytest.mark.parametrize("steps_by_group, target, missing", [
    ({"0": [10], "1": [10], "2": [12]}, 10, []),
    ({"0": [10], "1": [9], "2": [12]}, 10, ["group 1"]),
    ({"0": [10], "1": [], "2": [12]}, 10, ["group 1"]),
    ({"0": [10], "1": [10], "2": [10]}, None, ["never reached"]),
])
def test_training_completes_when_every_group_reaches_the_target(steps_by_group, target, missing):
    incs = [inc(g, 0, *[step(n) for n in steps]) for g, steps in steps_by_group.items()]
    problems = check_completion(incs, steps_by_group, target)
    assert len(problems) == len(missing)
    for problem, fragment in zip(problems, missing):
        assert fragment in problem


def test_format_steps_and_heal_outcomes():
    assert format_steps([9, 3, 4, 5]) == "3..5, 9"
    receiver = inc("1", 2, {"kind": "recv_start", "step": 7, "time": 10.0})
    healed = inc("2", 1, {"kind": "recv_start", "step": 7, "time": 10.0},
                 {"kind": "recv_failed", "step": 7, "time": 10.5})
    faults = [{"kind": "kill_heal_receiver", "receiver": (1, 2), "step": 7, "time": 10.1},
              {"kind": "kill_heal_source", "receiver": (2, 1), "step": 7, "time": 10.2}]
    assert heal_fault_outcomes(faults, [receiver, healed]) == {"kill_heal_receiver": {"mid_transfer": 1},
                                                              "kill_heal_source": {"transfer_failed": 1}}


def members(qid: int, *ids: str) -> dict:
    return {"kind": "event", "event": {"type": "quorum", "quorum_id": qid, "replica_ids": list(ids)}}


def test_membership_changes_count_quorums_whose_members_differ_from_the_previous_one():
    incs = [inc("0", 0, members(1, "a", "b", "c"), members(2, "a", "b", "c"), members(3, "a", "c")),
            inc("2", 0, members(3, "a", "c"), members(5, "a", "c", "b2"), members(6, "c", "b2", "a"))]
    assert membership_changes(incs) == 2  # 2 -> 3 (b left), 3 -> 5 (b2 joined); 5 -> 6 is the same set


def heal(t: float) -> dict:
    return {"kind": "event", "time": t, "event": {"type": "heal"}}


GRACES = {"host_cut": 2.0, "partition": 2.0, "lighthouse_cut": 5.0}


@pytest.mark.parametrize("kind, where, records, problem", [
    # host_cut of group 1 from t=10 to t=20: a commit logged 1 s after the cut is within the grace
    ("host_cut", {"group": 1}, {"1": [step(5, t=11.0), heal(21.0), step(30, t=22.0)]}, None),
    ("host_cut", {"group": 1}, {"1": [step(5, t=15.0), step(30, t=22.0)]}, "committed step(s) 5 while its host"),
    ("host_cut", {"group": 1}, {"1": [step(5, t=9.0)]}, "never committed again"),
    # partition of groups 0 and 1: each may commit with group 2, never the same step as the other
    ("partition", {"pair": [0, 1]}, {"0": [step(6, t=13.0), step(7, t=14.0), step(40, t=21.0)],
                                     "1": [step(40, t=21.5)]}, None),
    ("partition", {"pair": [0, 1]}, {"0": [step(6, t=13.0), step(40, t=21.0)], "1": [step(6, t=13.1),
                                                                                     step(40, t=21.5)]},
     "committed step(s) 6 together"),
    # lighthouse_cut: commits must go on after the failover grace
    ("lighthouse_cut", {}, {"0": [step(8, t=16.0)], "1": [step(8, t=16.1)]}, None),
    ("lighthouse_cut", {}, {"0": [step(8, t=12.0), step(9, t=21.0)]}, "did not go on through the other"),
])
def test_each_network_fault_keeps_its_promise(kind, where, records, problem):
    fault = {"index": 1, "kind": kind, "target": "t", "time": 10.0, "end": 20.0, **where}
    incs = [inc(g, 0, *recs) for g, recs in records.items()]
    [outcome] = network_fault_outcomes(incs, [fault], GRACES)
    if problem is None:
        assert outcome["problems"] == [], outcome
    else:
        assert len(outcome["problems"]) == 1 and problem in outcome["problems"][0], outcome
    if kind == "host_cut" and problem is None:
        assert outcome["healed"] and outcome["rejoined"] and outcome["cut_commits"] == 0
    if kind == "partition" and problem is None:
        assert outcome["excluded"] == "1" and outcome["pair_commits"] == 0


def test_the_ledger_is_reported_per_epoch():
    clean = {"steps": 30, "lost": 0, "duplicated": 0, "conflicts": 0, "complete": True}
    rows = {"0": clean, "1": dict(clean, steps=31), "2": dict(clean, lost=3), "3": clean,
            "4": {"steps": 4, "lost": 0, "duplicated": 1, "conflicts": 0, "complete": False}}
    assert ledger_lines(rows) == ["epochs 0..1: 30-31 steps each, lost 0, duplicated 0, conflicting steps 0",
                                  "epoch 2: 30 steps, lost 3, duplicated 0, conflicting steps 0",
                                  "epoch 3: 30 steps, lost 0, duplicated 0, conflicting steps 0",
                                  "epoch 4: 4 steps, lost -, duplicated 1, conflicting steps 0 (incomplete)"]


def test_log_tail_reads_whole_lines_only(tmp_path):
    path = tmp_path / "g0.i0.jsonl"
    tail = LogTail(str(path))
    assert tail.read() == []
    path.write_bytes(b'{"kind": "step", "step": 1}\n{"kind": "st')
    assert tail.read() == [{"kind": "step", "step": 1}]
    with open(path, "ab") as f:
        f.write(b'ep", "step": 2}\n')
    assert tail.read() == [{"kind": "step", "step": 2}]


def test_leftover_sweep_finds_a_process_of_the_runs_sessions(processes):
    proc = processes.python("-c", "import time; time.sleep(60)")  # its own session, id = its pid
    assert (proc.pid, "python") in [(pid, name[:6]) for pid, name in leftovers({proc.pid})]
    proc.kill()
    proc.wait(timeout=10)
    assert leftovers({proc.pid}) == []


def test_leftover_sweep_with_the_runs_token_ignores_a_stranger_in_a_reused_session_id(processes):
    """A long run's session ids are pids that the OS hands out again: a process of someone else that leads
    a session with such an id is no leftover; one that carries the run's FT_TOKEN is."""
    ours = processes.python("-c", "import time; time.sleep(60)", env={**child_env(), "FT_TOKEN": "run-a"})
    stranger = processes.python("-c", "import time; time.sleep(60)", env={**child_env(), "FT_TOKEN": "run-b"})
    found = [pid for pid, _ in leftovers({ours.pid, stranger.pid}, token="run-a")]
    assert found == [ours.pid]
    assert sorted(pid for pid, _ in leftovers({ours.pid, stranger.pid})) == sorted([ours.pid, stranger.pid])


def test_the_matrix_covers_every_pair_of_dimensions_and_the_seed_picks_the_cell():
    rows = [(c.ranks, c.sync, c.init_sync, c.batchnorm, c.optimizers, c.extremes, c.worker_faults) for c in MATRIX]
    for i, j in itertools.combinations(range(7), 2):
        assert len({(r[i], r[j]) for r in rows}) == 4, f"dimensions {i} and {j} do not meet in every combination"
    assert [cell_for(seed, parse_matrix("all")).index for seed in range(10)] == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    assert [cell_for(seed, parse_matrix("4,c7")).index for seed in range(3)] == [4, 7, 4]
    assert "--sync" in MATRIX[7].worker_args() and "--recv-fail-prob" in MATRIX[7].worker_args()
    for bad in ("9", "x"):
        with pytest.raises(ValueError, match="--matrix"):
            parse_matrix(bad)


@pytest.mark.parametrize("bag, slots_left, drawn, left", [
    (["kill_heal_source", "hang", "kill"], 3, "kill_heal_source", ["kill_heal_source", "hang", "kill"]),
    (["kill_heal_source", "hang", "kill"], 2, "kill_heal_source", ["kill_heal_source", "hang", "kill"]),
    # the last slot: a heal fault could not have its provoking kill as well, so the next other kind goes first
    (["kill_heal_source", "kill_heal_receiver", "hang", "kill"], 1, "hang",
     ["hang", "kill_heal_source", "kill_heal_receiver", "kill"]),
    (["kill_heal_receiver", "kill_heal_source"], 1, "kill_heal_receiver", ["kill_heal_receiver", "kill_heal_source"]),
    (["lighthouse", "kill_heal_source"], 1, "lighthouse", ["lighthouse", "kill_heal_source"]),
])
def test_a_heal_fault_is_not_drawn_for_the_last_slot_when_another_kind_is_left(bag, slots_left, drawn, left):
    """Seed 20791 (cell c7): the second round's kill_heal_source, armed for the last slot of the budget, spent
    it on the kill that provoked its heal, which ended the faults phase and skipped it. The provoking kill
    now needs a slot beside the heal fault's, and the last slot goes to another kind when the round has one."""
    assert draw_kind(bag, slots_left) == drawn
    assert bag == left


@pytest.mark.parametrize("now, provoked_at, due", [
    (5.0, None, True),  # the first provoking kill: at once
    (10.0, 5.0, False),  # the heals that come anyway get a third of the wait first
    (24.9, 5.0, False),
    (25.0, 5.0, True),
])
def test_an_armed_heal_fault_provokes_its_heal_at_most_three_times_per_wait(now, provoked_at, due):
    """Seed 20799 (cell c7, worker faults): kill_heal_source killed a group four times in a row to provoke a
    heal. Each provoked heal came from the only group holding the latest step (a skipped vote left one group
    committing alone, gap 2), which cannot be faulted, and each kill kept a group down so that every heal was
    such a one. The budget ran out before the round's hang. Kills to provoke a heal are now a third of the
    heal wait apart (60 s here: 20 s), and the heals that come anyway are faulted in between."""
    assert provoke_due(now, provoked_at, heal_wait=60.0) is due


def test_ftl_chaos_matrix_list_prints_the_cells():
    proc = subprocess.run([sys.executable, "-m", "ft_core", "chaos", "--matrix", "list"], capture_output=True,
                          check=False, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert len([line for line in proc.stdout.splitlines() if line.startswith("c")]) == len(MATRIX) + 1  # + header


@pytest.mark.parametrize("kwargs, message", [
    ({"groups": 2}, "--groups must be >= 3"),
    ({"min_replicas": 3}, "--min-replicas"),
    ({"kinds": ("kill", "meteor")}, "unknown fault kinds ['meteor']"),
    ({"faults": -1}, "--faults"),
    ({"spares": True, "network": True}, "--spares does not combine with --network"),
])
def test_bad_chaos_settings_are_refused_with_the_fix(kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ChaosConfig(out=str(tmp_path), **kwargs)


# ------------------------------------------------------------------ real runs

def bounded_config(out: str, seed: int = 3) -> ChaosConfig:
    """Every kind of fault on 3 groups, tight timeouts, in the seed's matrix cell: about a minute on two
    busy cores (up to two in the 2-rank sync cells).

    8 faults: the first round of 5 kinds plus up to one kill per heal fault injected to provoke its heal.
    """
    return ChaosConfig(out=out, groups=3, faults=len(FAULT_KINDS) + 3, seed=seed, duration=230.0, min_replicas=2,
                       timeout=3.0, quorum_timeout=10.0, heartbeat_timeout_ms=2000, join_timeout_ms=1000,
                       interval=1.0, min_progress_steps=3, transport_delay_ms=300.0, transport_drop=0.1,
                       quiet_steps=10, heal_wait=60.0, stall=90.0)


def ci_seed() -> int:
    """FT_CHAOS_SEED, else the day number: successive days cycle through the matrix cells."""
    return int(os.environ.get("FT_CHAOS_SEED") or time.time() // 86400)


def run_report(cfg: ChaosConfig, summary: dict, command: str) -> str:
    """The seed, the cell, how to rerun it and the summary (without the config and fault list): a failure's message."""
    return f"seed {cfg.seed}, cell {cfg.cell.name} (rerun: {command} --seed {cfg.seed}):\n" + \
        json.dumps({k: v for k, v in summary.items() if k not in ("config", "faults")}, indent=1)[:6000]


def assert_trained_to_the_end(summary: dict, report: str) -> None:
    """The job reached its target with no divergence, wedge or hang; problems left (the callers let only
    under-replicated commits through) are the known gap, an xfail."""
    assert summary["max_step"] >= summary["target_step"] > 0, report
    assert summary["divergent_commits"] == 0 and summary["wedged_groups"] == 0 and summary["hangs"] == 0, report
    if summary["problems"]:  # only under-replicated commits (docs/chaos.md): a participant whose own vote fails
        # (a skipped optimizer.step) does not stop its peers' commit; the commit is per group. Never divergent:
        # the fork is healed by the newer one (recovery plan), checked above.
        pytest.xfail(f"known: a step committed by fewer than min_replicas groups; {report[:1500]}")


@pytest.mark.timeout(290)
def test_bounded_chaos_run_keeps_every_promise(tmp_path):
    cfg = bounded_config(str(tmp_path), ci_seed())
    summary = ChaosRun(cfg).run()
    report = run_report(cfg, summary, "ftl chaos")
    others = [p for p in summary["problems"] if not p.startswith(UNDER_REPLICATED)]
    assert not others, report
    assert summary["faults_injected"] == len(FAULT_KINDS) + 3, report
    assert set(summary["faults_by_kind"]) == set(FAULT_KINDS), report
    assert summary["lighthouse_starts"] >= 2, report
    assert summary["transfers"]["heals_loaded"] >= 1, report
    assert_trained_to_the_end(summary, report)


@pytest.mark.timeout(290)
def test_bounded_network_chaos_run_keeps_every_promise(tmp_path):
    """Each network fault once (a group's host cut off, two groups blocked from each other, a lighthouse's
    host cut off with a standby lighthouse), on simulated hosts, in the day's matrix cell: the same
    promises as above, and each fault's own (ft_core.tools.chaos_checks.network_fault_outcomes)."""
    reason = network_unavailable()
    if reason is not None:
        pytest.skip(reason)
    # the seed picks the order too (seed // 8 one of the 6, as seed % 8 the cell): a rerun with the same seed
    # injects the same order, and successive days' runs cover every order in every cell
    seed = ci_seed()
    order = network_order(seed)
    cfg = dataclasses.replace(bounded_config(str(tmp_path), seed), network=True, kinds=order, faults=len(order),
                              ordered=True)
    run = ChaosRun(cfg)
    summary = run.run()
    report = (f"order {', '.join(order)} (rerun: FT_CHAOS_SEED={seed} python -m pytest tests/chaos/test_chaos.py "
              f"-k network); " + run_report(cfg, summary, "ftl chaos --network"))
    assert not [name for name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                                timeout=20, check=False).stdout.split() if run.network.tag in name], report
    assert summary["divergent_commits"] == 0 and summary["wrong_reductions"] == 0, report
    outcomes = {o["kind"]: o for o in summary["network_faults"]}
    assert all(o.get("cut_commits", 0) == 0 and o.get("pair_commits", 0) == 0 for o in outcomes.values()), report
    others = [p for p in summary["problems"] if not p.startswith(UNDER_REPLICATED)]
    assert not others, report  # gap 4 (a group stranded on the other lighthouse) is fixed: no longer tolerated
    assert summary["faults_by_kind"] == {kind: 1 for kind in NETWORK_KINDS}, report
    assert [o["kind"] for o in summary["network_faults"]] == list(order), report
    assert outcomes["host_cut"]["rejoined"], report
    assert outcomes["host_cut"]["healed"], report  # the others went on while it was cut: it was behind
    assert outcomes["partition"]["pair_commits"] == 0 and outcomes["partition"]["rejoined"], report
    assert outcomes["lighthouse_cut"]["commits_after_failover"] > 0, report
    assert_trained_to_the_end(summary, report)



def test_the_network_run_injects_every_order_in_every_cell_over_48_successive_seeds():
    runs = {(cell_for(seed, tuple(range(len(MATRIX)))).index, network_order(seed)) for seed in range(20784, 20784 + 48)}
    assert len(runs) == len(MATRIX) * len(list(itertools.permutations(NETWORK_KINDS)))
    assert network_order(20788) == network_order(20788 + 8 * 6) != network_order(20788 + 8)


def test_simulated_hosts_leave_nothing_behind_also_when_making_them_fails():
    reason = network_unavailable()
    if reason is not None:
        pytest.skip(reason)
    with Namespaces(["a", "b"], subnet="10.214.0") as hosts:
        hosts.block(hosts["a"], hosts["b"])
        hosts.cut(hosts["b"])
    assert hosts.leftovers() == []
    tag = "f" + os.urandom(2).hex()
    with pytest.raises(NetnsError, match="addr add"):  # "10.214.255.25.2" is no address
        Namespaces(["a", "b"], subnet="10.214.255.25", tag=tag)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20, check=False).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=20, check=False).stdout
    assert tag not in listed and tag not in links


def test_network_kinds_need_the_network_flag(tmp_path):
    with pytest.raises(ValueError, match="need --network"):
        ChaosConfig(out=str(tmp_path), kinds=("kill", "host_cut"))


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
@pytest.mark.skipif(os.environ.get("FT_RUN_SLOW") != "1", reason="long chaos run: set FT_RUN_SLOW=1")
@pytest.mark.parametrize("seed", range(len(MATRIX)), ids=[c.name.split(":")[0] for c in MATRIX])
def test_long_chaos_run_of_200_faults(tmp_path, seed):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "ft_core", "chaos", "--groups", "3", "--faults", "200",
                           "--seed", str(seed), "--out", str(out)], capture_output=True, text=True,
                          timeout=4 * 3600, check=False)
    summary = json.loads((out / "summary.json").read_text())
    assert proc.returncode == 0 and summary["ok"], proc.stdout[-5000:]
    assert summary["faults_injected"] >= 200
