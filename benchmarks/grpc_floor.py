"""The grpc.aio floor under the quorum path: what a bare unary call and a bare stream ping-pong cost on
this machine, with no ft_core code in them (see "Where a quorum round's time goes" in README.md).

`python -m benchmarks.grpc_floor [--calls N]`

- unary: a grpc.aio client calling a server on the same event loop (as `quorum_latency` drives a
  manager server), 40-byte request echoed back;
- stream: one message each way on a stream to a server in another process (as a manager server's
  quorum request travels to the lighthouse and back).
Prints p50/p99 of the round trip and this process's CPU per call.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from typing import Any

import grpc

PAYLOAD = b"x" * 40


def _echo_server(conn: Any) -> None:
    """Child: a grpc.aio server whose stream method echoes each message; sends its port, runs until killed."""
    async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        async for request in requests:
            yield request

    async def serve() -> None:
        server = grpc.aio.server()
        handlers = {"S": grpc.stream_stream_rpc_method_handler(stream)}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo", handlers),))
        conn.send(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def _measure(remote_port: int, calls: int) -> dict[str, dict[str, float]]:
    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "echo", {"U": grpc.unary_unary_rpc_method_handler(unary)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    local = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    remote = grpc.aio.insecure_channel(f"127.0.0.1:{remote_port}")
    call_unary = local.unary_unary("/echo/U")
    stream = remote.stream_stream("/echo/S")()

    async def ping_pong() -> None:
        await stream.write(PAYLOAD)
        await stream.read()

    out = {}
    for name, once in (("unary, same loop", lambda: call_unary(PAYLOAD, timeout=10)),
                       ("stream ping-pong, other process", ping_pong)):
        for _ in range(100):  # warm-up
            await once()
        cpu, latencies = time.process_time(), []
        for _ in range(calls):
            started = time.perf_counter()
            await once()
            latencies.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
        latencies.sort()
        out[name] = {"p50_ms": 1000 * latencies[len(latencies) // 2],
                     "p99_ms": 1000 * latencies[int(len(latencies) * 0.99)], "cpu_ms_per_call": 1000 * cpu / calls}
    stream.cancel()
    await local.close()
    await remote.close()
    await server.stop(None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    opts = parser.parse_args(argv)
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_echo_server, args=(child_conn,), name="grpc-floor-echo", daemon=True)
    child.start()
    try:
        if not conn.poll(30):
            raise TimeoutError("the echo server did not start within 30 s")
        results = asyncio.run(_measure(conn.recv(), opts.calls))
    finally:
        child.kill()
        child.join(10)
    for name, stats in results.items():
        print(f"{name}: p50 {stats['p50_ms']:.3f} ms, p99 {stats['p99_ms']:.3f} ms, "
              f"CPU {stats['cpu_ms_per_call']:.3f} ms per call")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
