"""`FaultTolerancePlugin`: the fault-tolerance settings of one replica group, for Accelerate.

Like Accelerate's own plugins, every field may be left unset and is then filled from an
environment variable in `__post_init__`; as everywhere in ft-lightning, a set `FT_*` variable
overrides the argument (so an operator retunes a job without editing the script), which
overrides the default. `ftl accelerate launch` works by exporting exactly these variables.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from datetime import timedelta
from typing import Any

from ft_core import settings as ft_settings
from ft_core.errors import ConfigError

BACKENDS = ft_settings.get("FT_BACKEND").choices
WORLD_SIZE_MODES = ft_settings.get("FT_WORLD_SIZE_MODE").choices


@dataclass(frozen=True)
class Setting:
    """One setting the plugin offers: its field (also its config-file key and flag) and the ft_core setting
    behind it, whose environment variable, parser, default, valid values and doc it uses."""

    name: str
    core: ft_settings.Setting

    @property
    def env(self) -> str:
        return self.core.env

    @property
    def parse(self) -> Callable[[str], Any]:
        return self.core.parse

    @property
    def kind(self) -> str:
        return self.core.kind

    @property
    def help(self) -> str:
        return self.core.doc

    @property
    def default(self) -> Any:
        return _plain(self.core.default)


# Which settings the plugin offers, under which field names; everything else comes from ft_core.settings.
SETTINGS: tuple[Setting, ...] = tuple(Setting(name, ft_settings.get(env)) for name, env in (
    ("lighthouse", "FT_LIGHTHOUSE"),
    ("replica_group_id", "REPLICA_GROUP_ID"),
    ("num_replica_groups", "NUM_REPLICA_GROUPS"),
    ("min_replica_size", "FT_MIN_REPLICA_SIZE"),
    ("timeout", "FT_TIMEOUT_SEC"),
    ("quorum_timeout", "FT_QUORUM_TIMEOUT_SEC"),
    ("connect_timeout", "FT_CONNECT_TIMEOUT_SEC"),
    ("world_size_mode", "FT_WORLD_SIZE_MODE"),
    ("backend", "FT_BACKEND"),
    ("async_quorum", "FT_ASYNC_QUORUM"),
    ("token", "FT_TOKEN"),
    ("host", "FT_HOST"),
    ("exactly_once", "FT_EXACTLY_ONCE"),
    ("global_batch_size", "FT_GLOBAL_BATCH_SIZE"),
    ("checkpoint_dir", "FT_CHECKPOINT_DIR"),
))
SETTINGS_BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}
# Old names kept for one release (ft-lightning 0.1 called the group index `replica_id`; a group's name is
# `replica_id` everywhere else). Using one warns.
DEPRECATED_NAMES: dict[str, str] = {"replica_id": "replica_group_id"}


def _plain(value: Any) -> Any:
    """A plugin value: durations as float seconds (what a config file and the environment hold)."""
    return value.total_seconds() if isinstance(value, timedelta) else value


def canonical_name(name: str, where: str = "argument", stacklevel: int = 3) -> str:
    """`name`, or the current name of a deprecated one (with a DeprecationWarning)."""
    new = DEPRECATED_NAMES.get(name)
    if new is None:
        return name
    warnings.warn(f"{where}: the fault-tolerance setting {name!r} is deprecated and will be removed in the next "
                  f"release; use {new!r} (the replica group's index)", DeprecationWarning, stacklevel=stacklevel)
    return new


def canonical_names(values: Mapping[str, Any], where: str = "argument", stacklevel: int = 4) -> dict[str, Any]:
    """`values` with deprecated keys renamed (warning once per key); ConfigError when both names are given."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        new = canonical_name(name, where, stacklevel) if name in DEPRECATED_NAMES else name
        if new != name:
            if value is None:
                continue
            if values.get(new) is not None and values[new] != value:
                raise ConfigError(f"{where}: both {new}={values[new]!r} and its deprecated name {name}={value!r} "
                                  f"are given; keep only {new}")
        if new in out and out[new] is not None and value is None:
            continue
        out[new] = value
    return out


def _label(name: str, given_as: str | None) -> str:
    """Errors name the setting as the user wrote it (a deprecated name too)."""
    return given_as or name


def parse_setting(name: str, value: Any, source: str, given_as: str | None = None) -> Any:
    """Coerce one value (from an argument, a config file or the environment) to its setting's type."""
    if name in DEPRECATED_NAMES:
        name, given_as = canonical_name(name, source), name
    setting = SETTINGS_BY_NAME[name]
    if value is None:
        return None
    if isinstance(value, str):
        value = value.strip()
    return _plain(ft_settings.coerce(setting.core, value, f"{source}: {_label(name, given_as)}"))


def resolve_settings(arguments: Mapping[str, Any], environ: Mapping[str, str] | None = None, *,
                     stacklevel: int = 1) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve every setting through ft_core.settings: environment variable, else argument, else default.

    Returns (values, sources) where sources[name] is "env FT_X", "argument" or "default". A deprecated
    name warns at the caller `stacklevel` frames up.
    """
    env = os.environ if environ is None else environ
    given_as = {DEPRECATED_NAMES[k]: k for k, v in arguments.items() if k in DEPRECATED_NAMES and v is not None}
    arguments = canonical_names(arguments, stacklevel=3 + stacklevel)
    unknown = sorted(set(arguments) - set(SETTINGS_BY_NAME))
    if unknown:
        raise ConfigError(f"unknown fault-tolerance setting(s) {unknown}; known: {sorted(SETTINGS_BY_NAME)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        arg = arguments.get(s.name)
        value, sources[s.name] = ft_settings.resolve(s.env, arg.strip() if isinstance(arg, str) else arg, env,
                                                     where=f"argument: {_label(s.name, given_as.get(s.name))}")
        values[s.name] = _plain(value)
    validate_settings(values)
    return values, sources


def validate_settings(values: Mapping[str, Any]) -> None:
    """Cross-field rules; raises ConfigError naming the setting and how to fix it."""
    if not values.get("lighthouse"):
        raise ConfigError("no lighthouse address: pass FaultTolerancePlugin(lighthouse='host:port'), set "
                          "FT_LIGHTHOUSE, or write one with `ftl accelerate config --lighthouse host:port`")
    groups, group = values["num_replica_groups"], values["replica_group_id"]
    if groups < 1:
        raise ConfigError(f"num_replica_groups (NUM_REPLICA_GROUPS) must be >= 1, got {groups}")
    if not 0 <= group < groups:
        raise ConfigError(f"replica_group_id (REPLICA_GROUP_ID) must be in 0..{groups - 1} for num_replica_groups="
                          f"{groups}, got {group}; give each `accelerate launch` its own index")
    if values["min_replica_size"] < 1:
        raise ConfigError(f"min_replica_size (FT_MIN_REPLICA_SIZE) must be >= 1, got {values['min_replica_size']}")
    if values.get("global_batch_size") is not None and values["global_batch_size"] < 1:
        raise ConfigError(f"global_batch_size (FT_GLOBAL_BATCH_SIZE) must be >= 1, got {values['global_batch_size']}")


@dataclass(frozen=True)
class FaultTolerancePlugin:
    """Fault-tolerance settings for `FaultTolerantAccelerator`; unset fields come from FT_* variables.

    Environment variables: FT_LIGHTHOUSE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS, FT_MIN_REPLICA_SIZE,
    FT_TIMEOUT_SEC, FT_QUORUM_TIMEOUT_SEC, FT_CONNECT_TIMEOUT_SEC, FT_WORLD_SIZE_MODE, FT_BACKEND,
    FT_ASYNC_QUORUM, FT_TOKEN, FT_HOST, FT_EXACTLY_ONCE, FT_GLOBAL_BATCH_SIZE, FT_CHECKPOINT_DIR (a set
    variable overrides the argument). Frozen once resolved.
    `host` is the address or name this group advertises (default: this machine's address on the route
    toward the lighthouse, so groups on other machines need no setting).
    `exactly_once` gives prepared training loaders the exactly-once sampler (docs/data.md); `global_batch_size`
    (samples per committed step whatever the number of participants) implies it. `checkpoint_dir` is where
    the job's `save_state` folders are: a group that finds the job finished resumes from there.
    `replica_id=<int>` is a deprecated alias of `replica_group_id` (the group's index).
    """

    lighthouse: str | None = None
    replica_group_id: int | None = None
    num_replica_groups: int | None = None
    min_replica_size: int | None = None
    timeout: float | timedelta | None = None
    quorum_timeout: float | timedelta | None = None
    connect_timeout: float | timedelta | None = None
    world_size_mode: str | None = None
    backend: str | None = None
    async_quorum: bool | None = None
    token: str | None = field(default=None, repr=False)
    host: str | None = None
    exactly_once: bool | None = None
    global_batch_size: int | None = None
    checkpoint_dir: str | None = None
    sources: dict[str, str] = field(default_factory=dict, repr=False, compare=False)
    replica_id: InitVar[int | None] = None  # deprecated: replica_group_id

    def __post_init__(self, replica_id: int | None) -> None:
        arguments = {s.name: getattr(self, s.name) for s in SETTINGS}
        if replica_id is not None:
            arguments["replica_id"] = replica_id
        values, sources = resolve_settings(arguments, stacklevel=3)  # warn at the caller of __init__
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
            shown = "***" if s.core.secret and value else value
            parts.append(f"{s.name}={shown} ({self.sources.get(s.name, '?')})")
        return ", ".join(parts)


def _deprecated_replica_id(self: FaultTolerancePlugin) -> int:
    warnings.warn("FaultTolerancePlugin.replica_id is deprecated and will be removed in the next release; use "
                  "replica_group_id (the replica group's index)", DeprecationWarning, stacklevel=2)
    return self.replica_group_id  # type: ignore[return-value]


# Reading the old name still works for one release (the dataclass took `replica_id` as an init-only alias).
FaultTolerancePlugin.replica_id = property(_deprecated_replica_id)  # type: ignore[assignment,method-assign]


def settings_to_env(values: Mapping[str, Any]) -> dict[str, str]:
    """Environment variables that carry `values` (None values are left out) to a worker process."""
    env: dict[str, str] = {}
    for name, value in canonical_names(values).items():
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
