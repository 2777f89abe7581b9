"""`FaultTolerancePlugin`: the fault-tolerance settings of one replica group, for Accelerate.

Like Accelerate's own plugins, every field may be left unset and is then filled from an
environment variable in `__post_init__`; as everywhere in ft-lightning, a set `FT_*` variable
overrides the argument (so an operator retunes a job without editing the script), which
overrides the default. `ftl accelerate launch` works by exporting exactly these variables.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ft_core.env import lookup
from ft_core.errors import ConfigError

BACKENDS = ("auto", "gloo", "nccl")
WORLD_SIZE_MODES = ("dynamic", "fixed_with_spares")


def _parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _parse_seconds(raw: str) -> float:
    seconds = float(raw)
    if not seconds > 0:
        raise ValueError(raw)
    return seconds


def _parse_choice(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        value = raw.strip().lower().replace("-", "_")
        if value not in choices:
            raise ValueError(raw)
        return value
    return parse


@dataclass(frozen=True)
class Setting:
    """One fault-tolerance setting: its field, environment variable, parser, default and meaning."""

    name: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    kind: str
    help: str


SETTINGS: tuple[Setting, ...] = (
    Setting("lighthouse", "FT_LIGHTHOUSE", str, None, "address",
            "lighthouse address host:port (a comma-separated list fails over in order)"),
    Setting("replica_id", "REPLICA_GROUP_ID", int, 0, "integer",
            "this replica group's index, 0 .. num_replica_groups-1 (one per `accelerate launch`)"),
    Setting("num_replica_groups", "NUM_REPLICA_GROUPS", int, 1, "integer",
            "how many replica groups the data is sharded over"),
    Setting("min_replica_size", "FT_MIN_REPLICA_SIZE", int, 1, "integer",
            "fewest replica groups that must take part for a step to commit"),
    Setting("timeout", "FT_TIMEOUT_SEC", _parse_seconds, 60.0, "seconds",
            "deadline of collectives and manager calls"),
    Setting("quorum_timeout", "FT_QUORUM_TIMEOUT_SEC", _parse_seconds, 60.0, "seconds",
            "deadline for a quorum to form"),
    Setting("connect_timeout", "FT_CONNECT_TIMEOUT_SEC", _parse_seconds, 60.0, "seconds",
            "deadline for connecting to the lighthouse and peers"),
    Setting("world_size_mode", "FT_WORLD_SIZE_MODE", _parse_choice(WORLD_SIZE_MODES), "dynamic",
            "|".join(WORLD_SIZE_MODES),
            "dynamic: average over every live group; fixed_with_spares: exactly min_replica_size contribute"),
    Setting("backend", "FT_BACKEND", _parse_choice(BACKENDS), "auto", "|".join(BACKENDS),
            "cross-group process group: gloo (CPU), nccl (CUDA), auto (nccl on CUDA, else gloo)"),
    Setting("async_quorum", "FT_ASYNC_QUORUM", _parse_bool, True, "boolean",
            "form the quorum in the background, overlapping the forward pass"),
    Setting("token", "FT_TOKEN", str, None, "secret",
            "shared token that authenticates every control-plane call and checkpoint fetch"),
)
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def parse_setting(name: str, value: Any, source: str) -> Any:
    """Coerce one value (from an argument, a config file or the environment) to its setting's type."""
    setting = SETTINGS_BY_NAME[name]
    if value is None:
        return None
    try:
        return _coerce(setting, value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {name}={value!r} is not a valid {setting.kind} ({setting.help}); "
                          f"fix the value or leave it unset") from exc


def _coerce(setting: Setting, value: Any) -> Any:
    if isinstance(value, str):
        return setting.parse(value.strip())
    if setting.parse is _parse_bool:
        if isinstance(value, bool):
            return value
        raise ValueError(value)
    if isinstance(value, bool):  # True is an int to Python, never a count or a duration here
        raise ValueError(value)
    if setting.parse is int and isinstance(value, (int, float)) and float(value).is_integer():
        return int(value)
    if setting.parse is _parse_seconds:
        seconds = value.total_seconds() if isinstance(value, timedelta) else value
        if isinstance(seconds, (int, float)) and seconds > 0:
            return float(seconds)
    if setting.parse is str and isinstance(value, int):  # e.g. a numeric token read from YAML
        return str(value)
    raise ValueError(value)


def resolve_settings(arguments: Mapping[str, Any], environ: Mapping[str, str] | None = None
                     ) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve every setting: environment variable, else argument, else default.

    Returns (values, sources) where sources[name] is "env FT_X", "argument" or "default".
    """
    env = os.environ if environ is None else environ
    unknown = sorted(set(arguments) - set(SETTINGS_BY_NAME))
    if unknown:
        raise ConfigError(f"unknown fault-tolerance setting(s) {unknown}; known: {sorted(SETTINGS_BY_NAME)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for setting in SETTINGS:
        raw = lookup(setting.env, env)
        if raw is not None:
            values[setting.name] = parse_setting(setting.name, raw, f"environment variable {setting.env}")
            sources[setting.name] = f"env {setting.env}"
        elif arguments.get(setting.name) is not None:
            values[setting.name] = parse_setting(setting.name, arguments[setting.name], "argument")
            sources[setting.name] = "argument"
        else:
            values[setting.name] = setting.default
            sources[setting.name] = "default"
    validate_settings(values)
    return values, sources


def validate_settings(values: Mapping[str, Any]) -> None:
    """Cross-field rules; raises ConfigError naming the setting and how to fix it."""
    if not values.get("lighthouse"):
        raise ConfigError("no lighthouse address: pass FaultTolerancePlugin(lighthouse='host:port'), set "
                          "FT_LIGHTHOUSE, or write one with `ftl accelerate config --lighthouse host:port`")
    groups, replica = values["num_replica_groups"], values["replica_id"]
    if groups < 1:
        raise ConfigError(f"num_replica_groups (NUM_REPLICA_GROUPS) must be >= 1, got {groups}")
    if not 0 <= replica < groups:
        raise ConfigError(f"replica_id (REPLICA_GROUP_ID) must be in 0..{groups - 1} for num_replica_groups="
                          f"{groups}, got {replica}; give each `accelerate launch` its own index")
    if values["min_replica_size"] < 1:
        raise ConfigError(f"min_replica_size (FT_MIN_REPLICA_SIZE) must be >= 1, got {values['min_replica_size']}")


@dataclass(frozen=True)
class FaultTolerancePlugin:
    """Fault-tolerance settings for `FaultTolerantAccelerator`; unset fields come from FT_* variables.

    Environment variables: FT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, FT_MIN_REPLICA_SIZE,
    FT_TIMEOUT_SEC, FT_QUORUM_TIMEOUT_SEC, FT_CONNECT_TIMEOUT_SEC, FT_WORLD_SIZE_MODE, FT_BACKEND,
    FT_ASYNC_QUORUM, FT_TOKEN (a set variable overrides the argument). Frozen once resolved.
    """

    lighthouse: str | None = None
    replica_id: int | None = None
    num_replica_groups: int | None = None
    min_replica_size: int | None = None
    timeout: float | timedelta | None = None
    quorum_timeout: float | timedelta | None = None
    connect_timeout: float | timedelta | None = None
    world_size_mode: str | None = None
    backend: str | None = None
    async_quorum: bool | None = None
    token: str | None = field(default=None, repr=False)
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        arguments = {s.name: getattr(self, s.name) for s in SETTINGS}
        values, sources = resolve_settings(arguments)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "sources", sources)

    def timedelta(self, name: str) -> timedelta:
        """One of the timeouts ("timeout", "quorum_timeout", "connect_timeout") as a timedelta."""
        return timedelta(seconds=float(getattr(self, name)))

    def settings(self) -> dict[str, Any]:
        """The resolved settings as plain values (what a config file holds)."""
        return {s.name: getattr(self, s.name) for s in SETTINGS}

    def describe(self) -> str:
        """One line for the log: every setting with its source, the token masked."""
        parts = []
        for s in SETTINGS:
            value = getattr(self, s.name)
            shown = "***" if s.name == "token" and value else value
            parts.append(f"{s.name}={shown} ({self.sources.get(s.name, '?')})")
        return ", ".join(parts)


def settings_to_env(values: Mapping[str, Any]) -> dict[str, str]:
    """Environment variables that carry `values` (None values are left out) to a worker process."""
    env: dict[str, str] = {}
    for name, value in values.items():
        if value is None:
            continue
        setting = SETTINGS_BY_NAME[name]
        if isinstance(value, bool):
            env[setting.env] = "1" if value else "0"
        elif isinstance(value, timedelta):
            env[setting.env] = repr(value.total_seconds())
        else:
            env[setting.env] = str(value)
    return env
