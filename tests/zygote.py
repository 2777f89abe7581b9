"""Test worker processes forked from an interpreter that has imported torch once.

Most of the suite's CPU went into child processes importing torch and torch._dynamo (which torch's DDP
and every optimizer import on first use): about 3 s of CPU per process, hundreds of processes, on CI's
2 cores. `Processes.spawn` (tests/conftest.py) sends `python script.py ...` and `python -m module ...`
here instead: this server, one per pytest process, forks a child that takes the test's environment,
working directory, output files and session, and runs the script as `__main__` (torch's forkserver with
preload and DataLoader's fork workers do the same). The child is a real process: it is signalled, killed
and exits as one, and its pid stays reserved until the test reaps it, as a `subprocess.Popen` child's
does (the server reports an exit without reaping, and reaps when the handle is polled or waited on).
What the tests do not exercise this way is importing torch, which is not ours; benchmarks/ times a real
cold start. Children of one server share its hash seed (string hashing, so set order) where fresh
interpreters each draw their own: two servers with different seeds take spawns in turn, so the groups of
one test mostly differ in it, as fresh ones would (the chaos runs, the demo and the simulated-host tests
start fresh interpreters throughout). A child's command line in /proc (and `ps`) stays the server's.
FT_TEST_FRESH_PROCESSES=1 starts every child as a fresh interpreter.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

# torch only: Lightning and Accelerate are imported by each child, so ft_lightning's registration on their
# import (ft_lightning/_registration.py) runs as in a user's process
PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "torch.distributed.run",
           "torch.utils.data")
_INHERITED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PLAIN_KWARGS = {"env", "stdout", "stderr", "stdin", "cwd", "start_new_session", "text", "universal_newlines",
                 "encoding", "errors"}


def _target(args: list[str]) -> tuple[str, str] | None:
    """("path", script) or ("module", name) for `python script.py ...` or `python -m name ...`, else None."""
    if len(args) < 2 or args[0] != sys.executable:
        return None
    if args[1] == "-m" and len(args) > 2:
        return "module", args[2]
    if args[1].endswith(".py") and os.path.isfile(args[1]):
        return "path", args[1]
    return None


def eligible(args: list[str], env: dict[str, str], kwargs: dict[str, Any]) -> bool:
    """Whether a spawn can be served here: a script or module run, output to files (no pipes)."""
    if os.environ.get("FT_TEST_FRESH_PROCESSES") == "1" or _target(args) is None or set(kwargs) - _PLAIN_KWARGS:
        return False
    if "PYTHONHASHSEED" in env:  # a seed asked for: only a fresh start sets it
        return False
    if kwargs.get("stdin") not in (None, subprocess.DEVNULL):
        return False
    if kwargs.get("cwd") and not os.path.isabs(args[1]) and args[1] != "-m":  # resolved from another directory
        return False
    return all(kwargs.get(k) is not subprocess.PIPE for k in ("stdout", "stderr"))


class ForkedProcess:
    """The subprocess.Popen surface the tests use, for a child of the zygote."""

    def __init__(self, zygote: "Zygote", args: list[str], pid: int) -> None:
        self._zygote = zygote
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = self.stdout = self.stderr = None  # no pipes (those spawns are not served here)
        self._exit: int | None = None  # reported by the zygote, not yet reaped
        self._orphaned = False  # the zygote ended first: its exit can no longer be known
        self._exited = threading.Event()
        self._reap_lock = threading.Lock()

    def _reported(self, code: int) -> None:
        self._exit = code
        self._exited.set()

    def _orphan(self) -> None:
        self._orphaned = True
        self._exited.set()

    def poll(self) -> int | None:
        with self._reap_lock:  # one reap: a second, after the pid was reused, would reap another child
            if self._orphaned and self.returncode is None:
                raise RuntimeError(f"the test zygote ended while its child {self.pid} ran: that child's exit "
                                   f"cannot be known (run with FT_TEST_FRESH_PROCESSES=1 to bypass the zygote)")
            if self.returncode is None and self._exited.is_set():
                self._zygote.send({"op": "reap", "pid": self.pid})  # from now on the pid may be reused
                self._zygote.forget(self)
                self.returncode = self._exit
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        code = self.poll()
        assert code is not None
        return code

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[None, None]:  # noqa: A002
        self.wait(timeout)
        return None, None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # unreaped: the pid is still this child's (a zombie at worst)
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def __enter__(self) -> "ForkedProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.wait()


class Zygote:
    """The client: SERVERS servers per pytest process (each its own hash seed), started on first use and
    taking spawns in turn, ended when the pytest process exits."""

    SERVERS = 2
    _pool: "list[Zygote | None]" = [None] * SERVERS
    _turn = 0
    _pool_lock = threading.Lock()

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
                                      pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL)
        theirs.close()
        self._sock = ours
        self._send_lock = threading.Lock()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before the spawn's answer was read
        self._answers: dict[int, Any] = {}
        self._answered = threading.Condition()
        self._next = 0
        self._ready = threading.Event()
        self._dead = False
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    @classmethod
    def get(cls, env: dict[str, str]) -> "Zygote":
        with cls._pool_lock:
            if not any(cls._pool):
                atexit.register(cls.shutdown_all)
            cls._turn = (cls._turn + 1) % cls.SERVERS
            server = cls._pool[cls._turn]
            if server is None or server._dead:
                seed = str(int.from_bytes(os.urandom(4), "little"))
                server = cls._pool[cls._turn] = Zygote({**env, "PYTHONHASHSEED": seed})
            return server

    @classmethod
    def shutdown_all(cls) -> None:
        with cls._pool_lock:
            servers, cls._pool = [s for s in cls._pool if s is not None], [None] * cls.SERVERS
        for server in servers:
            server.shutdown()

    def shutdown(self, timeout: float = 10.0) -> None:
        """End the server: it kills the children still running (their tests have ended them already)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout)

    def send(self, msg: dict[str, Any], fds: list[int] | None = None) -> None:
        with self._send_lock:
            socket.send_fds(self._sock, [json.dumps(msg).encode()], fds or [])

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "ready" in msg:
                self._ready.set()
            elif "exited" in msg:
                with self._answered:
                    child = self._children.get(msg["exited"])
                    if child is None:
                        self._early[msg["exited"]] = msg["code"]
                if child is not None:
                    child._reported(msg["code"])
            else:
                with self._answered:
                    self._answers[msg["id"]] = msg
                    self._answered.notify_all()
        self._dead = True
        self._ready.set()
        with self._answered:
            self._answered.notify_all()
            orphans = [c for c in self._children.values() if not c._exited.is_set()]
        for child in orphans:  # a wait on them would never end otherwise
            child._orphan()

    def spawn(self, args: list[str], env: dict[str, str], kwargs: dict[str, Any]) -> ForkedProcess:
        if not self._ready.wait(120) or self._dead:
            raise RuntimeError("the test zygote did not start (set FT_TEST_FRESH_PROCESSES=1 to bypass it)")
        kind, what = _target(args)  # type: ignore[misc]
        opened, fds = [], []
        for name, default in (("stdin", None), ("stdout", 1), ("stderr", 2)):
            target = kwargs.get(name)
            if name == "stderr" and target is subprocess.STDOUT:
                fds.append(fds[1])
            elif target is None:
                fds.append(default if default is not None else _devnull(opened))
            elif target is subprocess.DEVNULL:
                fds.append(_devnull(opened))
            else:
                fds.append(target if isinstance(target, int) else target.fileno())
        with self._answered:
            self._next += 1
            ident = self._next
        # what a fresh child would inherit across exec from this process: the signals it ignores
        ignored = [int(sig) for sig in _INHERITED if signal.getsignal(sig) is signal.SIG_IGN]
        msg = {"op": "spawn", "id": ident, "kind": kind, "what": what, "argv": args[1:] if kind == "path" else
               [what, *args[3:]], "env": env, "cwd": kwargs.get("cwd"),
               "session": bool(kwargs.get("start_new_session")), "ignored": ignored}
        try:
            self.send(msg, fds)
        finally:
            for fd in opened:
                os.close(fd)
        deadline = time.monotonic() + 60
        with self._answered:
            while ident not in self._answers:
                if self._dead or not self._answered.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError("the test zygote did not answer a spawn")
            answer = self._answers.pop(ident)
            if "error" in answer:
                raise OSError(answer["error"])
            child = ForkedProcess(self, args, answer["pid"])
            self._children[child.pid] = child
            early = self._early.pop(child.pid, None)
        if early is not None:
            child._reported(early)
        return child

    def forget(self, child: ForkedProcess) -> None:
        with self._answered:
            if self._children.get(child.pid) is child:
                del self._children[child.pid]


def _devnull(opened: list[int]) -> int:
    fd = os.open(os.devnull, os.O_RDWR)
    opened.append(fd)
    return fd


# ---------------------------------------------------------------------------------------------- the server


def _run_child(sock: socket.socket, wake: tuple[int, int], ready: int, msg: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become the process the test asked for, run it, exit as Python would. `ready` is
    written once the child is set up (its session made): the spawn returns after that, as Popen's after exec."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for sig in _INHERITED:
            if int(sig) in msg["ignored"]:
                signal.signal(sig, signal.SIG_IGN)
            else:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        sock.close()
        for fd in wake:
            os.close(fd)
        if msg["session"]:
            os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        if msg["cwd"]:
            os.chdir(msg["cwd"])
        os.environ.clear()
        os.environ.update(msg["env"])
        _prepare_interpreter(msg)
        os.write(ready, b"1")
        os.close(ready)
        if msg["kind"] == "module":
            import runpy
            sys.argv = list(msg["argv"])
            runpy.run_module(msg["what"], run_name="__main__", alter_sys=True)
        else:
            import runpy
            sys.argv = list(msg["argv"])
            runpy.run_path(msg["what"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except KeyboardInterrupt:  # as CPython does: end by the signal, so the parent sees -SIGINT
        _finish()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    _finish()
    os._exit(code)


def _exit_code(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """What interpreter shutdown does before exiting: wait for non-daemon threads, run atexit, flush."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:  # noqa: S110 (shutdown must go on)
        pass
    import atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:  # noqa: S110
            pass


def _prepare_interpreter(msg: dict[str, Any]) -> None:
    import io
    import random
    env = msg["env"]
    first = os.path.dirname(os.path.abspath(msg["what"])) if msg["kind"] == "path" else os.getcwd()
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in extra]
    sys.path[:] = [first, *extra, *base]
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw = io.FileIO(fd, "w", closefd=False)
        buffered = raw if unbuffered else io.BufferedWriter(raw)
        setattr(sys, name, io.TextIOWrapper(buffered, encoding="utf-8", errors="backslashreplace",  # type: ignore
                                            line_buffering=name == "stderr", write_through=unbuffered))
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    random.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    if env.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()


def serve(fd: int) -> None:
    import importlib
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    sock = socket.socket(fileno=fd)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    live: dict[int, bool] = {}  # pid -> exit reported (reaped only when the test's handle asks)

    def reply(msg: dict[str, Any]) -> None:
        sock.send(json.dumps(msg).encode())

    reply({"ready": True})
    while True:
        readable, _, _ = select.select([sock, wake_r], [], [], 1.0)
        if wake_r in readable:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        for pid, reported in list(live.items()):
            if reported:
                continue
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = None
            if info is not None:
                live[pid] = True
                code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
                reply({"exited": pid, "code": code})
        if sock not in readable:
            continue
        data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 20, 8)
        if not data:  # the pytest process ended: end what it left, then go
            for pid in live:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            return
        msg = json.loads(data)
        if msg["op"] == "reap":
            if live.pop(msg["pid"], None) is not None:
                os.waitpid(msg["pid"], 0)
            continue
        ready_r, ready_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            reply({"id": msg["id"], "error": str(exc)})
        else:
            if pid == 0:
                os.close(ready_r)
                _run_child(sock, (wake_r, wake_w), ready_w, msg, fds)  # never returns
            live[pid] = False
            os.close(ready_w)
            ready_w = -1
            select.select([ready_r], [], [], 30.0)  # set up (or dead: the pipe closes)
            reply({"id": msg["id"], "pid": pid})
        for fd in {*fds, ready_r, ready_w} - {-1}:
            os.close(fd)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
