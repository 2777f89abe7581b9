"""Checkpoint transport throughput on loopback: HTTPTransport and PGTransport (Gloo) vs a raw-socket baseline.

    python -m benchmarks.transport_throughput [--sizes 10MB,100MB,1GB] [--quick] [--reps N]

The source runs in its own process (as a live replica would), the receiver in this one. Reported per size:
- raw TCP: the same bytes over 2 plain sockets into a preallocated buffer (the ceiling on this machine);
- HTTP fresh: `recv_checkpoint` allocating new tensors (what a freshly restarted replica does);
- HTTP in place: receiving straight into existing tensors (`HTTPTransport(state_dict=...)`);
- PG: PGTransport over a 2-process Gloo group (fresh tensors);
- first fetch: one fetch in a new receiver process, ours and torchft's (a restarted replica's heal, whose
  memory is all new to it; later fetches in one process may reuse pages the previous one freed).
Target (reported, not asserted): >= 3 GB/s for 1 GB over HTTP. torchft's HTTPTransport measured 0.2-0.6 GB/s
on this kind of machine. Fresh allocations pay first-touch page faults, which are expensive in small VMs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import threading
import time
from datetime import timedelta
from typing import Any

from benchmarks import targets

TENSOR_BYTES = 4 << 20
TIMEOUT = timedelta(seconds=300)
REFERENCE = "torchft HTTPTransport: 0.2-0.6 GB/s on a 2-vCPU loopback"


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10), ("B", 1)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(text)


def make_state(nbytes: int) -> dict[str, Any]:
    import torch

    count = max(1, nbytes // TENSOR_BYTES)
    per = max(1, nbytes // count // 4)
    gen = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(count)},
            "step": 1, "lr": 0.1}


def _end(proc: Any, wait_s: float = 0.0) -> None:
    """Wait up to `wait_s` for a benchmark process to exit (none: it failed, end it now), then kill it if alive."""
    proc.join(wait_s)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def _single_thread() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)


# ---------------------------------------------------------------- the source process


def _source_main(conn: Any, nbytes: int) -> None:
    """Serves HTTP (staging a fresh step per request) and raw-socket copies of the same tensors."""
    _single_thread()
    from ft_core.checkpointing import HTTPTransport
    from ft_core.checkpointing.serialization import tensor_bytes

    state = make_state(nbytes)
    views = [tensor_bytes(t) for t in state["model"].values()]
    listener = socket.create_server(("127.0.0.1", 0))
    with HTTPTransport(timeout=TIMEOUT) as transport:
        conn.send((transport.metadata(), listener.getsockname()[1]))
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "stage":
                transport.disallow_checkpoint()
                transport.send_checkpoint([1], msg[1], state, TIMEOUT)
                conn.send("staged")
            elif msg[0] == "raw":
                _serve_raw(listener, views, msg[1])
    listener.close()


def _serve_raw(listener: socket.socket, views: list[memoryview], connections: int) -> None:
    def send(sock: socket.socket, index: int) -> None:
        with sock:
            for view in views[index::connections]:
                sock.sendall(view)

    threads = []
    for _ in range(connections):
        sock, _ = listener.accept()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        index = sock.recv(1)[0]  # the share the receiver expects: connections arrive in any order
        threads.append(threading.Thread(target=send, args=(sock, index), name=f"bench-raw-{index}"))
        threads[-1].start()
    for thread in threads:
        thread.join()


def _raw_fetch(port: int, sizes: list[int], buffers: list[memoryview], connections: int) -> None:
    errors: list[BaseException] = []

    def recv(index: int) -> None:
        try:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
                sock.connect(("127.0.0.1", port))
                sock.sendall(bytes([index]))  # which share this connection carries
                for buf in buffers[index::connections]:
                    got = 0
                    while got < len(buf):
                        n = sock.recv_into(buf[got:])
                        if not n:
                            raise ConnectionError("raw source closed early")
                        got += n
        except BaseException as exc:  # reported by the caller: a short read must not count as a fast one
            errors.append(exc)

    threads = [threading.Thread(target=recv, args=(i,), name=f"bench-raw-recv-{i}") for i in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def bench_http(nbytes: int, reps: int) -> dict[str, float]:
    import torch

    from ft_core.checkpointing.http_transport import fetch
    from ft_core.checkpointing.serialization import tensor_bytes

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_source_main, args=(child, nbytes), name="bench-http-source", daemon=True)
    proc.start()
    try:
        url, raw_port = parent.recv()
        template = make_state(nbytes)
        local = {"model": {k: torch.ones_like(v) for k, v in template["model"].items()}}  # pre-faulted
        total = sum(t.numel() * 4 for t in template["model"].values())
        del template
        out: dict[str, list[float]] = {"raw": [], "fresh": [], "inplace": []}
        for rep in range(reps):
            parent.send(("raw", 2))
            start = time.perf_counter()
            _raw_fetch(raw_port, [], [tensor_bytes(t) for t in local["model"].values()], 2)
            out["raw"].append(time.perf_counter() - start)
            for mode in ("fresh", "inplace"):
                step = rep * 2 + (mode == "inplace")
                parent.send(("stage", step))
                parent.recv()
                start = time.perf_counter()
                result = fetch(url, step, TIMEOUT.total_seconds(), into=local if mode == "inplace" else None)
                out[mode].append(time.perf_counter() - start)
                del result
        parent.send(("stop",))
        proc.join(30)
    finally:
        _end(proc)
    return {"bytes": total, **{f"{k}_times": v for k, v in out.items()}}


# ---------------------------------------------------------------- torchft's HTTPTransport (same harness)


def _torchft_transport(timeout: timedelta) -> Any:
    """torchft's HTTPTransport as its Manager builds it (num_chunks=0), advertising 127.0.0.1 instead of the
    host name (name lookups can stall here)."""
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.checkpointing.http_transport import HTTPTransport

    transport = HTTPTransport(timeout=timeout, num_chunks=0)
    port = transport._server.socket.getsockname()[1]
    transport.address = lambda: f"http://127.0.0.1:{port}/checkpoint/"  # type: ignore[method-assign]
    transport._server.RequestHandlerClass.log_message = lambda *args: None  # one stderr line per request
    return transport


def _torchft_source_main(conn: Any, nbytes: int) -> None:
    _single_thread()
    state = make_state(nbytes)
    transport = _torchft_transport(TIMEOUT)
    try:
        conn.send(transport.metadata())
        while (msg := conn.recv())[0] != "stop":
            transport.disallow_checkpoint()
            transport.send_checkpoint([1], msg[1], state, TIMEOUT)
            conn.send("staged")
    finally:
        transport.shutdown()


def bench_torchft_http(nbytes: int, reps: int) -> list[float]:
    """Seconds per `recv_checkpoint` of torchft's HTTPTransport (fresh tensors, as a restarted replica)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_torchft_source_main, args=(child, nbytes), name="bench-torchft-source", daemon=True)
    proc.start()
    receiver = None
    try:
        if not parent.poll(120):
            raise TimeoutError("torchft source did not start")
        metadata = parent.recv()
        receiver = _torchft_transport(TIMEOUT)
        times = []
        for rep in range(reps):
            parent.send(("stage", rep))
            if not parent.poll(TIMEOUT.total_seconds()):
                raise TimeoutError("torchft source did not stage its checkpoint")
            parent.recv()
            start = time.perf_counter()
            result = receiver.recv_checkpoint(src_rank=0, metadata=metadata, step=rep, timeout=TIMEOUT)
            times.append(time.perf_counter() - start)
            del result
        parent.send(("stop",))
        proc.join(30)
    finally:
        if receiver is not None:
            receiver.shutdown()
        _end(proc)
    return times


# ---------------------------------------------------------------- a restarted replica's first fetch


def _first_fetch_main(kind: str, address: Any, step: int, conn: Any) -> None:
    """In a new process: one fetch into fresh tensors (ours), or one recv_checkpoint (torchft's), timed."""
    _single_thread()
    if kind == "ours":
        from ft_core.checkpointing.http_transport import fetch

        start = time.perf_counter()
        fetch(address, step, TIMEOUT.total_seconds())
        conn.send(time.perf_counter() - start)
        return
    receiver = _torchft_transport(TIMEOUT)
    try:
        start = time.perf_counter()
        receiver.recv_checkpoint(src_rank=0, metadata=address, step=step, timeout=TIMEOUT)
        conn.send(time.perf_counter() - start)
    finally:
        receiver.shutdown()


def bench_first_fetch(kind: str, nbytes: int, reps: int) -> list[float]:
    """Seconds of a fetch that is the first in its process (a restarted replica's heal): its memory is new to
    it, so every page is touched for the first time. A later fetch in one process can reuse pages the previous
    one freed (glibc keeps freed blocks of up to 32 MB in its heap), which flatters the "fresh" column's
    best-of-N for a transport that allocates per tensor (torchft's)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    source = ctx.Process(target=_source_main if kind == "ours" else _torchft_source_main, args=(child, nbytes),
                         name=f"bench-first-source-{kind}", daemon=True)
    source.start()
    times: list[float] = []
    try:
        if not parent.poll(120):
            raise TimeoutError(f"{kind} source did not start")
        sent = parent.recv()
        address = sent[0] if kind == "ours" else sent
        for rep in range(reps):
            parent.send(("stage", 1000 + rep))
            if not parent.poll(TIMEOUT.total_seconds()):
                raise TimeoutError(f"{kind} source did not stage its checkpoint")
            parent.recv()
            mine, theirs = ctx.Pipe()
            receiver = ctx.Process(target=_first_fetch_main, args=(kind, address, 1000 + rep, theirs),
                                   name=f"bench-first-{kind}", daemon=True)
            receiver.start()
            try:
                if not mine.poll(TIMEOUT.total_seconds()):
                    raise TimeoutError(f"{kind}'s first fetch produced no result")
                times.append(mine.recv())
            finally:
                _end(receiver, 30)
        parent.send(("stop",))
        source.join(30)
    finally:
        _end(source)
    return times


# ---------------------------------------------------------------- PG transport over two processes


def _pg_main(rank: int, port: int, nbytes: int, reps: int, conn: Any) -> None:
    _single_thread()
    import torch
    import torch.distributed as dist

    from ft_core.checkpointing import PGTransport

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = TIMEOUT
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(dist.PrefixStore("bench", store), rank, 2, options)
    transport = PGTransport(pg, timeout=TIMEOUT)
    state = make_state(nbytes) if rank == 0 else None
    times = []
    for rep in range(reps):
        pg.allreduce([torch.zeros(1)]).wait()  # barrier
        start = time.perf_counter()
        if rank == 0:
            transport.send_checkpoint([1], rep, state, TIMEOUT)
        else:
            result = transport.recv_checkpoint(0, "<n/a>", rep, TIMEOUT)
            times.append(time.perf_counter() - start)
            del result
    if rank == 1:
        conn.send(times)


def bench_pg(nbytes: int, reps: int) -> list[float]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_pg_main, args=(rank, store.port, nbytes, reps, child), name=f"bench-pg-{rank}",
                         daemon=True) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        if not parent.poll(TIMEOUT.total_seconds()):
            raise TimeoutError("PG benchmark produced no result")
        return parent.recv()
    finally:
        for proc in procs:
            _end(proc, 30)


# ---------------------------------------------------------------- driver


def run(quick: bool = False, sizes: list[int] | None = None, reps: int | None = None,
        baseline: bool = True) -> dict[str, Any]:
    """Measure every size; returns {"sizes": {label: metrics}, "target_gbps", "reference"}."""
    from benchmarks import _harness

    torchft = baseline and _harness.torchft_available()
    sizes = sizes or ([10 << 20, 100 << 20] if quick else [10 << 20, 100 << 20, 1 << 30])
    reps = reps or (2 if quick else 3)
    results: dict[str, Any] = {}
    for nbytes in sizes:
        label = f"{nbytes / (1 << 20):.0f}MB" if nbytes < 1 << 30 else f"{nbytes / (1 << 30):.0f}GB"
        http = bench_http(nbytes, reps)
        total = http["bytes"]
        times = {"raw_tcp": http["raw_times"], "http_fresh": http["fresh_times"],
                 "http_inplace": http["inplace_times"], "pg": bench_pg(nbytes, reps)}
        times["http_first"] = bench_first_fetch("ours", nbytes, reps)
        if torchft:
            times["torchft_http"] = bench_torchft_http(nbytes, reps)
            times["torchft_first"] = bench_first_fetch("torchft", nbytes, reps)
        row: dict[str, Any] = {"bytes": total}
        for key, values in times.items():  # the machine is shared: best shows capability, median typical
            row[f"{key}_s"] = min(values)
            row[f"{key}_median_s"] = statistics.median(values)
            row[f"{key}_gbps"] = total / min(values) / 1e9
            row[f"{key}_median_gbps"] = total / statistics.median(values) / 1e9
        row["http_inplace_vs_raw"] = row["http_inplace_gbps"] / row["raw_tcp_gbps"]
        row["http_fresh_vs_raw"] = row["http_fresh_gbps"] / row["raw_tcp_gbps"]
        if torchft:
            row["http_fresh_vs_torchft"] = row["http_fresh_gbps"] / row["torchft_http_gbps"]
            row["http_first_vs_torchft"] = row["http_first_gbps"] / row["torchft_first_gbps"]
        results[label] = row
    return {"sizes": results, "target_gbps": targets.HEAL_GBPS, "reference": REFERENCE, "reps": reps,
            "cpus": os.cpu_count(), "torchft_installed": _harness.torchft_available(),
            "kinds": ["raw_tcp", "http_fresh", "http_inplace", "pg", "http_first"]
            + (["torchft_http", "torchft_first"] if torchft else [])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=None, help="comma-separated, e.g. 10MB,100MB,1GB")
    parser.add_argument("--quick", action="store_true", help="10MB and 100MB, 2 repetitions")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--no-baseline", action="store_true", help="skip torchft's HTTPTransport even when installed")
    args = parser.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else None
    report = run(quick=args.quick, sizes=sizes, reps=args.reps, baseline=not args.no_baseline)
    print(f"checkpoint transport throughput on loopback ({report['cpus']} CPUs, best of {report['reps']}, "
          "median in brackets); "
          f"target >= {targets.HEAL_GBPS:g} GB/s for 1 GB over HTTP; {REFERENCE}")
    header = f"{'size':>6} | {'raw TCP':>22} | {'HTTP fresh':>22} | {'HTTP in place':>22} | {'PG (Gloo)':>22} | " \
             f"{'in place/raw':>12}"
    print(header)
    print("-" * len(header))
    for label, row in report["sizes"].items():
        cells = [f"{row[k + '_s']:.3f}s {row[k + '_gbps']:.2f} ({row[k + '_median_gbps']:.2f}) GB/s"
                 for k in ("raw_tcp", "http_fresh", "http_inplace", "pg")]
        print(f"{label:>6} | " + " | ".join(f"{c:>22}" for c in cells) + f" | {row['http_inplace_vs_raw']:>12.2f}")
        if "torchft_http_s" in row:
            print(f"{'':>6}   torchft HTTPTransport: {row['torchft_http_s']:.3f}s {row['torchft_http_gbps']:.2f} "
                  f"({row['torchft_http_median_gbps']:.2f}) GB/s; ours (fresh) / torchft {row['http_fresh_vs_torchft']:.2f}x")
        first = f"{'':>6}   first fetch in a new process (a restarted replica's heal): ours {row['http_first_s']:.3f}s " \
                f"{row['http_first_gbps']:.2f} ({row['http_first_median_gbps']:.2f}) GB/s"
        if "torchft_first_s" in row:
            first += f", torchft {row['torchft_first_s']:.3f}s {row['torchft_first_gbps']:.2f} " \
                     f"({row['torchft_first_median_gbps']:.2f}) GB/s; ours / torchft {row['http_first_vs_torchft']:.2f}x"
        print(first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
