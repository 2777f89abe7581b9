"""Warm spares: a rank's next incarnation, started ahead with torch and ft_core already imported.

A restarted rank spends most of its restart importing: on a 2-core VM Python and torch take ~1 s,
torch._dynamo (which the first optimizer step imports) ~1 s and ft_core 0.2 s, more while the
survivors keep the cores busy. A spare pays that before the failure: it imports, then waits on its
stdin for one line, the activation, and becomes the rank by running the rank's script in-process
(`runpy`, as `python SCRIPT` or `python -m MODULE` would). End of input instead of an activation ends
it quietly (dismissed).

The activation is one JSON line, never a pickle: {"argv": [python, SCRIPT | -m MODULE, ARGS...],
"env": {the rank's whole environment}, "output": a file to append stdout and stderr to, or null}.

Run as `python -m ft_core.tools.spares [--import MODULE]... [--ready-file PATH]`; the launcher
(`Launcher(spares=True)`, `ftl launch --spares`) owns its spares through `Spare`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from ft_core.tools.procs import exit_status, signal_group

# What every rank of an ft_core job imports; torch._dynamo is what the first optimizer step pulls in.
DEFAULT_IMPORTS = ("torch", "torch.distributed", "torch._dynamo", "ft_core.manager", "ft_core.ddp", "ft_core.optim",
                   "ft_core.process_groups", "ft_core.data")
DISMISS_WAIT_S = 10.0


def script_of(argv: Sequence[str]) -> tuple[str, str]:
    """("module", NAME) or ("path", SCRIPT) for a command `[python, SCRIPT | -m MODULE, ARGS...]`.

    Raises ValueError for anything a spare cannot become (another program, interpreter options)."""
    if len(argv) < 2 or not os.path.basename(argv[0]).startswith("python"):
        raise ValueError(f"a warm spare runs a Python script: the command must be [python, SCRIPT, ...] or "
                         f"[python, -m, MODULE, ...], got {list(argv)[:3]!r}; run without spares for other programs")
    if argv[1] == "-m":
        if len(argv) < 3 or not argv[2]:
            raise ValueError("a warm spare's command has `-m` without a module name")
        return "module", argv[2]
    if argv[1].startswith("-"):
        raise ValueError(f"a warm spare cannot pass interpreter options ({argv[1]!r}); set them through the "
                         f"environment (PYTHON* variables) or run without spares")
    return "path", argv[1]


def spare_argv(command: Sequence[str], imports: Sequence[str] = (), ready_file: str | None = None) -> list[str]:
    """The command line of a spare for `command` (same interpreter); ValueError if it cannot be one."""
    script_of(command)
    argv = [command[0], "-m", "ft_core.tools.spares"]
    for name in imports:
        argv += ["--import", name]
    if ready_file:
        argv += ["--ready-file", ready_file]
    return argv


@dataclass(frozen=True)
class Activation:
    """What a spare becomes: the rank's command line, its whole environment, where its output goes."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    output: str | None = None

    def encode(self) -> bytes:
        return json.dumps({"argv": list(self.argv), "env": dict(self.env), "output": self.output}).encode() + b"\n"

    @staticmethod
    def decode(line: bytes) -> Activation:
        """Parse and check one activation line; ValueError names what is wrong."""
        try:
            raw = json.loads(line)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"activation is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("activation is not a JSON object")
        argv, env, output = raw.get("argv"), raw.get("env"), raw.get("output")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError("activation's argv is not a list of strings")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("activation's env is not an object of strings")
        if output is not None and not isinstance(output, str):
            raise ValueError("activation's output is not a path")
        script_of(argv)
        return Activation(tuple(argv), env, output)


def become(activation: Activation) -> None:
    """Turn this process into the rank: its output, stdin from /dev/null, its environment, then its script."""
    kind, target = script_of(activation.argv)
    if activation.output:
        fd = os.open(activation.output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(activation.env)
    if kind == "module":
        sys.argv = [target, *activation.argv[3:]]  # run_module puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(activation.argv[1:])
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> int:
    """The spare process: import, say so (ready file), wait for the activation, become the rank."""
    parser = argparse.ArgumentParser(prog="python -m ft_core.tools.spares",
                                     description="Import torch and ft_core, then wait on stdin to become a rank.")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                        help="also import MODULE ahead (e.g. lightning); repeatable")
    parser.add_argument("--ready-file", default=None, help="create this file once the imports are done")
    args = parser.parse_args(argv)
    for name in (*DEFAULT_IMPORTS, *args.imports):
        try:
            importlib.import_module(name)
        except Exception as exc:  # the rank meets the same error when it imports it, and reports it as its own
            print(f"ft spare: could not import {name} ahead: {type(exc).__name__}: {exc}", file=sys.stderr)
    if args.ready_file:
        with open(args.ready_file + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(args.ready_file + ".tmp", args.ready_file)
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0  # dismissed
    try:
        activation = Activation.decode(line)
    except ValueError as exc:
        print(f"ft spare: bad activation, not starting the rank: {exc}", file=sys.stderr)
        return 2
    become(activation)
    return 0


class Spare:
    """One spare process for one rank, owned by its launcher: activated once, or dismissed.

    It runs in its own session, like a rank, so dismissing it (SIGKILL to its process group) ends
    whatever it started; it is never reaped before that signal (see ft_core.tools.procs).
    """

    def __init__(self, command: Sequence[str], env: Mapping[str, str], *, stdout: Any = None,
                 imports: Sequence[str] = (), ready_file: str | None = None) -> None:
        self.ready_file = ready_file
        self.proc = subprocess.Popen(spare_argv(command, imports, ready_file), env=dict(env), stdin=subprocess.PIPE,
                                     stdout=stdout, stderr=subprocess.STDOUT if stdout is not None else None,
                                     start_new_session=True)

    def alive(self) -> bool:
        return exit_status(self.proc) is None

    def activate(self, argv: Sequence[str], env: Mapping[str, str], output: str | None = None) -> subprocess.Popen:
        """Hand it the rank to become; returns its process, now the rank's. OSError if it died meanwhile, or if
        the line does not fit in the pipe at once (never blocks: a stopped spare would not read it)."""
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        line = Activation(tuple(argv), env, output).encode()
        try:
            os.set_blocking(stdin.fileno(), False)
            written = os.write(stdin.fileno(), line)
            stdin.close()
        except (BrokenPipeError, ValueError) as exc:  # it ended (a failed import, the OOM killer)
            raise OSError(f"warm spare pid {self.proc.pid} ended before its activation: {exc}") from exc
        except BlockingIOError as exc:
            raise OSError(f"warm spare pid {self.proc.pid} is not reading its activation: {exc}") from exc
        if written < len(line):
            raise OSError(f"warm spare pid {self.proc.pid}: the activation ({len(line)} bytes, the environment "
                          f"included) is larger than its pipe takes at once ({written} bytes)")
        return self.proc

    def dismiss(self) -> None:
        """End the spare and reap it (bounded: SIGKILL, then at most DISMISS_WAIT_S)."""
        signal_group(self.proc, signal.SIGKILL)
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=DISMISS_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.ready_file:
            try:
                os.remove(self.ready_file)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main())
