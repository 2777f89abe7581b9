"""Quorum latency: one full `ManagerClient.quorum` round trip (client -> manager server -> lighthouse
and back) for every replica group each round, in steady state and with one group leaving or joining
every round. Prints p50/p99 per group count, side by side with torchft's Rust servers where installed.

`python -m benchmarks.quorum_latency [--groups 2,8,32,64] [--rounds N] [--procs P] [--no-baseline] [--json]`

Layout, as in a job: the lighthouse runs in its own process; the groups (each a manager server and a
client) are spread over P worker processes (default min(groups, 8)); the main process only starts each
round and collects the latencies each group measured around its own call.
Targets (issue 15; reported, not asserted): steady p50 <= 0.5 ms and p99 <= 2 ms with 2 groups; with 64
groups, p50 and p99 at most torchft's in the same run (torchft measured 19 ms median, p99 ~30 ms there).
Each group is its library's own manager server and client (ours: grpc.aio on the loop of the group's
heartbeat stream; torchft's: Rust), many per worker process, no torch import on our side.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from benchmarks import _harness, targets

CALL_TIMEOUT = timedelta(seconds=20)
REPLY_TIMEOUT_S = 60.0
TARGETS_MS = {"steady_p50_2": targets.QUORUM_2["p50_ms"], "steady_p99_2": targets.QUORUM_2["p99_ms"],
              "steady_p99_64": 30.0}  # 64: and <= torchft's, same run
REFERENCE_MS = {"steady_p50_2": 0.65, "steady_p99_64": 28.4}  # torchft, as the issue measured it

GroupHandle = tuple[Callable[[int], int], Callable[[], None], Callable[[], None]]  # quorum, wait_joined, close


# ---------------------------------------------------------------- implementations (run inside children)

def _start_lighthouse(impl: str) -> tuple[str, Callable[[], None], Callable[[str], bool]]:
    """(address, shutdown, is_waiting(replica_id)) of a lighthouse of implementation `impl`."""
    if impl in ("ft_core", "ft_core_sim"):
        from ft_core.control.lighthouse import LighthouseServer

        server = LighthouseServer(min_replicas=1, join_timeout_ms=30_000, http_bind=None)

        def is_waiting(replica_id: str) -> bool:
            return any(m["replica_id"] == replica_id and m["waiting"] for m in server.core.status()["members"])

        return server.address(), server.shutdown, is_waiting
    os.environ.setdefault("RUST_LOG", "error")
    from torchft._torchft import LighthouseServer as TorchftLighthouse

    ref = TorchftLighthouse(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=30_000)
    port = ref.address().rsplit(":", 1)[1]  # it reports a host name; lookups can stall, so dial the IP
    return f"http://127.0.0.1:{port}", ref.shutdown, lambda replica_id: True


def _start_group(impl: str, replica_id: str, lighthouse_addr: str) -> GroupHandle:
    if impl == "ft_core_sim":  # a simulated member: one heartbeat stream carrying its quorum, no manager server
        from ft_core.control.lighthouse_client import LighthouseClient, StreamUnavailable
        from ft_core.control.types import QuorumMember

        client = LighthouseClient(lighthouse_addr)
        stream = client.start_heartbeat_stream(replica_id)
        use_stream = os.environ.get("FT_STREAM_QUORUM", "1") not in ("0", "false")  # 0: unary calls (before)

        def sim_quorum(step: int) -> int:
            member = QuorumMember(replica_id, address="127.0.0.1:1", step=step)
            try:
                if not use_stream:
                    raise StreamUnavailable("stream quorum off", peer="", call="", code="UNAVAILABLE")
                return stream.quorum(member, CALL_TIMEOUT).quorum_id
            except StreamUnavailable:
                return client.quorum(member, CALL_TIMEOUT).quorum_id

        return sim_quorum, lambda: stream.wait_connected(10.0), client.close
    if impl == "ft_core" and os.environ.get("FT_BENCH_THREADS", "0") in ("0", ""):
        return _start_async_group(replica_id, lighthouse_addr)
    if impl == "ft_core":
        from ft_core.control.manager_server import ManagerClient, ManagerServer

        server = ManagerServer(replica_id, lighthouse_addr, world_size=1)
        client = ManagerClient(server.address(), frames_addr=server.frames_address())

        def close() -> None:
            client.close()
            server.shutdown()

        return (lambda step: client.quorum(0, step, "", False, CALL_TIMEOUT).quorum_id,
                lambda: server._heartbeat.wait_connected(10.0), close)
    os.environ.setdefault("RUST_LOG", "error")
    from torchft._torchft import ManagerClient as TorchftClient
    from torchft._torchft import ManagerServer as TorchftServer

    ref = TorchftServer(replica_id=replica_id, lighthouse_addr=lighthouse_addr, hostname="127.0.0.1",
                        bind="127.0.0.1:0", store_addr="", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
                        connect_timeout=timedelta(seconds=10), quorum_retries=0)
    ref_client = TorchftClient(ref.address(), connect_timeout=timedelta(seconds=10))

    kwargs: dict[str, Any] = dict(group_rank=0, checkpoint_metadata="", shrink_only=False, timeout=CALL_TIMEOUT,
                                  commit_failures=0, init_sync=True)
    if "reconfigure_handle" in (TorchftClient._quorum.__text_signature__ or ""):  # newer torchft builds
        kwargs["reconfigure_handle"] = ""

    def quorum(step: int) -> int:
        return ref_client._quorum(step=step, **kwargs).quorum_id

    return quorum, lambda: time.sleep(0.3), ref.shutdown


def _start_async_group(replica_id: str, lighthouse_addr: str) -> GroupHandle:
    """Our group driven without a thread: the call ManagerClient.quorum makes (ManagerService.Quorum), sent
    from a coroutine on the loop that also runs the process's manager servers and heartbeat streams, on the
    frames wire a ManagerClient uses (ft_core.control.frames; FT_FRAMES=0: a grpc.aio stub instead).

    With a thread per simulated group, a Python process hosting many groups measures its own GIL
    hand-offs (each woken thread waits up to the 5 ms switch interval); torchft's members are Rust
    threads that hold no GIL. FT_BENCH_THREADS=1 drives our groups with threads and ManagerClient instead.
    """
    import asyncio

    import grpc

    from ft_core.control.frames import AsyncFrameClient
    from ft_core.control.heartbeat_stream import stream_loop
    from ft_core.control.manager_server import ManagerServer
    from ft_core.control.proto import ft_pb2, ft_pb2_grpc
    from ft_core.control.rpc import CHANNEL_OPTIONS

    server = ManagerServer(replica_id, lighthouse_addr, world_size=1)
    loop = stream_loop()
    timeout_s = CALL_TIMEOUT.total_seconds()
    if server.frames_address():
        wire = AsyncFrameClient(server.frames_address(), None, f"manager server {replica_id}")

        async def call(request: Any) -> Any:
            return ft_pb2.ManagerQuorumResponse.FromString(
                await wire.call("Quorum", request.SerializeToString(), timeout_s))

        async def close_wire() -> None:
            wire.close()
    else:
        async def open_stub() -> tuple[Any, Any]:
            channel = grpc.aio.insecure_channel(server.address(), options=CHANNEL_OPTIONS)
            await channel.channel_ready()
            return channel, ft_pb2_grpc.ManagerServiceStub(channel)

        channel, stub = asyncio.run_coroutine_threadsafe(open_stub(), loop).result(10)

        async def call(request: Any) -> Any:
            return await stub.Quorum(request, timeout=timeout_s)

        async def close_wire() -> None:
            await channel.close()

    async def quorum(step: int) -> int:
        request = ft_pb2.ManagerQuorumRequest(group_rank=0, step=step, checkpoint_metadata="", shrink_only=False,
                                              init_sync=True)
        return (await call(request)).quorum_id

    def close() -> None:
        asyncio.run_coroutine_threadsafe(close_wire(), loop).result(10)
        server.shutdown()

    return quorum, lambda: server._heartbeat.wait_connected(10.0), close


def _lighthouse_process(impl: str, conn: Any) -> None:
    """Child: host the lighthouse; answer ("waiting", replica_id) until ("stop",)."""
    address, shutdown, is_waiting = _start_lighthouse(impl)
    conn.send(address)
    try:
        while (msg := conn.recv())[0] != "stop":
            conn.send(time.process_time() if msg[0] == "cpu" else gc.collect() if msg[0] == "settle"
                      else is_waiting(msg[1]))
    finally:
        shutdown()
    conn.send("stopped")


def _worker_process(impl: str, lighthouse_addr: str, conn: Any) -> None:
    """Child: host some groups, each driven by its own thread (or, for a coroutine, a task on the stream
    loop); commands from the main process."""
    import asyncio

    groups: dict[str, GroupHandle] = {}
    inboxes: dict[str, queue.Queue] = {}
    results: queue.Queue = queue.Queue()
    pending = 0
    finished: list[tuple[str, float, int, str]] = []  # results of coroutine groups, gathered on the loop
    all_finished = threading.Event()
    expected = [0]

    async def drive_async(replica_id: str, step: int) -> None:
        started = time.perf_counter()
        try:
            quorum_id, error = await groups[replica_id][0](step), ""
        except Exception as exc:  # sent back and raised by the main process
            quorum_id, error = -1, repr(exc)
        finished.append((replica_id, time.perf_counter() - started, quorum_id, error))
        if len(finished) == expected[0]:
            all_finished.set()

    def start_async(ids: list[str], step: int) -> None:
        loop = asyncio.get_running_loop()
        for replica_id in ids:
            loop.create_task(drive_async(replica_id, step))

    def drive(replica_id: str) -> None:
        quorum = groups[replica_id][0]
        while (step := inboxes[replica_id].get()) is not None:
            started = time.perf_counter()
            try:
                quorum_id, error = quorum(step), ""
            except Exception as exc:  # sent back and raised by the main process
                quorum_id, error = -1, repr(exc)
            results.put((replica_id, time.perf_counter() - started, quorum_id, error))

    while True:
        cmd, *args = conn.recv()
        if cmd == "add":
            replica_id = args[0]
            groups[replica_id] = _start_group(impl, replica_id, lighthouse_addr)
            inboxes[replica_id] = queue.Queue()
            if not asyncio.iscoroutinefunction(groups[replica_id][0]):
                threading.Thread(target=drive, args=(replica_id,), name=f"bench-{replica_id}", daemon=True).start()
            groups[replica_id][1]()
            conn.send("ok")
        elif cmd == "remove":
            inboxes.pop(args[0]).put(None)  # (a coroutine group has no thread reading it)
            groups.pop(args[0])[2]()
            conn.send("ok")
        elif cmd == "dispatch":
            rnd, ids = args
            coroutines = [r for r in ids if asyncio.iscoroutinefunction(groups[r][0])]
            for replica_id in ids:
                if replica_id not in coroutines:
                    inboxes[replica_id].put(rnd)
            pending += len(ids) - len(coroutines)
            if coroutines:
                from ft_core.control.heartbeat_stream import stream_loop

                expected[0] += len(coroutines)
                all_finished.clear()
                stream_loop().call_soon_threadsafe(start_async, coroutines, rnd)
        elif cmd == "collect":
            got = [results.get(timeout=REPLY_TIMEOUT_S) for _ in range(pending)]
            if expected[0]:
                if not all_finished.wait(REPLY_TIMEOUT_S):
                    raise TimeoutError(f"benchmark groups did not answer within {REPLY_TIMEOUT_S}s")
                got += finished[:]
                finished.clear()
                expected[0] = 0
            pending = 0
            conn.send(got)
        elif cmd == "cpu":
            conn.send(time.process_time())
        elif cmd == "settle":
            conn.send(gc.collect())
        elif cmd == "stop":
            for replica_id in list(groups):
                inboxes.pop(replica_id).put(None)
                groups.pop(replica_id)[2]()
            conn.send("stopped")
            return


# ---------------------------------------------------------------- the measurement (main process)

class _Job:
    """The lighthouse process and the worker processes of one measurement."""

    def __init__(self, impl: str, procs: int) -> None:
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._lh_conn, child = ctx.Pipe()
        self._procs.append(ctx.Process(target=_lighthouse_process, args=(impl, child), name="bench-lighthouse",
                                       daemon=True))
        self._procs[0].start()
        self.address = self._recv(self._lh_conn)
        self.workers = []
        for i in range(procs):
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_process, args=(impl, self.address, child), name=f"bench-worker-{i}",
                               daemon=True)
            proc.start()
            self._procs.append(proc)
            self.workers.append(conn)
        self.where: dict[str, Any] = {}  # replica_id -> worker conn
        self._next = 0

    def _recv(self, conn: Any) -> Any:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not conn.poll(0.1):
            dead = [p.name for p in self._procs if p.exitcode is not None]
            if dead:
                raise RuntimeError(f"benchmark child(ren) {dead} exited; see their output above")
            if time.monotonic() > deadline:
                raise TimeoutError(f"benchmark child did not answer within {REPLY_TIMEOUT_S}s")
        return conn.recv()

    def add(self, replica_id: str) -> None:
        conn = self.workers[self._next % len(self.workers)]
        self._next += 1
        conn.send(("add", replica_id))
        self._recv(conn)
        self.where[replica_id] = conn

    def remove(self, replica_id: str) -> None:
        conn = self.where.pop(replica_id)
        conn.send(("remove", replica_id))
        self._recv(conn)

    def dispatch(self, rnd: int, ids: list[str]) -> None:
        by_conn: dict[int, list[str]] = {}
        for replica_id in ids:
            by_conn.setdefault(id(self.where[replica_id]), []).append(replica_id)
        for conn in self.workers:
            if id(conn) in by_conn:
                conn.send(("dispatch", rnd, by_conn[id(conn)]))

    def collect(self) -> list[tuple[str, float, int, str]]:
        for conn in self.workers:
            conn.send(("collect",))
        return [item for conn in self.workers for item in self._recv(conn)]

    def lighthouse_cpu_s(self) -> float:
        """CPU seconds the lighthouse process has used so far (all its threads)."""
        self._lh_conn.send(("cpu",))
        return self._recv(self._lh_conn)

    def settle(self) -> None:
        """A full collection in every child, after the groups are added and before rounds are timed: the
        objects the set-up left (servers, connections, threads) are sorted out now, instead of by a full
        collection that the set-up's allocations would otherwise trigger in every process at once a few
        seconds into the measurement. Collections the rounds themselves cause still happen, as they would."""
        for conn in (self._lh_conn, *self.workers):
            conn.send(("settle",))
        for conn in (self._lh_conn, *self.workers):
            self._recv(conn)

    def members_cpu_s(self) -> float:
        """CPU seconds the worker processes (the simulated groups: servers and clients) have used so far."""
        for conn in self.workers:
            conn.send(("cpu",))
        return sum(self._recv(conn) for conn in self.workers)

    def is_waiting(self, replica_id: str) -> bool:
        self._lh_conn.send(("waiting", replica_id))
        return self._recv(self._lh_conn)

    def close(self) -> None:
        for conn in [*self.workers, self._lh_conn]:
            try:
                conn.send(("stop",))
                conn.poll(REPLY_TIMEOUT_S)
            except (OSError, EOFError):
                pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def measure(impl: str, n_groups: int, rounds: int, warmup: int, membership: bool,
            procs: int | None = None) -> dict[str, Any]:
    """Latencies of every group's quorum call over `rounds` measured rounds (after `warmup`).

    With `membership`, even rounds start with one group leaving (its server shuts down) and odd rounds
    with a new group joining. A joiner's first call waits at the lighthouse before the others start the
    round (as it would while they compute), so only the others' calls of that round are timed.
    """
    job = _Job(impl, procs or min(n_groups, 8))
    members: list[str] = []
    latencies: list[float] = []
    quorum_ids: list[int] = []
    try:
        for i in range(n_groups):
            members.append(f"group_{i:04d}")
            job.add(members[-1])
        job.settle()
        serial = n_groups
        for rnd in range(warmup + rounds):
            joiner = None
            if membership and rnd >= warmup:
                if (rnd - warmup) % 2 == 0:  # one group leaves ...
                    job.remove(members.pop(0))
                else:  # ... and a new one joins, waiting at the lighthouse before the others start
                    joiner = f"group_{serial:04d}"
                    serial += 1
                    job.add(joiner)
                    members.append(joiner)
                    job.dispatch(rnd, [joiner])
                    limit = time.monotonic() + 10
                    while not job.is_waiting(joiner) and time.monotonic() < limit:
                        time.sleep(0.001)
            job.dispatch(rnd, [m for m in members if m != joiner])
            got = job.collect()
            errors = [f"{rid}: {err}" for rid, _, _, err in got if err]
            if errors:
                raise RuntimeError(f"{impl}: quorum failed in round {rnd}: {errors[:3]}")
            if rnd >= warmup:
                latencies += [lat for rid, lat, _, _ in got if rid != joiner]
                quorum_ids.append(got[0][2])
    finally:
        job.close()
    ms = [x * 1000 for x in latencies]
    return {"p50_ms": _harness.percentile(ms, 50), "p99_ms": _harness.percentile(ms, 99), "calls": len(ms),
            "distinct_quorum_ids": len(set(quorum_ids))}


def run(groups: Sequence[int] = (2, 8, 32, 64), rounds: int = 100, warmup: int = 5, membership: bool = True,
        baseline: bool = True, procs: int | None = None) -> dict[str, Any]:
    """Run every configuration; returns {"ft_core": {mode: {n: stats}}, "torchft": ..., targets, ratios}."""
    impls = ["ft_core"] + (["torchft"] if baseline and _harness.torchft_available() else [])
    modes = ["steady"] + (["membership"] if membership else [])
    out: dict[str, Any] = {"groups": list(groups), "rounds": rounds, "targets_ms": TARGETS_MS,
                           "reference_measured_ms": REFERENCE_MS}
    for impl in impls:
        for mode in modes:
            if impl == "torchft" and mode == "membership":
                continue  # torchft drops a dead group only after heartbeat_timeout (5 s): not comparable per round
            for n in groups:
                out.setdefault(impl, {}).setdefault(mode, {})[n] = measure(impl, n, rounds, warmup,
                                                                           mode == "membership", procs)
    ours = out["ft_core"]["steady"]
    out["vs_targets"] = {"steady_p50_2": ours.get(2, {}).get("p50_ms"), "steady_p99_2": ours.get(2, {}).get("p99_ms"),
                         "steady_p99_64": ours.get(64, {}).get("p99_ms")}
    if "torchft" in out:
        out["ratio_to_torchft"] = {f"{mode}_{n}": {k: out["ft_core"][mode][n][k] / out["torchft"][mode][n][k]
                                                   for k in ("p50_ms", "p99_ms")}
                                   for mode in out["torchft"] for n in out["torchft"][mode]}
    return out


def _print_table(res: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"quorum latency, {res['rounds']} rounds (ms)")
    for col in ("impl", "mode", "groups", "p50", "p99", "calls", "quorum ids"):
        table.add_column(col, justify="left" if col in ("impl", "mode") else "right")
    for impl in ("ft_core", "torchft"):
        for mode, by_n in res.get(impl, {}).items():
            for n, s in by_n.items():
                table.add_row(impl, mode, str(n), f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}", str(s["calls"]),
                              str(s["distinct_quorum_ids"]))
    console = Console()
    console.print(table)
    console.print(f"targets: {TARGETS_MS}; torchft as measured for the issue: {REFERENCE_MS}")
    console.print(f"ft_core: {res['vs_targets']}")
    if "ratio_to_torchft" in res:
        console.print(f"ft_core / torchft, measured now (lower is better): {json.dumps(res['ratio_to_torchft'])}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="2,8,32,64", help="comma-separated group counts")
    parser.add_argument("--rounds", type=int, default=100, help="measured rounds per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--procs", type=int, default=None, help="worker processes (default min(groups, 8))")
    parser.add_argument("--no-membership", action="store_true", help="steady state only")
    parser.add_argument("--no-baseline", action="store_true", help="skip torchft even when installed")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON")
    opts = parser.parse_args(argv)
    res = run([int(g) for g in opts.groups.split(",") if g], opts.rounds, opts.warmup, not opts.no_membership,
              not opts.no_baseline, opts.procs)
    if opts.json:
        print(json.dumps(res, indent=2))
    else:
        _print_table(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
