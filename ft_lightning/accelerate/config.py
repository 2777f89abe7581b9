"""Our own fault-tolerance config file for Accelerate users, and how launch settings are resolved.

Accelerate rejects unknown keys in its own YAML, so the settings live in a file of ours next to
it (never inside it): `$HF_HOME/accelerate/fault_tolerance.yaml` by default. YAML, or JSON when
the name ends in `.json`. Pure functions over paths and mappings, so they are table-testable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from ft_core import settings as ft_settings
from ft_core.errors import ConfigError
from ft_lightning.accelerate.plugin import DEPRECATED_NAMES, SETTINGS, SETTINGS_BY_NAME, canonical_names, parse_setting

CONFIG_FILE_NAME = "fault_tolerance.yaml"


def default_config_path(environ: Mapping[str, str] | None = None) -> str:
    """`$HF_HOME/accelerate/fault_tolerance.yaml` (HF_HOME defaults to `$XDG_CACHE_HOME/huggingface`, i.e.
    `~/.cache/huggingface`), the directory where Accelerate keeps its own `default_config.yaml`."""
    env = os.environ if environ is None else environ
    cache = env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    hf_home = env.get("HF_HOME") or os.path.join(cache, "huggingface")
    return os.path.join(os.path.expanduser(hf_home), "accelerate", CONFIG_FILE_NAME)


def _is_json(path: str) -> bool:
    return path.lower().endswith(".json")


def load_config(path: str) -> dict[str, Any]:
    """Read a fault-tolerance config file; every key is checked and coerced, unknown keys are an error."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError as exc:
        raise ConfigError(f"fault-tolerance config file {path} does not exist; write it with "
                          f"`ftl accelerate config --config-file {path}`") from exc
    if _is_json(path):
        try:
            data = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as exc:
            raise ConfigError(f"fault-tolerance config file {path} is not valid JSON: {exc}") from exc
    else:
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"fault-tolerance config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"fault-tolerance config file {path} must hold a mapping of settings, got "
                          f"{type(data).__name__}")
    unknown = sorted(str(k) for k in data if k not in SETTINGS_BY_NAME and k not in DEPRECATED_NAMES)
    if unknown:
        raise ConfigError(f"fault-tolerance config file {path} has unknown key(s) {unknown}; known keys: "
                          f"{[s.name for s in SETTINGS]}")
    data = canonical_names(data, f"fault-tolerance config file {path}")
    return {name: parse_setting(name, value, f"{path}: key {name!r}")
            for name, value in data.items() if value is not None}


def render_config(values: Mapping[str, Any], json_format: bool = False) -> str:
    """The file text for `values`: YAML with one comment per setting (or plain JSON)."""
    ordered = {s.name: values[s.name] for s in SETTINGS if values.get(s.name) is not None}
    if json_format:
        return json.dumps(ordered, indent=2) + "\n"
    import yaml

    lines = ["# Fault-tolerance settings for `ftl accelerate launch` (ft-lightning).",
             "# Each key is also read from its environment variable, which wins over this file;",
             "# a flag given to `ftl accelerate launch` wins over both.", ""]
    for s in SETTINGS:
        if s.name in ordered:
            lines.append(f"# {s.help} ({s.env}; {s.kind})")
            lines.append(yaml.safe_dump({s.name: ordered[s.name]}, default_flow_style=False).strip())
    return "\n".join(lines) + "\n"


def save_config(path: str, values: Mapping[str, Any]) -> str:
    """Write the config file (owner-only permissions: it may hold the token); returns the path."""
    values = canonical_names(values)
    for name in values:
        if name not in SETTINGS_BY_NAME:
            raise ConfigError(f"unknown fault-tolerance setting {name!r}; known: {[s.name for s in SETTINGS]}")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    text = render_config(values, _is_json(path))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o600)
    return path


def resolve_launch_settings(file_values: Mapping[str, Any], environ: Mapping[str, str],
                            flag_values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Settings for `ftl accelerate launch`: flag, else environment variable, else config file.

    Returns (values, sources) for the settings that have a value; what is unset is left to the
    worker (its FaultTolerancePlugin arguments, then defaults).
    """
    file_values, flag_values = canonical_names(file_values), canonical_names(flag_values)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for s in SETTINGS:
        raw_env = ft_settings.lookup(s.env, environ)
        if flag_values.get(s.name) is not None:
            values[s.name] = parse_setting(s.name, flag_values[s.name], f"flag --{flag_name(s.name)}")
            sources[s.name] = "flag"
        elif raw_env is not None:
            values[s.name] = parse_setting(s.name, raw_env, f"environment variable {s.env}")
            sources[s.name] = f"env {s.env}"
        elif file_values.get(s.name) is not None:
            values[s.name] = file_values[s.name]
            sources[s.name] = "config file"
    return values, sources


FLAG_NAMES = {"backend": "cross-group-backend"}


def flag_name(setting: str) -> str:
    """The command-line flag of a setting, without leading dashes (`backend` is `cross-group-backend`, not
    to be confused with Accelerate's own backends)."""
    return FLAG_NAMES.get(setting, setting.replace("_", "-"))
