"""The Manager's events as console lines (ft_lightning/_events.py) and as per-group Prometheus metrics
(ft_core/metrics.py): rules as tables, then real groups killed and healed under `ftl launch`."""

from __future__ import annotations

import io
import logging
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from conftest import child_env, communicate_or_interrupt

from ft_core import metrics
from ft_core.errors import ConfigError
from ft_lightning._events import ConsoleEvents, EventLines, attach_console, describe

A, B = "0:aaaa", "1:bbbb"


@pytest.mark.parametrize("event, previous, line", [
    ({"type": "quorum", "quorum_id": 2, "replica_ids": [A, B], "num_participants": 2, "max_step": 7, "seconds": 0.25},
     None, "quorum 2: 2 participating of 2 group(s) [0, 1], max step 7, took 0.25 s"),
    ({"type": "quorum", "quorum_id": 3, "replica_ids": [A, B], "num_participants": 2, "max_step": 8, "seconds": 0.0},
     [A, B], None),  # same members: routine, no line
    ({"type": "quorum", "quorum_id": 3, "replica_ids": [A], "num_participants": 1, "max_step": 8, "seconds": 1.5},
     [A, B], "membership changed (lost 1): quorum 3: 1 participating of 1 group(s) [0], max step 8, took 1.50 s"),
    ({"type": "quorum", "quorum_id": 4, "replica_ids": [A, "1:cccc"], "num_participants": 1, "max_step": 9,
      "seconds": 0.1, "heal": True}, [A],
     "membership changed (joined 1): quorum 4: 1 participating of 2 group(s) [0, 1], max step 9, took 0.10 s; "
     "this group heals to step 9"),
    ({"type": "heal", "step": 9, "source_replica_rank": 0, "seconds": 0.5, "nbytes": 2_000_000}, [A, B],
     "healed from group 0 at step 9 in 0.50 s (2.0 MB, 4.0 MB/s)"),
    ({"type": "heal", "step": 9, "source_replica_rank": 4, "seconds": 0.0, "nbytes": 10}, None,
     "healed from replica rank 4 at step 9 in 0.00 s (10 B)"),
    ({"type": "error", "step": 5, "message": "ProcessGroupError: allreduce: connection closed by peer"}, [A, B],
     "step 5 failed, it will not commit: ProcessGroupError: allreduce: connection closed by peer"),
    ({"type": "commit", "step": 5, "committed": False, "num_participants": 1}, [A],
     "step 5 not committed (1 participating)"),
    ({"type": "commit", "step": 5, "committed": True, "num_participants": 2}, [A, B], None),
    # Gloo's boilerplate is cut down to what happened
    ({"type": "error", "step": 8, "message": "ProcessGroupError: ft-gloo allreduce (rank 0/2): RuntimeError: "
      "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
      "[127.0.0.1]:17314. This is typically caused by a remote worker crashing. Check the logs of the remote "
      "worker before reporting an error. GLHF! (the group must be reconfigured before the next collective)"}, [A, B],
     "step 8 failed, it will not commit: a peer's connection broke (Connection closed by peer [127.0.0.1]:17314)"),
    # Lightning's replica ids, and the step the heal brought (the Manager adopts it at commit)
    ({"type": "heal", "step": 0, "healed_step": 322, "source_replica_rank": 0, "seconds": 0.02, "nbytes": 1_000_000},
     ["replica_group_0:f1fd", "replica_group_1:8450"], "healed from group 0 at step 322 in 0.02 s (1.0 MB, 50.0 MB/s)"),
])
def test_each_event_is_one_line_or_none_when_routine(event, previous, line):
    assert describe(event, previous) == line


def test_a_failed_step_is_told_once_with_its_cause():
    lines = EventLines()
    told = [lines.line({"type": "error", "step": 3, "message": "boom"}),
            lines.line({"type": "commit", "step": 3, "committed": False, "num_participants": 1})]
    assert told == ["step 3 failed, it will not commit: boom", None]


def test_the_console_handler_shows_rank_zero_events_from_the_events_logger():
    out = io.StringIO()
    handler = ConsoleEvents(out)
    events = logging.getLogger("ft_core.events")
    events.addHandler(handler)
    level = events.level
    events.setLevel(logging.INFO)
    try:
        for rank in (0, 1):
            events.info("x", extra={"ft_event": {"type": "error", "step": 1, "message": "m", "group_rank": rank,
                                                 "replica_id": A}})
    finally:
        events.removeHandler(handler)
        events.setLevel(level)
    assert out.getvalue() == "ft: step 1 failed, it will not commit: m\n"
    before = (list(events.handlers), events.level, events.propagate)
    events.handlers[:] = [h for h in events.handlers if not isinstance(h, ConsoleEvents)]  # an earlier test's
    try:
        assert attach_console() is attach_console()  # idempotent
        assert sum(isinstance(h, ConsoleEvents) for h in events.handlers) == 1
    finally:  # leave the logger as other tests expect it
        events.handlers[:] = before[0]
        events.setLevel(before[1])
        events.propagate = before[2]


def test_metrics_follow_the_events_and_are_served_on_metrics():
    with metrics.MetricsServer("127.0.0.1:0") as server:
        events = logging.getLogger("ft_core.events")
        for event in ({"type": "quorum", "num_participants": 2, "quorum_id": 4, "seconds": 0.02, "step": 6},
                      {"type": "heal", "seconds": 0.5, "nbytes": 1234, "step": 6},
                      {"type": "commit", "committed": True, "step": 6},
                      {"type": "commit", "committed": False, "step": 7}):
            events.info("x", extra={"ft_event": {**event, "replica_id": A, "group_rank": 0}})
        text = urllib.request.urlopen(server.url(), timeout=10).read().decode()
    for expected in ('ftl_group_participants{replica_id="0:aaaa"} 2.0', 'ftl_group_heals_total{replica_id="0:aaaa"} 1.0',
                     'ftl_group_heal_bytes_total{replica_id="0:aaaa"} 1234.0',
                     'ftl_group_commits_total{replica_id="0:aaaa"} 1.0',
                     'ftl_group_commit_failures_total{replica_id="0:aaaa"} 1.0',
                     'ftl_group_step{replica_id="0:aaaa"} 7.0',
                     'ftl_group_quorum_latency_seconds_count{replica_id="0:aaaa"} 1.0'):
        assert expected in text, text


@pytest.mark.parametrize("port, message", [("99999", "outside 0-65535"), ("http", "not a valid integer")])
def test_a_bad_metrics_port_is_refused_with_the_variable_named(port, message):
    with pytest.raises(ConfigError, match="FT_METRICS_PORT") as exc:
        metrics.start_from_settings(environ={"FT_METRICS_PORT": port})
    assert message in str(exc.value)


# A real job: each group shows its events on its console and serves its metrics; at the end it prints them.
TRAINER = textwrap.dedent("""
    import os, signal, sys, time, urllib.request
    from datetime import timedelta
    import torch
    from ft_core import Manager, metrics
    from ft_core.process_groups import ProcessGroupGloo
    from ft_lightning._events import attach_console

    torch.set_num_threads(1)
    torch.manual_seed(0)
    attach_console(sys.stdout)
    server = metrics.start_from_settings()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=4)), load_state_dict=model.load_state_dict,
                      state_dict=model.state_dict, timeout=timedelta(seconds=4),
                      connect_timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=20))
    x = torch.randn(16, 8)
    crash_at_step = os.environ["REPLICA_GROUP_ID"] == "0" and os.environ["FT_RESTART_COUNT"] == "0"
    while manager.current_step() < int(sys.argv[1]):
        manager.start_quorum()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        for p in model.parameters():
            manager.allreduce(p.grad).wait()
        if manager.should_commit():
            opt.step()
        if crash_at_step and manager.num_participants() == 2 and manager.current_step() >= 20:
            os.kill(os.getpid(), signal.SIGKILL)  # group 0's first incarnation dies mid-run, as a machine would
        # alone after step 20 (group 0 died): slower, so its restart (imports on a busy machine) rejoins in time
        time.sleep(float(sys.argv[2]) * (6 if manager.num_participants() == 1 and manager.current_step() > 20 else 1))
    for line in urllib.request.urlopen(server.url(), timeout=10).read().decode().splitlines():
        if line.startswith("ftl_group_") and "_bucket" not in line:
            print("metric", line, flush=True)
    manager.shutdown()
    server.shutdown()
""")


@pytest.mark.timeout(100)
def test_a_killed_group_is_told_as_lost_and_healed_and_counted_in_its_metrics(tmp_path, processes):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    launch = processes.spawn([sys.executable, "-m", "ft_core.tools.cli", "launch", "--groups", "2",
                              "--restart-delay", "0",
                              "--", str(script), "200", "0.05"],
                             env=child_env(FT_METRICS_PORT="0"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = communicate_or_interrupt(launch, 90)
    assert launch.returncode == 0, out[-4000:]
    victim, survivor = "0", "1"
    lines = out.splitlines()
    assert any(line.startswith(f"[g{survivor}] ft: membership changed (lost {victim})") for line in lines), out[-4000:]
    assert any(line.startswith(f"[g{survivor}] ft: membership changed (joined {victim})") for line in lines), out[-4000:]
    killed_at = next(i for i, line in enumerate(lines) if f"group {victim} died: killed by SIGKILL" in line)
    restarted = lines[killed_at:]  # the old incarnation's output is drained before the kill is reported
    healed = [line for line in restarted if line.startswith(f"[g{victim}] ft: healed from group {survivor} at step ")]
    assert len(healed) == 1 and " B" in healed[0] and "/s)" in healed[0], out[-4000:]
    assert int(healed[0].split(" at step ")[1].split()[0]) > 0, healed  # the step it healed to, not 0
    def metric(group: str, name: str) -> float:
        found = [line for line in lines if line.startswith(f"[g{group}] metric {name}{{")]
        assert len(found) == 1, (name, out[-4000:])
        return float(found[0].rsplit(" ", 1)[1])
    assert metric(victim, "ftl_group_heals_total") >= 1.0 and metric(victim, "ftl_group_heal_bytes_total") > 0
    told = [line for line in lines if line.startswith(f"[g{survivor}] ft: healed from")]
    assert metric(survivor, "ftl_group_heals_total") == len(told)  # at most its start-up copy of the weights
    assert metric(survivor, "ftl_group_commits_total") >= 100 and metric(survivor, "ftl_group_step") == 200
    assert metric(survivor, "ftl_group_participants") == 2.0
    assert metric(survivor, "ftl_group_quorum_latency_seconds_count") >= 100
