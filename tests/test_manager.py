"""The Manager against a real lighthouse, real manager servers and real Gloo groups, one thread per
replica group: allreduce numerics, healing, commit gating, max_retries and quorum timeouts."""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
from torch.distributed import ReduceOp

from conftest import BUSY_SLACK_S
from ft_core.errors import CommitError, ConfigError
from ft_core.control.lighthouse import LighthouseServer
from ft_core.manager import Manager
from ft_core.process_groups import FakeProcessGroupWrapper, ProcessGroupGloo

TIMEOUT = timedelta(seconds=10)


class Events(logging.Handler):
    """Collects the Manager's structured events."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        event = getattr(record, "ft_event", None)
        if event is not None:
            self.events.append(event)

    def of(self, kind: str, replica_prefix: str = "") -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind and e["replica_id"].startswith(replica_prefix)]


@pytest.fixture
def events():
    handler = Events()
    logger = logging.getLogger("ft_core.events")
    old = logger.level
    logger.setLevel(logging.DEBUG)  # routine events (a quorum that changed nothing, a commit) are DEBUG
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def run_groups(n: int, lighthouse: LighthouseServer, body: Callable[[Manager, int], Any],
               setup: Callable[[int], dict[str, Any]] | None = None, **kwargs: Any) -> list[Any]:
    """Run body(manager, i) for n replica groups in threads; re-raise the first failure."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        extra = setup(i) if setup else {}
        pg = extra.pop("pg", None) or ProcessGroupGloo(timeout=TIMEOUT)
        settings = {"timeout": TIMEOUT, "quorum_timeout": TIMEOUT, "connect_timeout": TIMEOUT, **kwargs, **extra}
        manager = Manager(pg, lighthouse_addr=lighthouse.address(), replica_id=f"r{i}", **settings)
        try:
            results[i] = body(manager, i)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)
        finally:
            manager.shutdown()
            pg.shutdown()

    threads = [threading.Thread(target=run, args=(i,), name=f"group-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a replica group thread hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.timeout(60)
def test_allreduce_numerics_across_three_groups():
    with LighthouseServer(min_replicas=3, join_timeout_ms=5000) as lighthouse:
        def body(manager: Manager, i: int) -> dict[str, Any]:
            out: dict[str, Any] = {}
            manager.start_quorum()
            for name, op in (("avg", ReduceOp.AVG), ("sum", ReduceOp.SUM), ("max", ReduceOp.MAX),
                             ("min", ReduceOp.MIN)):
                t = torch.tensor([i + 1.0, 2.0 * (i + 1)])
                manager.allreduce(t, op).wait()
                out[name] = t.tolist()
            ints = torch.tensor([i + 1], dtype=torch.int64)
            with pytest.raises(ConfigError, match="floating point"):
                manager.allreduce(ints, ReduceOp.AVG)
            manager.allreduce(ints, ReduceOp.SUM).wait()
            out["int_sum"] = ints.tolist()
            # continuations chained on the future run lazily, at wait()
            ran = []
            work = manager.allreduce(torch.tensor([float(i)]))
            fut = work.get_future().then(lambda f: (ran.append(1), f.value() * 10)[1])
            out["then_before_wait"] = list(ran)
            out["then"] = fut.wait().tolist()
            out["participants"] = manager.num_participants()
            out["commit"] = manager.should_commit()
            out["step"] = manager.current_step()
            return out

        results = run_groups(3, lighthouse, body, init_sync=False)
    for r in results:
        assert r["avg"] == [2.0, 4.0]  # divided by the 3 participants
        assert r["sum"] == [6.0, 12.0] and r["max"] == [3.0, 6.0] and r["min"] == [1.0, 2.0]
        assert r["int_sum"] == [6]
        assert r["then_before_wait"] == [] and r["then"] == [10.0]
        assert (r["participants"], r["commit"], r["step"]) == (3, True, 1)


@pytest.mark.timeout(60)
def test_group_behind_heals_contributes_zeros_and_ends_identical(events):
    with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:
        models: dict[int, torch.nn.Module] = {}

        def setup(i: int) -> dict[str, Any]:
            torch.manual_seed(i)  # different weights per group: healing must make them equal
            models[i] = model = torch.nn.Linear(4, 2)
            return {"load_state_dict": model.load_state_dict, "state_dict": model.state_dict}

        def body(manager: Manager, i: int) -> dict[str, Any]:
            model = models[i]
            if i == 0:
                manager.load_state_dict({"step": 3, "batches_committed": 6})
            manager.start_quorum()
            grad = torch.full((3,), 100.0 * (i + 1))
            manager.allreduce(grad).wait()
            participating = manager.is_participating()
            committed = manager.should_commit()
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(grad.sum())
            return {"grad": grad.tolist(), "participating": participating, "committed": committed,
                    "step": manager.current_step(), "batches": manager.batches_committed(),
                    "weights": [p.detach().clone() for p in model.parameters()]}

        results = run_groups(2, lighthouse, body, setup=setup)
    source, healer = results
    assert source["participating"] and not healer["participating"]
    assert source["grad"] == healer["grad"] == [100.0] * 3  # the healer sent zeros; AVG over 1 participant
    assert source["committed"] and healer["committed"]
    assert source["step"] == healer["step"] == 4 and source["batches"] == healer["batches"] == 7
    for a, b in zip(source["weights"], healer["weights"]):
        assert torch.equal(a, b)
    heals = events.of("heal", "r1")
    assert len(heals) == 1 and heals[0]["source_replica_rank"] == 0 and heals[0]["nbytes"] > 0
    assert not events.of("heal", "r0")
    quorum = events.of("quorum", "r1")[0]
    assert quorum["heal"] and quorum["max_step"] == 3 and quorum["num_participants"] == 1
    commits = events.of("commit", "r1")
    assert commits[-1]["committed"] and commits[-1]["step"] == 4


@pytest.mark.timeout(60)
def test_max_retries_raises_after_max_retries_plus_one_failed_commits(events):
    with LighthouseServer(min_replicas=1) as lighthouse:
        def setup(i: int) -> dict[str, Any]:
            return {"pg": FakeProcessGroupWrapper(ProcessGroupGloo(timeout=TIMEOUT))}

        def body(manager: Manager, i: int) -> list[Any]:
            outcomes: list[Any] = []
            for _ in range(3):
                manager.start_quorum()
                manager._pg.report_future_error(RuntimeError("injected allreduce failure"))
                t = torch.ones(2)
                manager.allreduce(t).wait()  # never raises into the loop
                try:
                    outcomes.append(manager.should_commit())
                except CommitError as exc:
                    outcomes.append(str(exc))
                    break
            return outcomes

        (outcomes,) = run_groups(1, lighthouse, body, setup=setup, max_retries=1)
    assert outcomes[0] is False
    assert isinstance(outcomes[1], str) and "2 consecutive steps failed" in outcomes[1]
    assert "injected allreduce failure" in outcomes[1]
    assert any("injected" in e["message"] for e in events.of("error"))
    assert [e["committed"] for e in events.of("commit")] == [False, False]


@pytest.mark.timeout(30)
def test_quorum_that_cannot_form_raises_timeout_error_on_time():
    with LighthouseServer(min_replicas=2, join_timeout_ms=60000) as lighthouse:
        def body(manager: Manager, i: int) -> float:
            manager.start_quorum()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                manager.should_commit()
            return time.monotonic() - started

        (elapsed,) = run_groups(1, lighthouse, body, quorum_timeout=timedelta(seconds=1))
    assert elapsed <= 1 + BUSY_SLACK_S


class CorruptingProxy:
    """A real HTTP proxy in front of a source's checkpoint server that damages chosen fetches:
    heal attempt i uses modes[i]: corrupt / truncate / wrong_step / pass. Attempts are told apart by the step they
    fetch (the source trains on, so each quorum heals to a new step), not by header requests: a healer asks for
    the header again while the source is still staging it, and under load that took the next attempt's mode."""

    def __init__(self, upstream: str, modes: list[str]) -> None:
        import http.server
        import re

        self.modes = modes
        self.steps: list[int] = []  # the steps fetched, in order: attempt i fetched steps[i]
        self.lock = threading.Lock()
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                return None

            def do_GET(self) -> None:  # noqa: N802
                import http.client

                match = re.search(r"/checkpoint/(\d+)/", self.path)
                with proxy.lock:
                    step = int(match.group(1)) if match else -1
                    if step not in proxy.steps:
                        proxy.steps.append(step)
                    attempt = proxy.steps.index(step)
                mode = proxy.modes[attempt] if attempt < len(proxy.modes) else "pass"
                path = self.path
                if mode == "wrong_step":
                    path = re.sub(r"/checkpoint/(\d+)/", lambda m: f"/checkpoint/{int(m.group(1)) + 1}/", path)
                conn = http.client.HTTPConnection(host, int(port), timeout=10)
                conn.request("GET", path)
                resp = conn.getresponse()
                body = bytearray(resp.read())
                conn.close()
                damaged = "/chunk/" in path and resp.status == 200
                if mode == "corrupt" and damaged:
                    body[len(body) // 2] ^= 0xFF
                self.send_response(resp.status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if mode == "truncate" and damaged:
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="corrupting-proxy", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.timeout(90)
def test_corrupt_truncated_or_wrong_step_checkpoint_fails_clearly_then_heals_next_quorum(events):
    from ft_core.checkpointing import HTTPTransport

    class BehindProxy(HTTPTransport):
        """The source's real transport, advertised through the damaging proxy."""

        proxy_url = ""

        def metadata(self) -> str:
            return self.proxy_url or super().metadata()

    source_transport = BehindProxy(timeout=TIMEOUT)
    proxy = CorruptingProxy(HTTPTransport.metadata(source_transport), ["corrupt", "truncate", "wrong_step"])
    source_transport.proxy_url = proxy.url
    models: dict[int, torch.nn.Module] = {}
    try:
        with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:
            def setup(i: int) -> dict[str, Any]:
                torch.manual_seed(10 + i)
                models[i] = model = torch.nn.Linear(64, 64)
                extra: dict[str, Any] = {"load_state_dict": model.load_state_dict, "state_dict": model.state_dict}
                if i == 0:
                    extra["checkpoint_transport"] = source_transport
                return extra

            def body(manager: Manager, i: int) -> list[tuple[int, bool]]:
                if i == 0:
                    manager.load_state_dict({"step": 5, "batches_committed": 5})
                history = []
                for _ in range(5):
                    manager.start_quorum()
                    grads = [torch.ones_like(p) for p in models[i].parameters()]
                    for g in grads:
                        manager.allreduce(g).wait()
                    committed = manager.should_commit()
                    if committed:
                        with torch.no_grad():
                            for p, g in zip(models[i].parameters(), grads):
                                p.sub_(0.1 * g)
                    history.append((manager.current_step(), committed))
                return history

            source, healer = run_groups(2, lighthouse, body, setup=setup)
    finally:
        proxy.close()
    # the source kept training through every failed heal
    assert source == [(6, True), (7, True), (8, True), (9, True), (10, True)]
    assert [c for _, c in healer] == [False, False, False, True, True]
    assert healer[-1][0] == 10
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    messages = [e["message"] for e in events.of("error", "r1")]
    assert len(messages) >= 3, messages
    assert "checksum" in messages[0] and "corrupt" in messages[0]
    assert "truncated" in messages[1]
    assert "step" in messages[2] and "serves step" in messages[2]
    assert len(events.of("heal", "r1")) == 1


@pytest.mark.timeout(90)
def test_starting_a_step_again_without_a_training_forward_costs_no_rebuild(events):
    """A step counts as begun (ft_core.redo.abandoned at the next start_quorum, when it then neither reduces
    nor votes) only at a training forward of the hooked model: a loop that zeroes its gradients twice per step,
    with an evaluation forward under no_grad between them, keeps its quorum and process group every step."""
    from ft_core.ddp import DistributedDataParallel

    with LighthouseServer(min_replicas=2, join_timeout_ms=5000) as lighthouse:
        def body(manager: Manager, i: int) -> list[bool]:
            torch.manual_seed(0)
            model = DistributedDataParallel(manager, torch.nn.Linear(4, 1))
            committed = []
            for _ in range(4):
                manager.start_quorum()
                with torch.no_grad():
                    model(torch.ones(2, 4))
                manager.start_quorum()  # the loop's second zero_grad()
                model(torch.full((2, 4), float(i))).sum().backward()
                committed.append(manager.should_commit())
            return committed

        results = run_groups(2, lighthouse, body)
    assert results == [[True] * 4, [True] * 4]
    quorums = {e["quorum_id"] for e in events.of("quorum")}
    assert len(quorums) == 1, f"the process group was rebuilt: quorums {sorted(quorums)}"
