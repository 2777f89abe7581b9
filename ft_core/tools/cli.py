"""`ftl`: one command, subcommands dispatched lazily so `ftl lighthouse` never imports torch's heavy parts.

Each subcommand lives in the module that owns it and exposes `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "lighthouse": ("ft_core.control.lighthouse", "run the quorum server (one per job)"),
    "launch": ("ft_core.tools.launch_command", "run N replica groups on this machine, with restarts and fault injection"),
    "status": ("ft_core.tools.status", "show the lighthouse's quorum and members"),
    "demo": ("ft_lightning.demo", "the whole story on one machine: train, kill, heal, report"),
    "accelerate": ("ft_lightning.accelerate.cli", "`ftl accelerate config|launch` for Hugging Face Accelerate"),
    "chaos": ("ft_core.tools.chaos", "seeded random fault schedules against a real training job"),
}


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
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
