"""What a user meets when something is wrong, through the real `ftl` command: one or two clear lines,
no traceback, in seconds; and `ftl status` output that tells the whole truth when piped."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from conftest import child_env

from ft_core.control.lighthouse import LighthouseServer
from ft_core.control.lighthouse_client import LighthouseClient
from ft_core.control.types import QuorumMember
from ft_core.errors import ConfigError, RPCError
from ft_core.net import check_reachable
from ft_core.tools.status import member_state


def ftl(*args: str, env: dict[str, str] | None = None, timeout: float = 30, prefix: list[str] | None = None
        ) -> tuple[int, str, str, float]:
    started = time.monotonic()
    proc = subprocess.run([*(prefix or []), sys.executable, "-m", "ft_core.tools.cli", *args], env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started


def assert_short_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert 1 <= len(lines) <= 2, f"expected one or two lines, got:\n{err}"
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err


def closed_port() -> int:
    """A loopback port nobody listens on (the OS just handed it out and it was closed again)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(30)
def test_status_with_a_garbage_address_says_so_once():
    code, _, err, _ = ftl("status", "--lighthouse", "garbage")
    assert code == 1
    assert_short_error(err, "ftl status: error: lighthouse address 'garbage' has no port")
    assert "ftl status: ftl status:" not in err


@pytest.mark.timeout(30)
def test_lighthouse_bind_port_out_of_range_is_refused():
    code, _, err, _ = ftl("lighthouse", "--bind", "127.0.0.1:99999", "--http-bind", "off")
    assert code == 2
    assert_short_error(err, "99999", "outside 0-65535")


@pytest.mark.timeout(30)
@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux) for a private network")
@pytest.mark.parametrize("token, warned", [(None, True), ("s3cret", False)])
def test_a_lighthouse_listening_beyond_loopback_without_a_token_warns(token, warned):
    # In a network namespace of its own (only loopback inside), so the wildcard bind reaches nothing outside.
    if subprocess.run(["unshare", "-rn", "true"], capture_output=True).returncode != 0:
        pytest.skip("unprivileged user and network namespaces are not available here")
    env = child_env()
    env.pop("FT_TOKEN", None)
    if token:
        env["FT_TOKEN"] = token
    proc = subprocess.Popen(["unshare", "-rn", sys.executable, "-m", "ft_core.tools.cli", "lighthouse", "--bind",
                             "0.0.0.0:0", "--http-bind", "off"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), name="test-lighthouse-output", daemon=True)
        reader.start()
        deadline = time.monotonic() + 20
        while not any("Ctrl-C to stop" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any("Ctrl-C to stop" in line for line in lines), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        reader.join(5)
    said = "".join(lines)
    assert ("with no token" in said) == warned, said
    if warned:
        assert "0.0.0.0:0" in said and "set --token or FT_TOKEN" in said


@pytest.mark.timeout(30)
def test_accelerate_commands_without_accelerate_installed_name_the_package():
    code = ("import sys; sys.modules['accelerate'] = None; from ft_core.tools.cli import main; "
            "sys.exit(main(['accelerate', 'launch', '--help']))")
    proc = subprocess.run([sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert_short_error(proc.stderr, "'accelerate'", "pip install accelerate")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("address, needle", [("not-an-address", "has no port"), ("127.0.0.1:99999", "outside 0-65535"),
                                             ("127.0.0.1:0", "has port 0")])
def test_launch_checks_the_lighthouse_address_at_start(tmp_path, address, needle):
    script = tmp_path / "train.py"
    script.write_text("import time; time.sleep(60)\n")
    code, out, err, _ = ftl("launch", "--groups", "1", "--lighthouse", address, "--", str(script))
    assert code == 2, out + err
    assert_short_error(err, "ftl launch: error: ", needle)
    assert "group 0 started" not in out


@pytest.mark.timeout(30)
def test_launch_reports_an_unreachable_lighthouse_in_seconds(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import time; time.sleep(60)\n")
    port = closed_port()
    code, out, err, _ = ftl("launch", "--groups", "1", "--lighthouse", f"127.0.0.1:{port}", "--", str(script))
    assert code == 1
    assert f"cannot reach the lighthouse (127.0.0.1:{port}: Connection refused)" in out + err
    assert "group 0 started" not in out and "Traceback" not in out + err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("variable, value, choices", [("FT_BACKEND", "mpi", "auto|gloo|nccl"),
                                                      ("FT_WORLD_SIZE_MODE", "static", "dynamic|fixed_with_spares")])
def test_an_enumerated_setting_lists_its_valid_values(tmp_path, variable, value, choices):
    pytest.importorskip("accelerate")
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    code, out, err, _ = ftl("accelerate", "launch", "--cpu", str(script), env=child_env(**{variable: value}))
    assert code == 2 and "never runs" not in out
    assert_short_error(err, variable, repr(value), choices)
    # The engine says the same to a script that builds a Manager itself.
    probe = ("import sys; from ft_core import settings; from ft_core.errors import ConfigError\n"
             f"try: settings.value({variable!r})\n"
             "except ConfigError as e: print(e); sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", probe], env=child_env(**{variable: value}), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 3 and choices in proc.stdout and variable in proc.stdout


# ----------------------------------------------------------------------------- `ftl status`

@pytest.mark.parametrize("member, max_step, state", [
    ({"healthy": False, "step": 5}, 5, "lost"),
    ({"healthy": True, "step": None}, 5, "joining"),
    ({"healthy": True, "step": 5, "in_quorum": True}, 5, "training"),
    ({"healthy": True, "step": 4, "in_quorum": True}, 5, "training"),  # one behind: the normal skew
    ({"healthy": True, "step": 0, "in_quorum": True}, 5, "healing"),
    ({"healthy": True, "step": 0, "in_quorum": False}, 5, "behind by 5"),
    ({"healthy": True, "step": 5, "waiting": True, "in_quorum": False}, 5, "waiting for quorum"),
])
def test_member_states_mean_what_they_say(member, max_step, state):
    assert member_state(member, max_step) == state


@pytest.mark.timeout(60)
def test_piped_status_prints_full_ids_states_and_members_that_left():
    long_ids = ("replica_group_0:9f2c1a0b7d3e44aa", "replica_group_1:1b2c3d4e5f60718a")
    with LighthouseServer(quorum_tick_ms=50, heartbeat_timeout_ms=2_000) as server, \
            LighthouseClient(server.address()) as client:
        streams = {rid: client.start_heartbeat_stream(rid) for rid in long_ids}
        assert all(s.wait_connected(5) for s in streams.values())
        joined: list = []
        threads = [threading.Thread(target=lambda r=rid, s=step: joined.append(client.quorum(
            QuorumMember(r, address="127.0.0.1:7001", step=s), timedelta(seconds=10))), name=f"test-join-{step}")
            for rid, step in zip(long_ids, (9, 9))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert len(joined) == 2
        streams.pop(long_ids[1]).stop()  # the second group leaves: still listed, as lost
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            code, out, err, _ = ftl("status", "--lighthouse", server.http_address())
            if "lost" in out:
                break
            time.sleep(0.2)
        assert code == 0, err
        rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.startswith("replica_group_")}
        assert rows == {long_ids[0]: "training", long_ids[1]: "lost"}, out
        assert "…" not in out
        code, out, _, _ = ftl("status", "--json", "--lighthouse", server.http_address())
        status = json.loads(out)
        assert code == 0 and [m["replica_id"] for m in status["members"]] == [long_ids[0]]
        for s in streams.values():
            s.stop()


# ----------------------------------------------------------------------------- the start-up dial

def test_check_reachable_returns_the_first_address_that_answers_and_names_every_one_that_did_not():
    dead = closed_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        alive = listener.getsockname()[1]
        assert check_reachable(f"127.0.0.1:{dead},http://127.0.0.1:{alive}") == f"127.0.0.1:{alive}"
    with pytest.raises(RPCError) as exc:
        check_reachable([f"127.0.0.1:{dead}", f"[::1]:{dead}"], timeout_s=1.0)
    assert f"127.0.0.1:{dead}: Connection refused" in str(exc.value) and "FT_LIGHTHOUSE" in str(exc.value)
    assert exc.value.code == "UNAVAILABLE"


@pytest.mark.parametrize("address, message", [("", "no lighthouse address given"), ("garbage", "has no port"),
                                              ("127.0.0.1:70000", "outside 0-65535"), ("127.0.0.1:0", "has port 0"),
                                              (":29510", "has no host")])
def test_check_reachable_refuses_a_malformed_address_before_dialling(address, message):
    with pytest.raises(ConfigError, match=message):
        check_reachable(address)
