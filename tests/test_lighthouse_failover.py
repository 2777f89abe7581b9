"""Lighthouse failover with real processes: two `ftl lighthouse` processes (active + standby), two
replica groups of ft_core.tools.chaos_worker given both addresses. SIGKILL the active lighthouse: no
committed step is lost, quorum ids never go backward, training resumes within 2x heartbeat timeout."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from datetime import timedelta

import pytest
from conftest import assert_bounded, child_env, run_calls

from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.lighthouse_calls import Waiter
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.lighthouse_state import LighthouseConfig, LighthouseCore
from ft_core.control.lighthouse_peers import PeerState, PeerView, choose_active, redirect_message, redirect_target
from ft_core.control.types import Quorum, QuorumMember
from ft_core.errors import ConfigError
from ft_core.tools.chaos_checks import check_digests, check_monotonic, read_run
from ft_core.tools.launcher import free_port
from ft_core.tools.status import fetch_status, peers_line

HEARTBEAT_TIMEOUT_S = 3.0


TOKEN = "failover-secret"


def start_lighthouse(processes, port: int, log, *peers: str) -> object:
    return processes.python("-m", "ft_core", "lighthouse", "--bind", f"127.0.0.1:{port}", "--http-bind", "off",
                            "--min-replicas", "2", "--join-timeout-ms", "1000",
                            "--heartbeat-timeout-ms", str(int(HEARTBEAT_TIMEOUT_S * 1000)),
                            *(["--peers", ",".join(peers)] if peers else []),
                            env=child_env(FT_TOKEN=TOKEN), stdout=log, stderr=log)


def wait_listening(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"lighthouse on port {port} did not listen within {timeout}s")


def steps(out: str) -> dict[str, list[dict]]:
    return {inc.group: inc.steps for inc in read_run(out)}


def wait_for(predicate, timeout: float, what: str, out: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    last = {g: (rows[-1]["step"] if rows else None) for g, rows in steps(out).items()}
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last steps {last}")


@pytest.mark.timeout(180)
def test_killing_the_active_lighthouse_fails_over_to_the_standby(processes, tmp_path):
    out = str(tmp_path)
    ports = [free_port(), free_port()]
    log = open(tmp_path / "lighthouses.log", "wb")
    active = start_lighthouse(processes, ports[0], log)
    start_lighthouse(processes, ports[1], log)
    for port in ports:
        wait_listening(port, 60)
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    workers = []
    for group in range(2):
        env = child_env(FT_LIGHTHOUSE=addresses, REPLICA_GROUP_ID=str(group), FT_RESTART_COUNT="0", FT_TOKEN=TOKEN)
        with open(tmp_path / f"worker{group}.log", "wb") as wlog:
            workers.append(processes.python("-m", "ft_core.tools.chaos_worker", "--out", out, "--min-replicas", "2",
                                            "--timeout", "5", "--quorum-timeout", "30", "--step-sleep", "0.05",
                                            env=env, stdout=wlog, stderr=wlog))
    wait_for(lambda: len(steps(out)) == 2 and all(len(rows) >= 10 for rows in steps(out).values()), 120,
             "both groups to commit 10 steps", out)

    active.kill()  # SIGKILL: no goodbye to anyone
    active.wait(timeout=10)
    killed_at = time.time()
    before = {g: rows[-1]["step"] for g, rows in steps(out).items()}
    wait_for(lambda: all(rows[-1]["step"] >= before[g] + 10 for g, rows in steps(out).items()), 90,
             "both groups to commit 10 more steps through the standby", out)

    with open(os.path.join(out, "exit"), "w") as f:
        f.write(str(max(rows[-1]["step"] for rows in steps(out).values()) + 5))
    for proc in workers:
        assert proc.wait(timeout=60) == 0
    incarnations = read_run(out)
    assert check_digests(incarnations) == []
    assert check_monotonic(incarnations) == []  # steps strictly increase, quorum ids never go back
    for inc in incarnations:
        numbers = [r["step"] for r in inc.steps]
        assert numbers == list(range(1, len(numbers) + 1)), f"group {inc.group} lost or skipped a step: {numbers}"
        resumed = min(r["time"] for r in inc.steps if r["time"] > killed_at)
        last_before = max(r["time"] for r in inc.steps if r["time"] <= killed_at)
        assert resumed - last_before < 2 * HEARTBEAT_TIMEOUT_S, (
            f"group {inc.group}: no commit for {resumed - last_before:.2f}s across the failover "
            f"(bound {2 * HEARTBEAT_TIMEOUT_S}s)")
        ids = inc.quorum_ids()
        assert ids and ids[-1] > ids[0], f"group {inc.group}: the standby did not issue a newer quorum id: {ids}"


# ------------------------------------------------------------------ lighthouses that know each other (gap 4)

def state(name: str, live: int, step: int, standing_by_for: str = "") -> PeerState:
    return PeerState(lighthouse_id=name, address=name, live_members=live, max_step=step, quorum_id=1,
                     standing_by_for=standing_by_for)


NOW = 100.0
STALE_S = 2.5


# (own state, own position, peers as (state or None, position, answer age s, problem), expected: the peer to
# stand by for, or None to serve)
RULE_ROWS = [
    ("no peer answers: serve", state("a", 0, 0), 0, [(None, 1, None, "UNAVAILABLE")], None),
    ("the peer has no live members: serve", state("a", 0, 0), 0, [(state("b", 0, 0), 1, 0.1, "")], None),
    ("no members here, the standby holds the job: stand by for it", state("a", 0, 0), 0,
     [(state("b", 2, 5), 1, 0.1, "")], "b"),
    ("a lone member at step 0 here, the standby holds step 40: stand by", state("a", 1, 0), 0,
     [(state("b", 2, 40), 1, 0.1, "")], "b"),
    ("split: the higher step serves, whatever the position", state("b", 2, 9), 1,
     [(state("a", 3, 7), 0, 0.1, "")], None),
    ("split: the lower step stands by", state("a", 3, 7), 0, [(state("b", 2, 9), 1, 0.1, "")], "b"),
    ("split at the same step: more live members serve", state("a", 1, 9), 0, [(state("b", 2, 9), 1, 0.1, "")], "b"),
    ("split at the same step and size: the first in the list serves", state("a", 2, 9), 0,
     [(state("b", 2, 9), 1, 0.1, "")], None),
    ("... and the second stands by", state("b", 2, 9), 1, [(state("a", 2, 9), 0, 0.1, "")], "a"),
    ("a stale answer counts as no answer", state("a", 0, 0), 0, [(state("b", 2, 5), 1, STALE_S + 1, "")], None),
    ("a peer that stopped answering is no candidate", state("a", 0, 0), 0,
     [(state("b", 2, 5), 1, 0.1, "DEADLINE_EXCEEDED")], None),
    ("a peer standing by itself is no candidate", state("a", 0, 0), 0, [(state("b", 2, 5, "c"), 1, 0.1, "")], None),
    ("this lighthouse's own entry is skipped", state("a", 0, 0), 0, [(state("a", 0, 0), 0, 0.1, "")], None),
    ("three lighthouses: the best candidate", state("a", 0, 0), 0,
     [(state("b", 1, 5), 1, 0.1, ""), (state("c", 2, 5), 2, 0.1, "")], "c"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("own,position,peers,expected", [r[1:] for r in RULE_ROWS], ids=[r[0] for r in RULE_ROWS])
def test_the_lighthouse_that_serves_holds_the_highest_step_then_most_members_then_comes_first(own, position, peers,
                                                                                             expected):
    views = [PeerView(s.address if s else f"peer{pos}", pos, s, NOW - (age or 0.0), problem)
             for s, pos, age, problem in peers]
    chosen = choose_active(own, position, views, NOW, STALE_S)
    assert (chosen.address if chosen else None) == expected


@pytest.mark.timeout(10)
def test_a_standby_that_takes_over_waits_a_heartbeat_timeout_before_a_restarted_group_goes_on():
    """Quorum rule 12 counts from when a lighthouse began to serve the job, not from its start: a standby that ran
    long but took over a moment ago has not heard the job's members either, so a restarted group alone waits."""
    core = LighthouseCore(LighthouseConfig(min_replicas=1, heartbeat_timeout_ms=400, http_bind=None,
                                           peers=("127.0.0.1:1", "127.0.0.1:2")))
    core.set_peer_picture(PeerView("127.0.0.1:1", 0, state("primary", 2, 40)), "stand by", [])
    time.sleep(0.5)  # this lighthouse is older than its heartbeat timeout
    core.set_peer_picture(None, "", [])  # the primary is gone: this one serves the job from now on
    restarted = Waiter(QuorumMember("g1:b", restarted=True), lambda: None)
    core.join(restarted)
    assert restarted.issued is None
    assert "g1:b restarted and no participant reports a last quorum" in core.status()["reason"]
    time.sleep(0.45)
    core.heartbeat("g1:b")  # alive all along (its heartbeat stream)
    core.tick()
    assert restarted.issued is not None and restarted.issued.quorum.replica_ids == ["g1:b"]


@pytest.mark.timeout(10)
def test_a_standing_by_answer_names_the_active_lighthouse_and_the_client_reads_it_back():
    active = PeerView("[::1]:29510", 1, state("b", 2, 40))
    message = redirect_message("127.0.0.1:1234", active)
    assert "2 live member(s) at step 40" in message
    assert redirect_target(f"LighthouseService.Quorum to x failed: peer unavailable (lighthouse Quorum: {message})") \
        == "[::1]:29510"
    assert redirect_target("lighthouse shutting down") is None


class Relay:
    """A TCP relay from a free loopback port to `target_port`, cut or open: while cut it closes every
    connection it gets, and cutting it closes the open ones (the lighthouses behind it cannot reach each other)."""

    def __init__(self, target_port: int) -> None:
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.cut = True
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, name="test-relay-accept")]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.cut:
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target), timeout=5)
            except OSError:  # the lighthouse behind it is gone (the test is ending)
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                thread = threading.Thread(target=self._pipe, args=(a, b), name="test-relay-pipe")
                self._threads.append(thread)
                thread.start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(None)
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def set_cut(self, cut: bool) -> None:
        self.cut = cut
        if cut:
            with self._lock:
                open_, self._open = self._open, []
            for sock in open_:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.set_cut(True)
        for thread in self._threads:
            thread.join(5)
        self._listener.close()
        with self._lock:
            for sock in self._open:
                sock.close()


def wait_until(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.mark.timeout(60)
def test_when_the_lighthouses_find_each_other_after_a_split_the_one_behind_sends_its_members_to_the_other():
    ports = [free_port(), free_port()]
    addr = [f"127.0.0.1:{p}" for p in ports]
    to_a, to_b = Relay(ports[0]), Relay(ports[1])  # each lighthouse dials the other through a relay, cut at first
    common = {"min_replicas": 1, "join_timeout_ms": 300, "heartbeat_timeout_ms": 2000, "http_bind": None}
    clients = []
    try:
        with LighthouseServer(bind=addr[0], peers=[addr[0], to_b.address], **common) as a, \
                LighthouseServer(bind=addr[1], peers=[to_a.address, addr[1]], **common) as b:
            # The split: they cannot see each other, so each serves the groups that came to it.
            behind = LighthouseClient([addr[0], addr[1]], connect_timeout=10)
            ahead = LighthouseClient([addr[1], addr[0]], connect_timeout=10)
            clients += [behind, ahead]
            behind.start_heartbeat_stream("behind").wait_connected(10)
            ahead.start_heartbeat_stream("ahead").wait_connected(10)
            assert behind.quorum(QuorumMember("behind", step=3), timeout=timedelta(seconds=10)).replica_ids == \
                ["behind"]
            assert ahead.quorum(QuorumMember("ahead", step=9), timeout=timedelta(seconds=10)).replica_ids == ["ahead"]
            assert a.core.status()["standing_by_for"] == "" and b.core.status()["standing_by_for"] == ""
            issued_by_a = a.core.status()["quorums_issued"]

            to_a.set_cut(False)
            to_b.set_cut(False)
            started = time.monotonic()
            wait_until(lambda: a.core.status()["standing_by_for"] == to_b.address, 10, "A to stand by for B")
            assert_bounded(started, 3 * 0.5 + 1.0, "standing by after the lighthouses found each other")
            assert b.core.status()["standing_by_for"] == "", "B, which holds step 9, must go on serving"
            # A turned its member away at once (its stream ended); both groups now form one quorum on B.
            assert not [m for m in a.core.status()["members"] if m["healthy"]], a.core.status()
            def ahead_joins_once_behind_waits_on_b() -> Quorum:
                wait_until(lambda: any(m["replica_id"] == "behind" and m["waiting"] for m in b.core.status()["members"]),
                           15, "the turned-away member to join on B")
                return ahead.quorum(QuorumMember("ahead", step=9), timeout=timedelta(seconds=15))

            answers = run_calls([lambda: behind.quorum(QuorumMember("behind", step=3), timeout=timedelta(seconds=15)),
                                 ahead_joins_once_behind_waits_on_b])
            for answer, _ in answers:
                assert not isinstance(answer, Exception), answer
                assert answer.replica_ids == ["ahead", "behind"]
            assert a.core.status()["quorums_issued"] == issued_by_a, "the standing-by lighthouse issued a quorum"
            wait_until(lambda: any(m["replica_id"] == "behind" and m["stream"] for m in b.core.status()["members"]),
                       15, "the turned-away member's heartbeat stream to reach B")
            def peers_of_a() -> dict:
                return {p["address"]: p for p in a.core.status()["peers"]}

            wait_until(lambda: peers_of_a()[to_b.address]["live_members"] == 2, 10, "A to see both members on B")
            assert peers_of_a()[addr[0]]["self"] and not peers_of_a()[to_b.address]["self"], peers_of_a()
    finally:
        for client in clients:
            client.close()
        to_a.close()
        to_b.close()


@pytest.mark.timeout(60)
def test_a_restarted_primary_stands_by_and_a_new_member_reaches_the_standby_within_a_bounded_time():
    ports = [free_port(), free_port()]
    addr = [f"127.0.0.1:{p}" for p in ports]
    common = {"min_replicas": 1, "join_timeout_ms": 300, "heartbeat_timeout_ms": 2000, "peers": addr}
    with LighthouseServer(bind=addr[1], **common) as standby, \
            LighthouseClient(addr, connect_timeout=10) as first, LighthouseClient(addr, connect_timeout=10) as late:
        first.start_heartbeat_stream("first").wait_connected(10)
        assert first.quorum(QuorumMember("first", step=4), timeout=timedelta(seconds=15)).replica_ids == ["first"]
        with LighthouseServer(bind=addr[0], **common) as primary:
            wait_until(lambda: primary.core.status()["standing_by_for"] == addr[1], 10, "the primary to stand by")
            assert "standing by" in primary.core.quorum_status()
            wait_until(lambda: "1 live at step 4" in (peers_line(fetch_status(primary.http_address())) or ""), 10,
                       "`ftl status` of the primary to show the standby's member")
            shown = peers_line(fetch_status(primary.http_address()))
            assert shown.startswith(f"lighthouses: standing by for {addr[1]}") and f"{addr[0]} (this one)" in shown
            started = time.monotonic()

            def first_joins_once_late_waits_on_the_standby() -> Quorum:
                wait_until(lambda: any(m["replica_id"] == "late" and m["waiting"]
                                       for m in standby.core.status()["members"]), 15, "the late member on the standby")
                assert_bounded(started, 2.0, "the late member's join, redirected to the standby")
                return first.quorum(QuorumMember("first", step=4), timeout=timedelta(seconds=15))

            answers = run_calls([lambda: late.quorum(QuorumMember("late", step=0), timeout=timedelta(seconds=15)),
                                 first_joins_once_late_waits_on_the_standby])
            for answer, _ in answers:
                assert not isinstance(answer, Exception), answer
                assert answer.replica_ids == ["first", "late"]
            assert late.addresses[late._preferred] == addr[1], "the client did not follow the redirect"
            assert primary.core.status()["quorums_issued"] == 0
            assert standby.core.status()["standing_by_for"] == ""


def start_worker(processes, out: str, addresses: str, group: int, log_path) -> object:
    env = child_env(FT_LIGHTHOUSE=addresses, REPLICA_GROUP_ID=str(group), FT_RESTART_COUNT="0", FT_TOKEN=TOKEN)
    with open(log_path, "wb") as wlog:
        return processes.python("-m", "ft_core.tools.chaos_worker", "--out", out, "--min-replicas", "2",
                                "--timeout", "5", "--quorum-timeout", "30", "--step-sleep", "0.05",
                                env=env, stdout=wlog, stderr=wlog)


@pytest.mark.timeout(170)
def test_a_primary_that_hung_and_came_back_stands_by_so_the_job_stays_whole_on_the_standby(processes, tmp_path):
    """The chaos run's gap 4 with real processes: the primary stops answering (SIGSTOP, as a cut host), the
    groups fail over to the standby; when the primary is back it stands by, and a group started now (which
    asks the primary first) joins the job on the standby: one history, every step on every group."""
    out = str(tmp_path)
    ports = [free_port(), free_port()]
    addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
    log = open(tmp_path / "lighthouses.log", "wb")  # noqa: SIM115 - the lighthouses' output, read at the end
    primary = start_lighthouse(processes, ports[0], log, addresses)
    start_lighthouse(processes, ports[1], log, addresses)
    for port in ports:
        wait_listening(port, 60)
    workers = [start_worker(processes, out, addresses, g, tmp_path / f"worker{g}.log") for g in range(2)]
    wait_for(lambda: len(steps(out)) == 2 and all(len(rows) >= 5 for rows in steps(out).values()), 120,
             "both groups to commit 5 steps on the primary", out)

    os.kill(primary.pid, signal.SIGSTOP)  # hung: connections stay open, nothing answers
    try:
        before = {g: rows[-1]["step"] for g, rows in steps(out).items()}
        wait_for(lambda: all(rows[-1]["step"] >= before[g] + 5 for g, rows in steps(out).items()), 60,
                 "both groups to commit 5 more steps through the standby", out)
    finally:
        os.kill(primary.pid, signal.SIGCONT)
    workers.append(start_worker(processes, out, addresses, 2, tmp_path / "worker2.log"))
    wait_for(lambda: len(steps(out)) == 3 and len(steps(out)["2"]) >= 3, 90,
             "the group started after the primary came back to commit 3 steps", out)

    with open(os.path.join(out, "exit"), "w") as f:
        f.write(str(max(rows[-1]["step"] for rows in steps(out).values()) + 5))
    for proc in workers:
        assert proc.wait(timeout=60) == 0
    incarnations = read_run(out)
    assert check_digests(incarnations) == []  # one history: the same weights at every step on every group
    assert check_monotonic(incarnations) == []
    assert primary.poll() is None, "the primary lighthouse died"
    log.flush()
    text = (tmp_path / "lighthouses.log").read_text(errors="replace")
    assert f"stands by for 127.0.0.1:{ports[1]}" in text, "the primary never said it stands by for the standby"


@pytest.mark.timeout(30)
def test_a_bad_peer_address_is_refused_with_the_fix(processes):
    with pytest.raises(ConfigError, match=r"'nowhere' has no port.*FT_LIGHTHOUSE"):
        LighthouseServer(peers="127.0.0.1:1,nowhere", http_bind=None)
    started = time.monotonic()
    cli = processes.python("-m", "ft_core", "lighthouse", "--bind", "127.0.0.1:0", "--http-bind", "off",
                           "--peers", "127.0.0.1:1,10.0.0.1:99999", stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    output = cli.communicate(timeout=25)[0]
    assert_bounded(started, 10.0, "ftl lighthouse refusing a bad --peers")
    assert cli.returncode == 2 and "10.0.0.1:99999" in output and "outside 0-65535" in output, output


@pytest.mark.timeout(30)
def test_a_peer_with_another_token_is_no_candidate_and_the_refusal_is_reported(caplog):
    ports = [free_port(), free_port()]
    addr = [f"127.0.0.1:{p}" for p in ports]
    with LighthouseServer(bind=addr[1], token="theirs", http_bind=None) as other, \
            LighthouseClient(addr[1], token="theirs", connect_timeout=10) as member:
        member.quorum(QuorumMember("m", step=5), timeout=timedelta(seconds=10))  # it holds a live member
        with caplog.at_level(logging.WARNING, logger="ft_core.control.lighthouse"), \
                LighthouseServer(bind=addr[0], token="ours", http_bind=None, peers=addr) as ours:
            # The refusal is logged as the peer answers; the status shows it once that round of asks ends.
            wait_until(lambda: "refused the Peer call" in caplog.text
                       and any(p["address"] == addr[1] for p in ours.core.status()["peers"]),
                       10, "the refusal to be logged and shown in the status")
            peers = {p["address"]: p for p in ours.core.status()["peers"]}
            assert "UNAUTHENTICATED" in peers[addr[1]]["problem"] and not peers[addr[1]]["reachable"], peers
            assert ours.core.status()["standing_by_for"] == "", "a peer it cannot authenticate to must not win"
        assert other.core.status()["members"]


@pytest.mark.timeout(60)
def test_a_redo_quorum_of_the_same_members_gets_a_fresh_id_so_every_member_rebuilds_its_process_group():
    """What the simulated-hosts test below found: group 1 came back from a 4 s cut in time to join the
    step's quorum (the same members, the same id), then group 0, told of the loss, redid the step. Its
    redo quorum (shrink only) met group 1's quorum call for the same step and kept the id, so group 0
    rebuilt its process group under the store prefix of that id's first build, read group 1's stale
    address there and connected to it for 50 s, while group 1, seeing an unchanged id, did not rebuild at
    all. A member that must rebuild asks for it: the quorum gets a fresh id, and every member rebuilds."""
    from ft_core.control.manager_server import ManagerServer

    timeout = timedelta(seconds=20)
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=60_000, heartbeat_timeout_ms=30_000,
                          http_bind=None) as lighthouse, \
            ManagerServer("0:a", lighthouse.address()) as group0, ManagerServer("1:b", lighthouse.address()) as group1:
        assert group0.wait_heartbeat_connected(10) and group1.wait_heartbeat_connected(10)
        first = [r for r, _ in run_calls([lambda: group0.quorum_local(0, 7, "", False, timeout),
                                          lambda: group1.quorum_local(0, 7, "", False, timeout)])]
        assert all(not isinstance(r, Exception) for r in first), first
        assert first[0].quorum_id == first[1].quorum_id > 0, first

        # The same step again: group 0 redoes it (shrink only, its process group broken, no failure counted
        # yet), group 1 asks as usual; the membership is unchanged.
        again = [r for r, _ in run_calls([lambda: group0.quorum_local(0, 7, "", True, timeout, rebuild=True),
                                          lambda: group1.quorum_local(0, 7, "", False, timeout)])]
        assert all(not isinstance(r, Exception) for r in again), again
        assert again[0].quorum_id == again[1].quorum_id > first[0].quorum_id, (first, again)
        assert sorted(again[0].replica_ids) == ["0:a", "1:b"], again

        # A member that needs no rebuild keeps the id, as before.
        same = [r for r, _ in run_calls([lambda: group0.quorum_local(0, 8, "", False, timeout),
                                         lambda: group1.quorum_local(0, 8, "", False, timeout)])]
        assert [r.quorum_id for r in same] == [again[0].quorum_id] * 2, (again, same)


@pytest.mark.timeout(115)
def test_on_simulated_hosts_a_group_cut_off_after_a_lighthouse_failover_rejoins_the_job(simulated_hosts, tmp_path):
    """docs/chaos.md gap 4 as the network chaos run found it: the primary's host is cut, the groups go on
    through the standby, the primary's link comes back; then group 1's host is cut, and when it comes back
    its client reaches the primary first. The primary stands by, so group 1 rejoins the job on the standby."""
    from ft_harness import check_step_digests, stop_all
    from ft_harness import wait_until as wait_groups
    from test_multihost import final_digests, only_readme_env, train_group

    hosts = simulated_hosts(4)
    lighthouse_hosts = (hosts[0], hosts[3])
    addresses = [f"{h.address}:{hosts.free_port(h)}" for h in lighthouse_hosts]
    both = ",".join(addresses)
    logs = [tmp_path / "primary.log", tmp_path / "standby.log"]
    for host, address, log in zip(lighthouse_hosts, addresses, logs):
        with open(log, "ab") as out:
            hosts.python(host, "-m", "ft_core", "lighthouse", "--bind", address, "--http-bind", "off",
                         "--min-replicas", "2", "--join-timeout-ms", "2000", "--heartbeat-timeout-ms", "2000",
                         "--peers", both, env=only_readme_env(), stdout=out, stderr=subprocess.STDOUT)
    groups = [train_group(hosts, hosts[1 + g], str(tmp_path), g, both) for g in (0, 1)]
    for g in groups:
        g.start()
    wait_groups(lambda: all(len(g.commits()) >= 5 for g in groups), 60, "both groups to commit 5 steps", groups)

    hosts.cut(hosts[0])
    before = {g.group_id: g.last_step() for g in groups}
    wait_groups(lambda: all(g.last_step() >= before[g.group_id] + 5 for g in groups), 40,
                "both groups to commit 5 more steps through the standby", groups)
    hosts.restore(hosts[0])
    wait_groups(lambda: f"stands by for {addresses[1]}" in logs[0].read_text(errors="replace"), 20,
                "the primary, back on the network, to stand by for the standby", groups)

    hosts.cut(hosts[2])  # group 1's own host: its client fails over, and reaches the primary first on return
    time.sleep(4.0)  # past the heartbeat timeout: the standby drops group 1
    hosts.restore(hosts[2])
    back = groups[1].last_step()
    wait_groups(lambda: groups[1].last_step() >= back + 5, 60, "group 1 to rejoin the job and commit 5 steps",
                groups)
    stop_all(groups)
    check_step_digests(groups)
    assert len(final_digests(groups)) == 1
