"""Resolve settings: an FT_* environment variable overrides the argument, which overrides the default.

Environment overrides win (as DESIGN.md section 7 says) so an operator can retune a job
without editing the training script.

Pure functions over a mapping (os.environ by default) so config resolution is testable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Callable, TypeVar

from ft_core.errors import ConfigError

T = TypeVar("T")

# Legacy torchft names are honoured after ours, so torchft users can switch without edits.
ALIASES: dict[str, tuple[str, ...]] = {
    "FT_LIGHTHOUSE": ("TORCHFT_LIGHTHOUSE",),
    "FT_TIMEOUT_SEC": ("TORCHFT_TIMEOUT_SEC",),
    "FT_QUORUM_TIMEOUT_SEC": ("TORCHFT_QUORUM_TIMEOUT_SEC",),
    "FT_CONNECT_TIMEOUT_SEC": ("TORCHFT_CONNECT_TIMEOUT_SEC",),
    "FT_QUORUM_RETRIES": ("TORCHFT_QUORUM_RETRIES",),
    "FT_MANAGER_PORT": ("TORCHFT_MANAGER_PORT",),
}


def lookup(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Return the raw value of `name` (or one of its aliases), None when unset or empty."""
    env = os.environ if environ is None else environ
    for key in (name, *ALIASES.get(name, ())):
        value = env.get(key)
        if value is not None and value.strip() != "":
            return value.strip()
    return None


def _parse(name: str, raw: str, parse: Callable[[str], T], kind: str) -> T:
    try:
        return parse(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not a valid {kind}; unset it or fix its value") from exc


def resolve(arg: T | None, name: str, default: T, parse: Callable[[str], T] = str,  # type: ignore[assignment]
            environ: Mapping[str, str] | None = None, kind: str = "value") -> T:
    """Environment variable `name` when set, else the argument, else `default`."""
    raw = lookup(name, environ)
    if raw is not None:
        return _parse(name, raw, parse, kind)
    return default if arg is None else arg


def resolve_int(arg: int | None, name: str, default: int, environ: Mapping[str, str] | None = None) -> int:
    return resolve(arg, name, default, int, environ, "integer")


def resolve_str(arg: str | None, name: str, default: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    return resolve(arg, name, default, str, environ, "string")


def resolve_bool(arg: bool | None, name: str, default: bool, environ: Mapping[str, str] | None = None) -> bool:
    def parse_bool(raw: str) -> bool:
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(raw)

    return resolve(arg, name, default, parse_bool, environ, "boolean (1/0/true/false)")


def resolve_seconds(arg: timedelta | float | None, name: str, default: timedelta,
                    environ: Mapping[str, str] | None = None) -> timedelta:
    """A duration: `name` in seconds (float ok) when set, else the argument (timedelta or seconds), else default."""
    raw = lookup(name, environ)
    if raw is not None:
        seconds = _parse(name, raw, float, "number of seconds")
        if seconds <= 0:
            raise ConfigError(f"environment variable {name}={raw!r} must be a positive number of seconds")
        return timedelta(seconds=seconds)
    if arg is None:
        return default
    return arg if isinstance(arg, timedelta) else timedelta(seconds=float(arg))
