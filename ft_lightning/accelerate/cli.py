"""`ftl accelerate config|launch`: fault-tolerance settings for `accelerate launch` users.

`config` writes our own settings file (Accelerate's YAML rejects unknown keys, so we never touch
it). `launch` reads that file and its own flags, exports the settings as FT_* environment
variables (which `accelerate launch` passes through to every worker) and hands every other
argument to Accelerate's own launcher, in this process. One replica group = one launch.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from ft_core.errors import ConfigError
from ft_lightning.accelerate.config import (
    default_config_path,
    flag_name,
    load_config,
    resolve_launch_settings,
    save_config,
)
from ft_lightning.accelerate.plugin import SETTINGS, parse_setting, settings_to_env

USAGE = """usage: ftl accelerate <command> [options]

commands:
  config   write the fault-tolerance settings file (interactive on a terminal, or from flags)
  launch   run one replica group: `ftl accelerate launch [--ft-config FILE] [--replica-group-id N]
           [fault-tolerance flags] [accelerate launch options] script.py [script args]`

`ftl accelerate <command> --help` for the options of one command."""


def _console(stderr: bool = False) -> Any:
    from rich.console import Console

    return Console(stderr=stderr, highlight=False)


def _add_setting_flags(add: Any, dest_prefix: str, underscore_only: bool) -> None:
    """One flag per setting; `underscore_only` lets Accelerate's parser add the dashed spelling itself."""
    for s in SETTINGS:
        name = flag_name(s.name)
        spellings = [f"--{name.replace('-', '_')}"] if underscore_only else [f"--{name}"]
        if not underscore_only and "-" in name:
            spellings.append(f"--{name.replace('-', '_')}")
        add(*spellings, dest=dest_prefix + s.name, default=None, metavar=_metavar(s.kind),
            help=f"{s.help} [{s.env}]")


def _metavar(kind: str) -> str:
    if kind == "boolean":
        return "{true,false}"
    return "{" + kind.replace("|", ",") + "}" if "|" in kind else kind.upper()


def _mask(values: Mapping[str, Any]) -> dict[str, Any]:
    return {k: ("***" if k == "token" and v else v) for k, v in values.items()}


# --- config -------------------------------------------------------------------------------------------------

def _config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ftl accelerate config",
        description="Write the fault-tolerance settings file read by `ftl accelerate launch`. Asks for each "
                    "setting on a terminal (Enter keeps the shown default); with --no-input, or without a "
                    "terminal, writes the flags given (merged into an existing file).")
    parser.add_argument("--config-file", "--config_file", dest="config_file", default=None,
                        help=f"where to write (default: {default_config_path()})")
    parser.add_argument("--no-input", "--no_input", dest="no_input", action="store_true",
                        help="never ask; write the flags given")
    _add_setting_flags(parser.add_argument, "", underscore_only=False)
    return parser


def _ask(setting_name: str, current: Any) -> Any:
    from rich.prompt import Prompt

    s = next(x for x in SETTINGS if x.name == setting_name)
    if s.kind == "boolean":
        from rich.prompt import Confirm

        return Confirm.ask(f"{s.help}?", default=bool(current))
    default = "" if current is None else str(current)
    while True:
        raw = Prompt.ask(f"{s.help} [dim]({s.env})[/dim]", default=default, password=s.name == "token",
                         show_default=s.name != "token")
        if raw is None or str(raw).strip() == "":
            return None
        try:
            return parse_setting(s.name, raw, "answer")
        except ConfigError as exc:
            _console().print(f"[red]{exc}[/red]")


def config_main(argv: list[str]) -> int:
    args = _config_parser().parse_args(argv)
    path = args.config_file or default_config_path()
    values: dict[str, Any] = load_config(path) if os.path.isfile(path) else {}
    for s in SETTINGS:
        flag = getattr(args, s.name)
        if flag is not None:
            values[s.name] = parse_setting(s.name, flag, f"--{flag_name(s.name)}")
    interactive = not args.no_input and sys.stdin.isatty() and sys.stdout.isatty()
    if interactive:
        _console().print(f"Fault-tolerance settings for [bold]{path}[/bold] (Enter keeps the default):")
        for s in SETTINGS:
            if getattr(args, s.name) is not None or s.name == "replica_group_id":
                continue  # given as a flag; the group index belongs to each launch (--replica-group-id)
            values[s.name] = _ask(s.name, values.get(s.name, s.default))
    values = {k: v for k, v in values.items() if v is not None}
    save_config(path, values)
    console = _console()
    console.print(f"wrote {path}")
    for name, value in _mask(values).items():
        console.print(f"  {name}: {value}")
    return 0


# --- launch -------------------------------------------------------------------------------------------------

LAUNCH_DEST = "ftl_"

LAUNCH_HELP = """usage: ftl accelerate launch [--ft-config FILE] [fault-tolerance flags] [accelerate launch options]
                            script.py [script args]

Runs one replica group with Accelerate's own launcher, after exporting the fault-tolerance
settings as environment variables (FT_LIGHTHOUSE, REPLICA_GROUP_ID, ...). Precedence: a flag
here, then a variable already set in the environment, then the config file. Every
`accelerate launch` option is accepted (see `accelerate launch --help`). `--cpu --num_processes N`
(N > 1) runs N CPU processes through torchrun (plain `accelerate launch` would start one).

fault-tolerance options:
  --ft-config FILE      settings file (default: {default}, when it exists)
{flags}"""


def _launch_help() -> str:
    lines = []
    for s in SETTINGS:
        lines.append(f"  --{flag_name(s.name)} {_metavar(s.kind)}\n                        {s.help} [{s.env}]")
    return LAUNCH_HELP.format(default=default_config_path(), flags="\n".join(lines))


def _launch_parser() -> argparse.ArgumentParser:
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    parser.prog = "ftl accelerate launch"
    group = parser.add_argument_group("Fault tolerance (ft-lightning)")
    group.add_argument("--ft_config", dest=LAUNCH_DEST + "config", default=None, metavar="FILE")
    _add_setting_flags(group.add_argument, LAUNCH_DEST, underscore_only=True)

    def print_help(file: Any = None) -> None:
        print(_launch_help(), file=file or sys.stdout)

    parser.print_help = print_help  # type: ignore[method-assign]
    return parser


def split_launch_args(args: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """Take our options off the parsed namespace (Accelerate must not see them): (config path, flags)."""
    config = getattr(args, LAUNCH_DEST + "config")
    flags = {s.name: getattr(args, LAUNCH_DEST + s.name) for s in SETTINGS}
    for dest in [LAUNCH_DEST + "config", *(LAUNCH_DEST + s.name for s in SETTINGS)]:
        delattr(args, dest)
        if hasattr(args, "nondefault"):
            args.nondefault.discard(dest)
    return config, flags


def run_cpu_processes_with_torchrun(args: argparse.Namespace, environ: dict[str, str]) -> bool:
    """`--cpu --num_processes N>1` (or a MULTI_CPU accelerate config) without MPI: Accelerate's simple
    launcher would start ONE process; start N through torchrun instead, on CPU. Returns True if changed."""
    wants_cpu = bool(args.cpu)
    num_processes = args.num_processes
    if not wants_cpu and args.config_file is not None and not args.multi_gpu:
        from accelerate.commands.config.config_args import load_config_from_file

        defaults = load_config_from_file(args.config_file)
        wants_cpu = str(getattr(defaults, "distributed_type", "")).endswith("MULTI_CPU")
        num_processes = num_processes if num_processes is not None else defaults.num_processes
    if not wants_cpu or num_processes is None or num_processes <= 1 or args.mpirun_hostfile is not None:
        return False
    args.cpu = False
    args.multi_gpu = True
    args.num_processes = num_processes
    environ["ACCELERATE_USE_CPU"] = "true"
    return True


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _prctl() -> Any:
    """libc's prctl, resolved before any fork (None off Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


@contextlib.contextmanager
def workers_in_our_process_group() -> Iterator[None]:
    """While Accelerate runs torchrun in this process, start its workers in OUR process group.

    torchrun starts each worker in a session of its own, so a kill of the launcher's process group
    (a job scheduler, `ftl launch`, Ctrl-C in a terminal) left them running: a second incarnation of
    the same replica group then met the old one in the quorum. Here they stay in the launcher's
    process group, and torchrun signals each worker directly when it stops them. On Linux each worker
    also gets SIGKILL when the launcher dies (PR_SET_PDEATHSIG), so a kill of the launcher alone ends
    them too.
    """
    from torch.distributed.elastic.multiprocessing import api as elastic_api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import (
        SubprocessHandler,
    )

    prctl = _prctl()

    def die_with_launcher() -> None:  # runs in the child between fork and exec: no allocation, no imports
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))

    class SameGroupHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> subprocess.Popen:
            return subprocess.Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr,
                                    preexec_fn=die_with_launcher)

        def close(self, death_sig: Any = None) -> None:
            if self.proc.poll() is None:
                self.proc.send_signal(death_sig or signal.SIGTERM)
            for stream in (self._stdout, self._stderr):
                if stream:
                    stream.close()

    def get_handler(entrypoint: str, args: tuple, env: dict[str, str], stdout: Any, stderr: Any,
                    local_rank_id: int, numa_options: Any = None) -> SubprocessHandler:
        return SameGroupHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                                local_rank_id=local_rank_id, numa_options=numa_options)

    previous = elastic_api.get_subprocess_handler
    elastic_api.get_subprocess_handler = get_handler
    try:
        yield
    finally:
        elastic_api.get_subprocess_handler = previous


def _print_launch_summary(values: Mapping[str, Any], sources: Mapping[str, str], config_path: str | None) -> None:
    console = _console(stderr=True)
    where = f" (config file {config_path})" if config_path else ""
    console.print(f"[bold]ftl accelerate launch[/bold]: fault-tolerance settings{where}")
    for name, value in _mask(values).items():
        console.print(f"  {name} = {value}  [dim]<- {sources[name]}[/dim]")
    if "lighthouse" not in values:
        console.print("  [yellow]no lighthouse address from flags, environment or config file: the script "
                      "must pass FaultTolerancePlugin(lighthouse=...)[/yellow]")


def launch_main(argv: list[str]) -> int:
    parser = _launch_parser()
    args = parser.parse_args(argv)
    config_path, flags = split_launch_args(args)
    if config_path is None and os.path.isfile(default_config_path()):
        config_path = default_config_path()
    file_values = load_config(config_path) if config_path else {}
    values, sources = resolve_launch_settings(file_values, os.environ, flags)
    exported = {name: value for name, value in values.items() if sources[name] in ("flag", "config file")}
    os.environ.update(settings_to_env(exported))
    run_cpu_processes_with_torchrun(args, os.environ)  # type: ignore[arg-type]
    _print_launch_summary(values, sources, config_path)

    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        with workers_in_our_process_group():
            launch_command(args)
    except subprocess.CalledProcessError as exc:  # the one worker of a single-process group failed
        _console(stderr=True).print(f"[red]replica group worker exited with status {exc.returncode}[/red]")
        return exc.returncode if exc.returncode and exc.returncode > 0 else 1
    except ChildFailedError as exc:  # a worker of a multi-process group (torchrun) failed
        _console(stderr=True).print(f"[red]replica group worker failed: {exc}[/red]")
        return 1
    return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    try:
        if command == "config":
            return config_main(rest)
        if command == "launch":
            return launch_main(rest)
    except ConfigError as exc:
        print(f"ftl accelerate {command}: {exc}", file=sys.stderr)
        return 2
    print(f"ftl accelerate: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2
