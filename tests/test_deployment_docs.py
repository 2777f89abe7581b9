"""docs/deployment.md matches the code: every environment variable its recipes use is in ft_core.settings'
table (or is one of torch's, torchrun's, NCCL's, Slurm's or Kubernetes' own), and every flag given to
`ftl ...` or `torchrun` is accepted by that command's real argparse parser."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, child_env

from ft_core import settings
from ft_core.tools import cli, launch_command

DOC = Path(REPO_ROOT) / "docs" / "deployment.md"
# Variables that belong to the tools around us, not to ft-lightning's table.
FOREIGN_VARIABLES = {
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT",
    "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES", "JOB_COMPLETION_INDEX",
}
FOREIGN_PREFIXES = ("SLURM_",)
SHELL_OPERATORS = {"&&", "||", "&", "|", ";"}
FLAG = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_-]*")


def table_variables() -> set[str]:
    return {name for s in settings.SETTINGS for name in (s.env, *s.aliases)}


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block."""
    return re.findall(r"```(\w*)\n(.*?)```", text, flags=re.DOTALL)


def inline_spans(text: str) -> list[str]:
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.findall(r"`([^`\n]+)`", prose)


def shell_lines(body: str) -> list[str]:
    """Logical lines (backslash continuations joined), comments dropped."""
    joined = body.replace("\\\n", " ")
    return [line.split(" #")[0].strip() for line in joined.splitlines() if line.strip() and
            not line.strip().startswith("#")]


def yaml_commands_and_env(body: str) -> tuple[list[list[str]], set[str]]:
    commands, names = [], set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("command"), list):
                commands.append([str(x) for x in node["command"]])
            for item in node.get("env") or []:
                if isinstance(item, dict) and "name" in item:
                    names.add(str(item["name"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for document in yaml.safe_load_all(body):
        walk(document)
    return commands, names


def commands_in(tokens: list[str]) -> list[tuple[str, list[str]]]:
    """(command, its flags) for each `ftl SUB [SUB2]` or `torchrun` in a token list; a command's flags
    end at its script (a .py token), at `--` or at a shell operator."""
    found = []
    for i, token in enumerate(tokens):
        if token == "ftl" and i + 1 < len(tokens):
            name = tokens[i + 1]
            start = i + 2
            if name == "accelerate" and i + 2 < len(tokens):
                name, start = f"accelerate {tokens[i + 2]}", i + 3
        elif token == "torchrun":
            name, start = "torchrun", i + 1
        else:
            continue
        flags = []
        for tok in tokens[start:]:
            if tok in SHELL_OPERATORS or tok.endswith(".py") or tok == "--":  # `--`: the script follows
                break
            if tok.startswith("--"):
                flags.append(tok.split("=", 1)[0])
        found.append((name, flags))
    return found


def recipe_commands(text: str) -> list[tuple[str, list[str]]]:
    out = []
    for lang, body in code_blocks(text):
        if lang == "yaml":
            for command in yaml_commands_and_env(body)[0]:
                out += commands_in(command)
        else:
            for line in shell_lines(body):
                out += commands_in(shlex.split(line))
    for span in inline_spans(text):
        if "ftl " in span or "torchrun " in span:
            out += commands_in(shlex.split(span))
    return out


def variables_used(text: str) -> set[str]:
    """Environment variables the recipes set or read: VAR=..., export VAR, $VAR / ${VAR}, k8s env names,
    and any FT_* / TORCHFT_* name mentioned in code."""
    used: set[str] = set()
    pieces = [body for _, body in code_blocks(text)] + inline_spans(text)
    for piece in pieces:
        used |= set(re.findall(r"(?<![\w-])([A-Z][A-Z0-9_]+)=", piece))
        used |= set(re.findall(r"export\s+([A-Z][A-Z0-9_]+)", piece))
        used |= set(re.findall(r"\$\{?([A-Z][A-Z0-9_]+)", piece))
        used |= set(re.findall(r"\b((?:TORCH)?FT_[A-Z0-9_]+)\b", piece))
    for lang, body in code_blocks(text):
        if lang == "yaml":
            used |= yaml_commands_and_env(body)[1]
    return used


@cache
def help_flags(*command: str) -> frozenset[str]:
    """The option strings a command's real parser prints in --help (for parsers built inside main())."""
    result = subprocess.run([sys.executable, "-m", "ft_core", *command, "--help"], capture_output=True, text=True,
                            timeout=60, env=child_env(COLUMNS="200"), check=False)
    assert result.returncode == 0, result.stderr
    return frozenset(FLAG.findall(result.stdout))


def parser_flags(command: str) -> frozenset[str]:
    if command == "torchrun":
        from torch.distributed.run import get_args_parser

        return frozenset(get_args_parser()._option_string_actions)
    if command == "launch":
        return frozenset(launch_command.build_parser()._option_string_actions)
    if command == "accelerate launch":
        from ft_lightning.accelerate.cli import _launch_parser

        return frozenset(_launch_parser()._option_string_actions)
    if command in ("lighthouse", "status"):
        return help_flags(command)
    raise AssertionError(f"docs/deployment.md runs `ftl {command}`, which this test does not know; add its parser")


TEXT = DOC.read_text(encoding="utf-8")


def test_the_recipes_use_only_variables_that_exist():
    used = variables_used(TEXT)
    assert {"FT_LIGHTHOUSE", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS", "FT_HOST", "FT_BIND_ALL", "FT_TOKEN",
            "GLOO_SOCKET_IFNAME", "SLURM_JOB_NODELIST"} <= used, sorted(used)
    known = table_variables() | FOREIGN_VARIABLES
    unknown = sorted(v for v in used if v not in known and not v.startswith(FOREIGN_PREFIXES))
    assert not unknown, f"docs/deployment.md uses variables no component reads: {unknown}"


def test_every_ftl_subcommand_the_recipes_run_exists():
    commands = {name.split()[0] for name, _ in recipe_commands(TEXT) if name != "torchrun"}
    assert {"lighthouse", "status", "accelerate"} <= commands, commands
    assert commands <= set(cli.SUBCOMMANDS), sorted(commands - set(cli.SUBCOMMANDS))


@pytest.mark.timeout(90)
def test_every_flag_the_recipes_pass_is_accepted_by_the_real_parser():
    commands = recipe_commands(TEXT)
    assert {"lighthouse", "torchrun", "accelerate launch"} <= {name for name, _ in commands}
    bad = [(name, flag) for name, flags in commands for flag in flags if flag not in parser_flags(name)]
    assert not bad, f"flags no parser accepts: {bad}"


@pytest.mark.timeout(90)
def test_flags_named_in_prose_exist_in_one_of_the_recipe_commands():
    everything = set().union(*(parser_flags(name) for name in ("torchrun", "lighthouse", "status", "launch",
                                                               "accelerate launch")))
    named = {f.split("=", 1)[0] for span in inline_spans(TEXT) for f in FLAG.findall(span)}
    assert "--local-addr" in named, sorted(named)
    assert not sorted(named - everything), sorted(named - everything)


def test_the_docs_list_links_the_deployment_guide():
    readme = (Path(REPO_ROOT) / "README.md").read_text(encoding="utf-8")
    assert "(docs/deployment.md)" in readme
