"""`ftl`: one command, subcommands dispatched lazily so `ftl lighthouse` never imports torch's heavy parts.

Each subcommand lives in the module that owns it and exposes `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

from ft_core.errors import ConfigError
from ft_core.tools.stop_signals import StopSignals

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "lighthouse": ("ft_core.control.lighthouse", "run the quorum server (one per job)"),
    "launch": ("ft_core.tools.launch_command", "run N replica groups on this machine, with restarts and fault injection"),
    "status": ("ft_core.tools.status", "show the lighthouse's quorum and members"),
    "demo": ("ft_lightning.demo", "the whole story on one machine: train, kill, heal, report"),
    "accelerate": ("ft_lightning.accelerate.cli", "`ftl accelerate config|launch` for Hugging Face Accelerate"),
    "chaos": ("ft_core.tools.chaos", "seeded random fault schedules against a real training job"),
    "settings": ("ft_core.settings", "the settings (environment variables) and their values here; --markdown: the table"),
}

# Commands whose Ctrl-C handler is installed before their module is imported and handed to `main(argv, stop=...)`:
# a Ctrl-C during those imports is then a stop request (exit 130, nothing started) instead of a KeyboardInterrupt
# raised wherever the import happens to be (a traceback, or lost for good inside a finaliser).
STOP_BEFORE_IMPORT = frozenset({"launch"})


def usage() -> str:
    lines = ["usage: ftl <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    lines += ["", "`ftl <command> --help` for the options of one command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"ftl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    stop = StopSignals() if name in STOP_BEFORE_IMPORT else None
    try:
        return _run(name, rest, stop)
    finally:
        if stop is not None:
            stop.restore()


def _run(name: str, rest: list[str], stop: StopSignals | None) -> int:
    try:
        module = importlib.import_module(SUBCOMMANDS[name][0])
    except ModuleNotFoundError as exc:
        return _missing_dependency(name, exc)
    try:
        return int((module.main(rest) if stop is None else module.main(rest, stop=stop)) or 0)
    except ModuleNotFoundError as exc:  # imported lazily by the subcommand (`ftl accelerate launch`)
        return _missing_dependency(name, exc)
    except ConfigError as exc:  # a bad setting: one or two lines naming the cause and the fix, no traceback
        print(config_error_message(name, exc), file=sys.stderr)
        return 2


def _missing_dependency(command: str, exc: ModuleNotFoundError) -> int:
    """An optional dependency (accelerate, lightning) is not installed: say which and how to get it."""
    missing = (exc.name or "").split(".")[0]
    if not missing or missing in ("ft_core", "ft_lightning"):
        raise exc  # our own package is broken: that is a bug, keep the traceback
    print(f"ftl {command}: needs the Python package {missing!r}, which is not installed; "
          f"install it (pip install {missing}) and try again", file=sys.stderr)
    return 2


def config_error_message(command: str, exc: BaseException) -> str:
    """`ftl COMMAND: error: ...` without repeating a prefix the message already carries."""
    text = " ".join(str(exc).split())
    prefix = f"ftl {command}: "
    while text.startswith(prefix):
        text = text[len(prefix):]
    return f"{prefix}error: {text}"


if __name__ == "__main__":
    raise SystemExit(main())
