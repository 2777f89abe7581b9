"""The one table of settings: every environment variable ft-lightning reads, with its parser,
default, valid values and meaning, and how a value is resolved.

Precedence, everywhere: a set environment variable overrides the argument, which overrides the
default (DESIGN.md section 7), so an operator retunes a job without editing the script. torchft's
`TORCHFT_*` names are honoured after ours. Components resolve their settings once, into their own
frozen config dataclass, through `value()`; the integrations offer a subset of this table under
the same environment names. Pure functions over a mapping (os.environ by default).

`ftl settings --markdown` prints the table that docs/settings.md holds.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ft_core.errors import ConfigError

__all__ = ["SETTINGS", "Setting", "coerce", "cross_group_backend", "find", "get", "lookup", "main", "markdown_table",
           "parse_bool", "parse_choice", "parse_env", "parse_int", "parse_seconds", "parse_str", "redact", "resolve",
           "value"]

USER = "user"
LAUNCHER = "launcher"  # set per process by torchrun / `ftl launch` / `ftl accelerate launch`, rarely by hand


# ---- parsers: raw environment text -> value; ValueError when invalid ------------------------------------

def parse_str(raw: str) -> str:
    return raw


def parse_int(raw: str) -> int:
    return int(raw)


def parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def parse_seconds(raw: str) -> timedelta:
    seconds = float(raw)
    if not seconds > 0:  # also rejects nan
        raise ValueError(raw)
    return timedelta(seconds=seconds)


def parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    """Case-insensitive, `-` or `_`: `Fixed-With-Spares` is `fixed_with_spares`."""
    def parse(raw: str) -> str:
        normalized = raw.strip().lower().replace("-", "_")
        if normalized not in choices:
            raise ValueError(raw)
        return normalized
    parse.choices = choices  # type: ignore[attr-defined]
    return parse


@dataclass(frozen=True)
class Setting:
    """One setting: python name, environment variable, parser, default, valid values (for errors and
    docs: "integer", "seconds", "boolean", "a|b", ...) and a one-line meaning."""

    name: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    kind: str
    doc: str
    aliases: tuple[str, ...] = ()
    set_by: str = USER
    secret: bool = False

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(getattr(self.parse, "choices", ()))

    def expectation(self) -> str:
        """What a valid value looks like, for error messages."""
        if self.choices:
            return f"one of {self.kind}"
        if self.parse is parse_bool:
            return "a valid boolean (1/0/true/false/yes/no/on/off)"
        if self.parse is parse_seconds:
            return "a valid positive number of seconds"
        return f"a valid {self.kind}"


SECONDS = "seconds"
WORLD_SIZE_MODES = ("dynamic", "fixed_with_spares")
BACKENDS = ("auto", "gloo", "nccl")
START_METHODS = ("forkserver", "spawn")
_60S = timedelta(seconds=60)

SETTINGS: tuple[Setting, ...] = (
    Setting("lighthouse_addr", "FT_LIGHTHOUSE", parse_str, None, "address",
            "lighthouse host:port; a comma-separated list fails over in order", aliases=("TORCHFT_LIGHTHOUSE",)),
    Setting("token", "FT_TOKEN", parse_str, None, "secret",
            "shared token that authenticates every control-plane call and checkpoint fetch", secret=True),
    Setting("timeout", "FT_TIMEOUT_SEC", parse_seconds, _60S, SECONDS,
            "deadline of collectives, manager calls and checkpoint transfers", aliases=("TORCHFT_TIMEOUT_SEC",)),
    Setting("quorum_timeout", "FT_QUORUM_TIMEOUT_SEC", parse_seconds, _60S, SECONDS,
            "deadline for a quorum to form", aliases=("TORCHFT_QUORUM_TIMEOUT_SEC",)),
    Setting("connect_timeout", "FT_CONNECT_TIMEOUT_SEC", parse_seconds, _60S, SECONDS,
            "deadline for connecting to the lighthouse and peers", aliases=("TORCHFT_CONNECT_TIMEOUT_SEC",)),
    Setting("quorum_retries", "FT_QUORUM_RETRIES", parse_int, 0, "integer",
            "lighthouse quorum calls retried after a failure before the step fails",
            aliases=("TORCHFT_QUORUM_RETRIES",)),
    Setting("manager_port", "FT_MANAGER_PORT", parse_int, 0, "integer",
            "port of the replica group's manager server (0: chosen by the OS)", aliases=("TORCHFT_MANAGER_PORT",)),
    Setting("host", "FT_HOST", parse_str, None, "address",
            "address or name this group advertises and binds for its servers and process groups (default: "
            "the local address of the route toward the lighthouse)"),
    Setting("bind_all", "FT_BIND_ALL", parse_bool, False, "boolean",
            "servers listen on every interface (0.0.0.0 or ::) while still advertising FT_HOST's address"),
    Setting("min_replica_size", "FT_MIN_REPLICA_SIZE", parse_int, 1, "integer",
            "fewest replica groups that must take part for a step to commit"),
    Setting("world_size_mode", "FT_WORLD_SIZE_MODE", parse_choice(WORLD_SIZE_MODES), "dynamic",
            "|".join(WORLD_SIZE_MODES),
            "dynamic: average over every live group; fixed_with_spares: exactly min_replica_size contribute"),
    Setting("use_async_quorum", "FT_ASYNC_QUORUM", parse_bool, True, "boolean",
            "form the quorum in the background, overlapping the forward pass"),
    Setting("redo_step", "FT_REDO_STEP", parse_bool, None, "boolean",
            "when a peer is lost during a step, the survivors form the quorum again and redo its reductions "
            "without it instead of failing the step. Unset: on for groups of one rank (redone where the failed "
            "reduction is waited on), off for groups of several; 1: also groups of several ranks, at the vote "
            "(only for loops that read reduced values after it); 0: off (docs/guarantees.md)"),
    Setting("redo_copy", "FT_REDO_COPY", parse_bool, False, "boolean",
            "keep a copy of every cross-group reduction's input so a step that lost a peer mid-reduction can "
            "be redone too (one memcpy and one copy of the gradients per step)"),
    Setting("gc_freeze", "FT_GC_FREEZE", parse_bool, True, "boolean",
            "when ft_core and its Manager are imported, move the objects that exist (torch's and the imports': "
            "~170,000) out of Python's cyclic garbage collector (gc.freeze), so the full collections "
            "of a starting worker do not scan them again (~0.25 s of a 2 s start on 2 idle cores); such objects that "
            "later become garbage only through reference cycles stay allocated (0: off)"),
    Setting("cross_group_backend", "FT_BACKEND", parse_choice(BACKENDS), "auto", "|".join(BACKENDS),
            "cross-group process group: gloo (CPU), nccl (CUDA), auto (nccl on CUDA, else gloo)"),
    Setting("stream_quorum", "FT_STREAM_QUORUM", parse_bool, True, "boolean",
            "carry the lighthouse quorum over the manager's open heartbeat stream (0: one unary call per round)"),
    Setting("frames", "FT_FRAMES", parse_bool, True, "boolean",
            "serve and use the manager's per-step calls on a plain framed TCP port beside gRPC (0: gRPC only)"),
    Setting("manager_frames_port", "FT_MANAGER_FRAMES_PORT", parse_int, 0, "integer",
            "port of the manager server's frames wire (0: chosen by the OS); open it too between hosts"),
    Setting("lighthouse_frames_port", "FT_LIGHTHOUSE_FRAMES_PORT", parse_int, 0, "integer",
            "port of the lighthouse's frames wire for the heartbeat streams (0: chosen by the OS); open it too"),
    Setting("allow_kill", "FT_ALLOW_KILL", parse_bool, None, "boolean",
            "allow the Kill call without a token (local demos); unset: allowed exactly when a token is set"),
    Setting("tls_cert", "FT_TLS_CERT", parse_str, None, "path",
            "PEM certificate: servers speak TLS (with FT_TLS_KEY); clients trust it when FT_TLS_CA is unset"),
    Setting("tls_key", "FT_TLS_KEY", parse_str, None, "path", "PEM private key of FT_TLS_CERT"),
    Setting("tls_ca", "FT_TLS_CA", parse_str, None, "path", "PEM CA bundle that clients verify servers against"),
    Setting("baby_start_method", "FT_BABY_START_METHOD", parse_choice(START_METHODS), "forkserver",
            "|".join(START_METHODS), "how subprocess (Baby) process groups start their child process"),
    Setting("baby_start_timeout", "FT_BABY_START_TIMEOUT_SEC", parse_seconds, None, SECONDS,
            "a separate deadline for a subprocess process group's child to start and meet its peers (unset: "
            "`timeout` bounds the whole configure, as in torchft)"),
    Setting("metrics_port", "FT_METRICS_PORT", parse_int, None, "integer",
            "serve this replica group's Prometheus metrics on http://127.0.0.1:PORT/metrics (0: a free port; "
            "unset: off); `ftl launch` gives group g PORT+g"),
    Setting("exactly_once", "FT_EXACTLY_ONCE", parse_bool, False, "boolean",
            "Lightning and Accelerate: train every sample once per epoch across groups that die and heal "
            "(ft_core.data exactly-once sampler, docs/data.md) instead of a static shard per group"),
    Setting("rank_zero", "FT_RANK_ZERO", parse_choice(("group", "quorum")), "quorum", "group|quorum",
            "Lightning Trainer: who is rank zero (writes checkpoints and log lines): group rank 0 of the live "
            "participating group with the lowest replica rank only, as under DDP, checkpoints in one folder shared "
            "by the groups (quorum), or group rank 0 of every group, each in its own folders (group)"),
    Setting("global_batch_size", "FT_GLOBAL_BATCH_SIZE", parse_int, None, "integer",
            "samples per committed step whatever the number of participants (implies FT_EXACTLY_ONCE)"),
    Setting("checkpoint_dir", "FT_CHECKPOINT_DIR", parse_str, None, "path",
            "Accelerate: the job's `accelerator.save_state` folders (up to two levels below); a group that finds "
            "the job finished resumes from the newest one at the final step instead of retraining alone"),
    Setting("lighthouse_http", "FT_LIGHTHOUSE_HTTP", parse_str, None, "address",
            "status page http://host:port that `ftl status` reads (default: next to FT_LIGHTHOUSE)"),
    Setting("lighthouse_peers", "FT_LIGHTHOUSE_PEERS", parse_str, None, "address",
            "`ftl lighthouse`: the job's ordered lighthouse list (the same as FT_LIGHTHOUSE); the lighthouses ask "
            "each other and only one serves the job, the others send members there (`--peers`)"),
    Setting("replica_group_id", "REPLICA_GROUP_ID", parse_int, 0, "integer",
            "this replica group's index, 0 .. NUM_REPLICA_GROUPS-1 (the Manager uses it as its name prefix)",
            set_by=LAUNCHER),
    Setting("num_replica_groups", "NUM_REPLICA_GROUPS", parse_int, 1, "integer",
            "how many replica groups the training data is sharded over", set_by=LAUNCHER),
    Setting("restart_count", "FT_RESTART_COUNT", parse_int, 0, "integer",
            "how many times `ftl launch` has restarted this replica group; above 0 (or torchrun's "
            "TORCHELASTIC_RESTART_COUNT), a lighthouse that has just started lets the job's live members reconnect "
            "before this group forms a quorum without them (quorum rule 12)", set_by=LAUNCHER),
)

_BY_KEY: dict[str, Setting] = {**{s.name: s for s in SETTINGS}, **{s.env: s for s in SETTINGS}}
assert len(_BY_KEY) == 2 * len(SETTINGS), "setting names and environment variables must be unique"


def get(key: str) -> Setting:
    """The setting named `key`: its environment variable (FT_TIMEOUT_SEC) or its python name (timeout)."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"{key!r} is not in ft_core.settings.SETTINGS") from None


def find(env: str, environ: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """(variable, stripped value) of the first of `env` and its aliases that is set and not empty."""
    source = os.environ if environ is None else environ
    setting = _BY_KEY.get(env)
    for key in (env, *(setting.aliases if setting is not None else ())):
        raw = source.get(key)
        if raw is not None and raw.strip() != "":
            return key, raw.strip()
    return None


def lookup(env: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The raw value of environment variable `env` (or one of its aliases); None when unset or empty."""
    found = find(env, environ)
    return None if found is None else found[1]


def parse_env(setting: Setting, raw: str, variable: str | None = None) -> Any:
    """Parse the text of `setting`'s environment variable (or of its alias `variable`); ConfigError naming
    the variable and the valid values."""
    try:
        return setting.parse(raw.strip())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"environment variable {variable or setting.env}={raw!r} is not {setting.expectation()} "
                          f"({setting.doc}); unset it or fix its value") from exc


def coerce(setting: Setting, arg: Any, where: str | None = None) -> Any:
    """An argument (or config-file value) checked against `setting`: text is parsed like the environment,
    durations become timedeltas, enums their value; ConfigError naming `where` and the valid values."""
    label = where or f"argument {setting.name}"
    try:
        return _coerce(setting, arg)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{label}={arg!r} is not {setting.expectation()} ({setting.doc}); "
                          f"fix it or unset it (environment variable {setting.env})") from exc


def _coerce(setting: Setting, arg: Any) -> Any:
    if isinstance(arg, enum.Enum):
        arg = arg.value
    if isinstance(arg, str):
        return setting.parse(arg.strip()) if setting.parse is not parse_str else arg
    if setting.parse is parse_bool:
        if isinstance(arg, bool):
            return arg
        raise ValueError(arg)
    if isinstance(arg, bool):  # True is an int to Python, never a count or a duration here
        raise ValueError(arg)
    if setting.parse is parse_int and isinstance(arg, (int, float)) and float(arg).is_integer():
        return int(arg)
    if setting.parse is parse_seconds:
        if isinstance(arg, timedelta) and arg > timedelta(0):
            return arg
        if isinstance(arg, (int, float)) and arg > 0:
            return timedelta(seconds=float(arg))
    if setting.parse is parse_str and isinstance(arg, int):  # e.g. a numeric token read from YAML
        return str(arg)
    raise ValueError(arg)


def resolve(key: str, arg: Any = None, environ: Mapping[str, str] | None = None,
            where: str | None = None) -> tuple[Any, str]:
    """(value, source) of one setting: its environment variable when set ("env FT_X"), else the argument
    when not None ("argument"), else the table's default ("default"). `where` names the argument in errors."""
    setting = get(key)
    found = find(setting.env, environ)
    if found is not None:
        variable, raw = found
        return parse_env(setting, raw, variable), f"env {variable}"
    if arg is not None:
        return coerce(setting, arg, where), "argument"
    return setting.default, "default"


def value(key: str, arg: Any = None, environ: Mapping[str, str] | None = None, where: str | None = None) -> Any:
    """One setting resolved: environment variable, else argument, else the table's default."""
    return resolve(key, arg, environ, where)[0]


def cross_group_backend(device_type: str, backend: str | None = None,
                        environ: Mapping[str, str] | None = None) -> str:
    """The cross-group process group backend ("gloo" or "nccl") for a rank on `device_type`, from FT_BACKEND,
    else `backend`, else auto (nccl on CUDA, else gloo)."""
    chosen = value("FT_BACKEND", backend, environ)
    if chosen == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if chosen == "nccl" and device_type != "cuda":
        raise ConfigError(f"cross_group_backend='nccl' needs CUDA devices, but this rank runs on {device_type}; "
                          f"use 'gloo' or 'auto' (FT_BACKEND)")
    return chosen


def redact(values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` keyed by setting name or variable, with secrets shown as "***" (for logs)."""
    out = {}
    for key, val in values.items():
        setting = _BY_KEY.get(key)
        out[key] = "***" if setting is not None and setting.secret and val else val
    return out


# ---- documentation -------------------------------------------------------------------------------------

def _shown_default(setting: Setting) -> str:
    default = setting.default
    if default is None:
        return "unset"
    if isinstance(default, timedelta):
        return f"{default.total_seconds():g}"
    if isinstance(default, bool):
        return "true" if default else "false"
    return f"`{default}`"


def markdown_table() -> str:
    """The settings table of docs/settings.md, generated from SETTINGS."""
    lines = ["| environment variable | default | values | set by | meaning |", "| --- | --- | --- | --- | --- |"]
    for s in SETTINGS:
        env = f"`{s.env}`" + "".join(f" (`{alias}`)" for alias in s.aliases)
        values = r" \| ".join(f"`{c}`" for c in s.choices) if s.choices else s.kind
        doc = s.doc.replace("|", r"\|")
        lines.append(f"| {env} | {_shown_default(s)} | {values} | {s.set_by} | {doc} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`ftl settings [--markdown]`: print the table (markdown, or one line per setting with its value here)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--markdown"]:
        sys.stdout.write(markdown_table())
        return 0
    if args:
        sys.stderr.write("usage: ftl settings [--markdown]\n")
        return 2
    invalid = []
    for s in SETTINGS:
        found = find(s.env)
        if found is None:
            sys.stdout.write(f"{s.env}=(default {_shown_default(s)})\n")
            continue
        variable, raw = found
        shown = "***" if s.secret else raw
        alias = f" (from {variable})" if variable != s.env else ""
        try:
            parse_env(s, raw, variable)
        except ConfigError as exc:
            invalid.append(variable)
            sys.stdout.write(f"{s.env}={shown}{alias}  <- invalid: {exc}\n")
            continue
        sys.stdout.write(f"{s.env}={shown}{alias}\n")
    if invalid:  # what a Manager, lighthouse or launcher started here would refuse at once
        sys.stderr.write(f"ftl settings: {len(invalid)} invalid: {', '.join(invalid)}; fix or unset them\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
