"""HTTPTransport on loopback: real servers, a real damaging proxy, real threads for the peers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch

from conftest import assert_bounded
from ft_core.checkpointing import HTTPTransport
from ft_core.checkpointing.wire import CHECKSUMS
from ft_core.errors import AuthError, CheckpointError, FTTimeoutError
from tests.test_serialization import assert_same, nasty_state

SECOND = timedelta(seconds=1)
LONG = timedelta(seconds=20)


def big_state(n: int = 4, numel: int = 1 << 18) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(n)}


class DamagingProxy:
    """A TCP proxy that flips a byte at, or cuts the stream after, a position of each response stream."""

    def __init__(self, upstream: str, *, flip_at: int | None = None, cut_after: int | None = None) -> None:
        host, port = upstream.rsplit("/", 1)[-1].split(":")
        self.upstream = (host, int(port))
        self.flip_at, self.cut_after = flip_at, cut_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.closed = False
        self._spawn(self._accept, "proxy-accept")

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"test-{name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            self._spawn(self._pump, "proxy-up", client, server, False)
            self._spawn(self._pump, "proxy-down", server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, damage: bool) -> None:
        seen = 0
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                if damage and self.flip_at is not None and seen <= self.flip_at < seen + len(data):
                    data[self.flip_at - seen] ^= 0x01
                if damage and self.cut_after is not None and seen + len(data) > self.cut_after:
                    dst.sendall(data[:max(0, self.cut_after - seen)])
                    break
                dst.sendall(data)
                seen += len(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        try:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in our thread
        except OSError:
            pass
        self.listener.close()
        for sock in self.sockets:
            sock.close()
        for thread in self.threads:
            thread.join(5)

    def __enter__(self) -> DamagingProxy:  # noqa: PYI034 - not subclassed
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def source() -> HTTPTransport:
    with HTTPTransport(timeout=LONG, chunk_bytes=1 << 16) as transport:
        yield transport


@pytest.mark.parametrize("checksum", sorted(CHECKSUMS))
def test_nasty_state_round_trips_in_parallel_chunks(checksum: str) -> None:
    state = nasty_state()
    with HTTPTransport(timeout=LONG, chunk_bytes=1 << 16, checksum=checksum) as source, \
            HTTPTransport(timeout=LONG, num_connections=3) as healer:
        source.send_checkpoint([1], 7, state, LONG)
        out = healer.recv_checkpoint(0, source.metadata(), 7, LONG)
    assert_same(state, out)
    assert out["row_view"].untyped_storage().data_ptr() == out["base"].untyped_storage().data_ptr()


def test_one_source_heals_two_receivers_then_one() -> None:
    """The reference's multi-recovery contract: 1 -> 2 concurrently, then 1 -> 1 at a later step."""
    with HTTPTransport(timeout=LONG, chunk_bytes=1 << 17) as src, HTTPTransport(timeout=LONG) as a, \
            HTTPTransport(timeout=LONG) as b:
        first = {"model": big_state(), "step": 1, "name": "first", "extra": (1, "x")}
        results: dict[str, Any] = {}

        def heal(name: str, transport: HTTPTransport, step: int) -> None:
            try:
                results[name] = transport.recv_checkpoint(0, src.metadata(), step, LONG)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                results[name] = exc

        threads = [threading.Thread(target=heal, args=(name, healer, 1), name=f"test-heal-{name}")
                   for name, healer in (("a", a), ("b", b))]
        for thread in threads:
            thread.start()
        time.sleep(0.05)  # receivers ask before the source stages: they must wait for it
        src.send_checkpoint([1, 2], 1, first, LONG)
        for thread in threads:
            thread.join(30)
        assert_same(first, results["a"])
        assert_same(first, results["b"])
        src.disallow_checkpoint()

        second = {"model": {k: v + 1 for k, v in first["model"].items()}, "step": 2}
        src.send_checkpoint([2], 2, second, LONG)
        assert_same(second, b.recv_checkpoint(0, src.metadata(), 2, LONG))
        src.disallow_checkpoint()


def test_receive_timeout_of_10ms_raises_timeout_error_quickly(source: HTTPTransport) -> None:
    with HTTPTransport(timeout=LONG) as healer:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            healer.recv_checkpoint(0, source.metadata(), 3, timedelta(milliseconds=10))
    assert_bounded(start, 0.01, "a 10 ms receive")
    assert isinstance(info.value, FTTimeoutError) and "no checkpoint is staged" in str(info.value)


def test_wrong_step_is_a_clear_checkpoint_error(source: HTTPTransport) -> None:
    source.send_checkpoint([1], 4, {"w": torch.ones(3)}, LONG)
    with HTTPTransport(timeout=LONG) as healer, pytest.raises(CheckpointError, match="serves step 4, not step 5"):
        healer.recv_checkpoint(0, source.metadata(), 5, LONG)


def test_a_step_no_longer_served_is_a_410_at_once_not_a_503_retried_to_the_deadline(source: HTTPTransport) -> None:
    """Issue 13: a step the source stopped serving (here: a later step was staged since) is a 410 (give up
    now), not a 503 retried to the deadline."""
    source.send_checkpoint([1], 4, {"w": torch.ones(3)}, LONG)
    source.disallow_checkpoint()
    source.send_checkpoint([1], 5, {"w": torch.ones(3)}, LONG)
    source.disallow_checkpoint()
    with HTTPTransport(timeout=LONG) as healer, pytest.raises(CheckpointError, match="stopped serving step 4"):
        started = time.monotonic()
        healer.recv_checkpoint(0, source.metadata(), 4, LONG)
    assert time.monotonic() - started < LONG.total_seconds() / 2


def test_a_disallowed_step_is_served_for_the_healers_deadline_then_410() -> None:
    """A healer fetches beside its step's collectives (heals_during_the_step), so its source's step may end
    before the fetch starts: the disallowed step is still served for the transport's timeout (the healers'
    deadline), from the snapshot, whatever the source does to its state meanwhile; after that, 410."""
    window = timedelta(seconds=2)
    state = {"w": torch.ones(1 << 12)}
    with HTTPTransport(timeout=window) as source, HTTPTransport(timeout=LONG) as healer:
        assert source.heals_during_the_step
        source.send_checkpoint([1], 7, state, window)
        source.disallow_checkpoint()
        state["w"].add_(1.0)  # the source's optimizer step, after its vote
        assert torch.equal(healer.recv_checkpoint(0, source.metadata(), 7, LONG)["w"], torch.ones(1 << 12))
        time.sleep(window.total_seconds() + 0.2)
        with pytest.raises(CheckpointError, match="stopped serving step 7"):
            healer.recv_checkpoint(0, source.metadata(), 7, LONG)
        source.disallow_checkpoint()  # the next step's: frees the snapshot whose window ended
        assert source._kept is None


def test_a_step_not_staged_yet_is_retried_until_the_deadline(source: HTTPTransport) -> None:
    """The healer asks again while the source answers 503, and at its deadline names the source's answer. The
    deadline leaves room for a first answer on a busy machine (at 0.3 s the first request could still be
    unanswered, and the error then rightly said only "timed out")."""
    with HTTPTransport(timeout=LONG) as healer, pytest.raises(TimeoutError, match="no checkpoint is staged"):
        healer.recv_checkpoint(0, source.metadata(), 4, timedelta(seconds=2))


def test_every_healer_of_one_step_gets_the_same_bytes_while_the_source_trains_on(source: HTTPTransport) -> None:
    """Issue 13: the served state is a snapshot; a buffer mutated after staging (BatchNorm stats in the
    forward pass) changes neither the bytes nor the checksum a second healer of the same step receives."""
    running_mean = torch.zeros(1 << 14)
    source.send_checkpoint([1, 2], 5, {"bn.running_mean": running_mean}, LONG)
    with HTTPTransport(timeout=LONG) as first, HTTPTransport(timeout=LONG) as second:
        a = first.recv_checkpoint(0, source.metadata(), 5, LONG)
        running_mean.add_(1.0)  # the source's forward pass moves on
        b = second.recv_checkpoint(0, source.metadata(), 5, LONG)
    assert torch.equal(a["bn.running_mean"], torch.zeros(1 << 14))
    assert torch.equal(b["bn.running_mean"], torch.zeros(1 << 14))


def test_disallow_returns_at_once_while_a_healer_is_still_streaming(source: HTTPTransport) -> None:
    """Issue 13: disallow_checkpoint after a step never waits for a hung healer (the bytes are a snapshot)."""
    source.send_checkpoint([1], 6, big_state(numel=1 << 20), LONG)
    url = source.metadata().removeprefix("http://")
    host, port = url.rsplit(":", 1)
    hung = socket.create_connection((host, int(port)))  # asks for a chunk, then never reads the body
    try:
        hung.sendall(b"GET /checkpoint/6/chunk/0 HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        started = time.monotonic()
        source.disallow_checkpoint()
        assert_bounded(started, 0, "disallow_checkpoint")
    finally:
        hung.close()


@pytest.mark.parametrize("damage", [{"flip_at": 70_000}, {"flip_at": 200_000}, {"cut_after": 100_000}],
                         ids=["flip-first-chunk", "flip-later-chunk", "truncate"])
def test_damaged_bytes_fail_on_the_healer_while_the_source_keeps_serving(source: HTTPTransport, damage) -> None:
    state = big_state(numel=1 << 16)
    source.send_checkpoint([1], 9, state, LONG)
    with DamagingProxy(source.metadata(), **damage) as proxy, HTTPTransport(timeout=LONG, num_connections=1) as healer:
        start = time.monotonic()
        with pytest.raises(CheckpointError, match="checksum|truncated"):
            healer.recv_checkpoint(0, proxy.url, 9, LONG)
        assert_bounded(start, 0, "a damaged receive")
        assert_same(state, healer.recv_checkpoint(0, source.metadata(), 9, LONG))


@pytest.mark.parametrize("healer_token", [None, "wrong"])
def test_wrong_or_missing_token_is_rejected(healer_token: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FT_TOKEN", raising=False)
    with HTTPTransport(timeout=LONG, token="s3cret") as src, HTTPTransport(timeout=LONG, token=healer_token) as healer:
        src.send_checkpoint([1], 1, {"w": torch.ones(2)}, LONG)
        with pytest.raises(AuthError, match="HTTP 401"):
            healer.recv_checkpoint(0, src.metadata(), 1, LONG)
        with HTTPTransport(timeout=LONG, token="s3cret") as friend:
            assert torch.equal(friend.recv_checkpoint(0, src.metadata(), 1, LONG)["w"], torch.ones(2))


def test_token_comes_from_ft_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FT_TOKEN", "from-env")
    with HTTPTransport(timeout=LONG) as src, HTTPTransport(timeout=LONG) as healer:
        src.send_checkpoint([1], 1, {"w": torch.ones(2)}, LONG)
        assert torch.equal(healer.recv_checkpoint(0, src.metadata(), 1, LONG)["w"], torch.ones(2))
        monkeypatch.setenv("FT_TOKEN", "other")
        with HTTPTransport(timeout=LONG) as stranger, pytest.raises(AuthError):
            stranger.recv_checkpoint(0, src.metadata(), 1, LONG)


def test_in_place_receive_fills_the_local_tensors(source: HTTPTransport) -> None:
    state = {"model": big_state(n=2), "bias": torch.arange(4.0)[::2], "opt": {"lr": 0.5}}
    source.send_checkpoint([1], 2, state, LONG)
    local = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "bias": torch.zeros(2)}
    with HTTPTransport(timeout=LONG, state_dict=lambda: local) as healer:
        out = healer.recv_checkpoint(0, source.metadata(), 2, LONG)
    assert_same(state, out)
    for key, tensor in local["model"].items():
        assert out["model"][key] is tensor  # received straight into the local memory
    assert out["bias"] is local["bias"]  # a strided source view is copied into the local tensor


def test_receiver_never_sees_a_torn_state_when_the_source_mutates_after_disallow(source: HTTPTransport) -> None:
    state = big_state(n=8, numel=1 << 16)
    original = {k: v.clone() for k, v in state.items()}
    source.send_checkpoint([1], 3, state, LONG)
    outcome: dict[str, Any] = {}
    with DamagingProxy(source.metadata()) as proxy, HTTPTransport(timeout=LONG, num_connections=1) as healer:
        def heal() -> None:
            try:
                outcome["state"] = healer.recv_checkpoint(0, proxy.url, 3, LONG)
            except CheckpointError as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=heal, name="test-heal")
        thread.start()
        time.sleep(0.02)
        source.disallow_checkpoint()
        for tensor in state.values():  # the optimizer step, once disallow has returned
            tensor.add_(1.0)
        thread.join(30)
    assert "state" in outcome or "error" in outcome
    if "state" in outcome:
        assert_same(original, outcome["state"])
    else:
        assert any(word in str(outcome["error"]) for word in ("410", "503", "truncated"))  # 410: stopped serving


def test_bad_source_address_is_a_clear_error() -> None:
    with HTTPTransport(timeout=LONG) as healer, pytest.raises(CheckpointError, match="not http://host:port"):
        healer.recv_checkpoint(0, "grpc://127.0.0.1", 1, SECOND)


def test_dead_source_fails_fast() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        with HTTPTransport(timeout=LONG) as healer:
            start = time.monotonic()
            with pytest.raises(CheckpointError, match="refused"):
                healer.recv_checkpoint(0, f"http://127.0.0.1:{port}", 1, LONG)
            assert_bounded(start, 0, "a refused receive")


def test_silent_source_times_out_on_time() -> None:
    # the listener accepts connections (the kernel does, from its backlog) but never answers
    with socket.create_server(("127.0.0.1", 0)) as listener, HTTPTransport(timeout=LONG) as healer:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="longer than the 0.3s timeout"):
            healer.recv_checkpoint(0, f"http://127.0.0.1:{listener.getsockname()[1]}", 1,
                                   timedelta(milliseconds=300))
        assert_bounded(start, 0.3, "a 0.3 s receive from a silent source")


def test_shutdown_joins_every_thread_it_started() -> None:
    transport = HTTPTransport(timeout=LONG)
    transport.send_checkpoint([1], 1, {"w": torch.ones(2)}, LONG)
    with HTTPTransport(timeout=LONG) as healer:
        healer.recv_checkpoint(0, transport.metadata(), 1, LONG)
    transport.shutdown()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("ftl-ckpt")]
    with pytest.raises(CheckpointError, match="shut down"):
        transport.send_checkpoint([1], 2, {}, LONG)


def test_server_binds_loopback_by_default() -> None:
    with HTTPTransport(timeout=LONG) as transport:
        assert transport.metadata().startswith("http://127.0.0.1:")
        assert transport._server.server_address[0] == "127.0.0.1"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_to_pinned_host_memory() -> None:
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.arange(5, device="cuda")}
    expected = {k: v.cpu() for k, v in state.items()}
    with HTTPTransport(timeout=LONG) as src, HTTPTransport(timeout=LONG) as healer:
        src.send_checkpoint([1], 1, state, LONG)
        out = healer.recv_checkpoint(0, src.metadata(), 1, LONG)
        src.disallow_checkpoint()
        state["w"].add_(1)  # ordered after the staging copies by disallow_checkpoint
        torch.cuda.synchronize()
    assert_same(expected, out)


def _gated_snapshot(monkeypatch: pytest.MonkeyPatch, gate: threading.Event, fail: bool = False) -> None:
    """send_checkpoint publishes the step, then its snapshot copy waits for `gate` (a slow copy)."""
    from ft_core.checkpointing import http_transport

    real = http_transport._snapshot

    def slow(staged: Any, host: list[int]) -> None:
        assert gate.wait(20)
        if fail:
            raise MemoryError("no host memory for the snapshot")
        real(staged, host)

    monkeypatch.setattr(http_transport, "_snapshot", slow)


def test_a_chunk_is_served_only_once_the_snapshot_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step is published before its snapshot is copied (the healers' reads overlap the copy), but no
    chunk comes from the live tensors: a healer asking early waits for the copy, and gets its bytes."""
    gate = threading.Event()
    _gated_snapshot(monkeypatch, gate)
    state = {"w": torch.zeros(1 << 14)}
    got: dict[str, Any] = {}
    with HTTPTransport(timeout=LONG, chunk_bytes=1 << 12) as source, HTTPTransport(timeout=LONG) as healer:
        sender = threading.Thread(target=source.send_checkpoint, args=([1], 3, state, LONG), name="test-send")
        sender.start()
        fetcher = threading.Thread(target=lambda: got.update(a=healer.recv_checkpoint(0, source.metadata(), 3, LONG)),
                                   name="test-heal")
        fetcher.start()
        time.sleep(0.3)
        assert fetcher.is_alive() and "a" not in got  # published, not copied: the chunks wait
        state["w"].fill_(7.0)  # the live state changes before the copy: the snapshot takes it, whole
        gate.set()
        sender.join(20)
        fetcher.join(20)
        state["w"].fill_(9.0)  # after the copy: no healer sees it
        second = healer.recv_checkpoint(0, source.metadata(), 3, LONG)
    assert torch.equal(got["a"]["w"], torch.full((1 << 14,), 7.0)) and torch.equal(second["w"], got["a"]["w"])


def test_a_snapshot_that_fails_fails_its_waiting_healer_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()
    _gated_snapshot(monkeypatch, gate, fail=True)
    outcome: dict[str, Any] = {}

    def send(source: HTTPTransport) -> None:
        try:
            source.send_checkpoint([1], 3, {"w": torch.zeros(1 << 14)}, LONG)
        except CheckpointError as exc:
            outcome["send"] = exc

    def heal(healer: HTTPTransport, source: HTTPTransport) -> None:
        try:
            healer.recv_checkpoint(0, source.metadata(), 3, LONG)
        except CheckpointError as exc:
            outcome["heal"] = exc

    with HTTPTransport(timeout=LONG, chunk_bytes=1 << 12) as source, HTTPTransport(timeout=LONG) as healer:
        threads = [threading.Thread(target=send, args=(source,), name="test-send"),
                   threading.Thread(target=heal, args=(healer, source), name="test-heal")]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        started = time.monotonic()
        gate.set()
        for thread in threads:
            thread.join(20)
    assert_bounded(started, 0, "the healer's failure after the snapshot's")
    assert "could not snapshot step 3" in str(outcome["heal"]) and "MemoryError" in str(outcome["send"])


def test_a_healer_asking_for_the_next_step_just_before_its_source_stages_it_gets_it() -> None:
    """Heals beside the step: a source serves its last step (7) to that step's healers after its vote, and a
    healer of the next quorum can ask for step 8 a moment before the source stages it. The source answers
    400 (it serves 7), which the healer asks again for a short grace, so it gets step 8; a source that keeps
    serving another step still fails the healer soon (the wrong-step case of test_manager)."""
    with HTTPTransport(timeout=LONG) as source, HTTPTransport(timeout=LONG) as healer:
        source.send_checkpoint([1], 7, {"w": torch.zeros(8)}, LONG)
        source.disallow_checkpoint()
        got: dict[str, Any] = {}
        fetcher = threading.Thread(target=lambda: got.update(s=healer.recv_checkpoint(0, source.metadata(), 8, LONG)),
                                   name="test-heal")
        fetcher.start()
        time.sleep(0.3)  # the healer was answered 400 (step 7 is served) and asks again
        source.send_checkpoint([1], 8, {"w": torch.ones(8)}, LONG)
        fetcher.join(20)
        assert torch.equal(got["s"]["w"], torch.ones(8))
        with pytest.raises(CheckpointError, match="serves step 8, not step 9"):
            started = time.monotonic()
            healer.recv_checkpoint(0, source.metadata(), 9, LONG)
        assert_bounded(started, 2.0, "a fetch refused for serving another step")
