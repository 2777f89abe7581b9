"""The one settings table (ft_core.settings): it covers every variable the code reads, the docs are
generated from it, resolution is environment > argument > default everywhere (torchft aliases too),
bad values name the variable and the valid values, and core-API users get every setting the
integrations offer."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import pytest

from ft_core import settings
from ft_core.control import lighthouse_client, manager_server
from ft_core.data import DistributedSampler
from ft_core.errors import ConfigError
from ft_core.manager import Manager, WorldSizeMode
from ft_core.manager_config import resolve_config
from ft_lightning._common import FTSettings
from ft_lightning.accelerate import plugin as accelerate_plugin
from ft_lightning.accelerate.config import load_config
from ft_lightning.accelerate.plugin import FaultTolerancePlugin, settings_to_env

from conftest import REPO_ROOT, child_env

ROOT = Path(REPO_ROOT)
SOURCE_DIRS = (ROOT / "ft_core", ROOT / "ft_lightning")
GENERATED = ROOT / "ft_core" / "control" / "proto"
VARIABLE = re.compile(r"(TORCH)?FT_[A-Z0-9_]+")
LH = "127.0.0.1:29510"
D, F = WorldSizeMode.DYNAMIC, WorldSizeMode.FIXED_WITH_SPARES


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No variable of the table (or alias) from the outer environment leaks into a test."""
    for s in settings.SETTINGS:
        for name in (s.env, *s.aliases):
            monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _source_trees() -> list[tuple[Path, ast.Module]]:
    trees = []
    for top in SOURCE_DIRS:
        for path in sorted(top.rglob("*.py")):
            if GENERATED in path.parents:
                continue
            trees.append((path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))))
    return trees


# --- (a) the table covers what the code reads ----------------------------------------------------------

def test_every_ft_variable_in_the_source_is_in_the_table_with_a_doc_line():
    known = {s.env for s in settings.SETTINGS}
    aliases = {alias for s in settings.SETTINGS for alias in s.aliases}
    found: dict[str, str] = {}
    for path, tree in _source_trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and VARIABLE.fullmatch(node.value):
                found.setdefault(node.value, f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found, "the scan found no FT_* string at all: is it looking in the right place?"
    missing = {name: where for name, where in found.items() if name not in known | aliases}
    assert not missing, f"read by the code but not in ft_core.settings.SETTINGS: {missing}"
    for s in settings.SETTINGS:
        assert s.doc.strip() and "\n" not in s.doc, s.env
        assert s.kind.strip(), s.env


def test_every_key_the_code_resolves_through_the_table_exists():
    readers = {"value", "resolve", "get", "lookup", "find"}
    for path, tree in _source_trees():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in readers and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("settings", "ft_settings")):
                continue
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                settings.get(node.args[0].value)  # a KeyError names the typo


def test_names_and_variables_are_unique_and_launcher_variables_are_marked():
    names = [s.name for s in settings.SETTINGS]
    envs = [s.env for s in settings.SETTINGS]
    assert len(set(names)) == len(names) and len(set(envs)) == len(envs)
    assert {s.env for s in settings.SETTINGS if s.set_by == settings.LAUNCHER} >= {"REPLICA_GROUP_ID",
                                                                                  "NUM_REPLICA_GROUPS"}
    assert [s.env for s in settings.SETTINGS if s.secret] == ["FT_TOKEN"]


# --- (b) the docs table is the generated one ------------------------------------------------------------

def test_docs_settings_table_is_generated_from_the_table():
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    start, end = "<!-- settings-table:start -->\n", "<!-- settings-table:end -->"
    assert start in text and end in text
    documented = text.split(start, 1)[1].split(end, 1)[0]
    assert documented == settings.markdown_table(), \
        "docs/settings.md is stale: regenerate it with `ftl settings --markdown`"
    assert "docs/settings.md" in (ROOT / "README.md").read_text(encoding="utf-8")
    for s in settings.SETTINGS:
        assert f"`{s.env}`" in documented


def test_markdown_command_prints_the_table(capsys):
    assert settings.main(["--markdown"]) == 0
    assert capsys.readouterr().out == settings.markdown_table()
    assert settings.main(["--bogus"]) == 2


@pytest.mark.timeout(30)
def test_the_listing_flags_each_invalid_value_and_fails_naming_them(clean_env, capsys):
    """`ftl settings` is where a user checks a job's environment: a value every component would refuse at
    start (here a duration that is not a number) is flagged on its line with the reason, and the command
    fails naming it; valid values, aliases and redacted secrets are listed as they resolve."""
    clean_env.setenv("FT_TIMEOUT_SEC", "abc")
    clean_env.setenv("TORCHFT_LIGHTHOUSE", "127.0.0.1:29510")
    clean_env.setenv("FT_TOKEN", "s3cret")
    assert settings.main([]) == 1
    captured = capsys.readouterr()
    lines = {line.split("=", 1)[0]: line for line in captured.out.splitlines()}
    assert "invalid" in lines["FT_TIMEOUT_SEC"] and "'abc'" in lines["FT_TIMEOUT_SEC"]
    assert "positive number of seconds" in lines["FT_TIMEOUT_SEC"]
    assert lines["FT_LIGHTHOUSE"] == "FT_LIGHTHOUSE=127.0.0.1:29510 (from TORCHFT_LIGHTHOUSE)"
    assert lines["FT_TOKEN"] == "FT_TOKEN=***" and "s3cret" not in captured.out + captured.err
    assert "1 invalid: FT_TIMEOUT_SEC" in captured.err
    clean_env.setenv("FT_TIMEOUT_SEC", "15")
    assert settings.main([]) == 0
    assert "invalid" not in capsys.readouterr().out


# --- (c) precedence, aliases, valid values --------------------------------------------------------------

PRECEDENCE = [
    # (setting, environment, argument, resolved, source)
    ("FT_TIMEOUT_SEC", {}, None, timedelta(seconds=60), "default"),
    ("FT_TIMEOUT_SEC", {}, 5, timedelta(seconds=5), "argument"),
    ("FT_TIMEOUT_SEC", {}, timedelta(seconds=7), timedelta(seconds=7), "argument"),
    ("FT_TIMEOUT_SEC", {"FT_TIMEOUT_SEC": "2.5"}, 5, timedelta(seconds=2.5), "env FT_TIMEOUT_SEC"),
    ("FT_TIMEOUT_SEC", {"TORCHFT_TIMEOUT_SEC": "3"}, 5, timedelta(seconds=3), "env TORCHFT_TIMEOUT_SEC"),
    ("FT_TIMEOUT_SEC", {"FT_TIMEOUT_SEC": "2", "TORCHFT_TIMEOUT_SEC": "3"}, None, timedelta(seconds=2),
     "env FT_TIMEOUT_SEC"),
    ("FT_TIMEOUT_SEC", {"FT_TIMEOUT_SEC": "  "}, 5, timedelta(seconds=5), "argument"),  # empty is unset
    ("timeout", {"FT_TIMEOUT_SEC": "4"}, None, timedelta(seconds=4), "env FT_TIMEOUT_SEC"),  # python name
    ("FT_QUORUM_TIMEOUT_SEC", {"TORCHFT_QUORUM_TIMEOUT_SEC": "9"}, None, timedelta(seconds=9),
     "env TORCHFT_QUORUM_TIMEOUT_SEC"),
    ("FT_CONNECT_TIMEOUT_SEC", {}, None, timedelta(seconds=60), "default"),
    ("FT_CONNECT_TIMEOUT_SEC", {"TORCHFT_CONNECT_TIMEOUT_SEC": "1"}, 10, timedelta(seconds=1),
     "env TORCHFT_CONNECT_TIMEOUT_SEC"),
    ("FT_LIGHTHOUSE", {}, None, None, "default"),
    ("FT_LIGHTHOUSE", {"TORCHFT_LIGHTHOUSE": "h:1"}, "a:1", "h:1", "env TORCHFT_LIGHTHOUSE"),
    ("FT_LIGHTHOUSE", {"FT_LIGHTHOUSE": " a:1,b:2 "}, None, "a:1,b:2", "env FT_LIGHTHOUSE"),
    ("FT_MANAGER_PORT", {}, None, 0, "default"),
    ("FT_MANAGER_PORT", {"TORCHFT_MANAGER_PORT": "7"}, 8, 7, "env TORCHFT_MANAGER_PORT"),
    ("FT_QUORUM_RETRIES", {"TORCHFT_QUORUM_RETRIES": "2"}, 0, 2, "env TORCHFT_QUORUM_RETRIES"),
    ("FT_MIN_REPLICA_SIZE", {}, None, 1, "default"),
    ("FT_MIN_REPLICA_SIZE", {"FT_MIN_REPLICA_SIZE": "3"}, 1, 3, "env FT_MIN_REPLICA_SIZE"),
    ("FT_ASYNC_QUORUM", {}, None, True, "default"),
    ("FT_ASYNC_QUORUM", {}, False, False, "argument"),
    ("FT_ASYNC_QUORUM", {"FT_ASYNC_QUORUM": "off"}, True, False, "env FT_ASYNC_QUORUM"),
    ("FT_ASYNC_QUORUM", {"FT_ASYNC_QUORUM": "Yes"}, False, True, "env FT_ASYNC_QUORUM"),
    ("FT_WORLD_SIZE_MODE", {}, None, "dynamic", "default"),
    ("FT_WORLD_SIZE_MODE", {}, F, "fixed_with_spares", "argument"),
    ("FT_WORLD_SIZE_MODE", {"FT_WORLD_SIZE_MODE": "Fixed-With-Spares"}, "dynamic", "fixed_with_spares",
     "env FT_WORLD_SIZE_MODE"),
    ("FT_BACKEND", {}, "GLOO", "gloo", "argument"),
    ("FT_ALLOW_KILL", {}, None, None, "default"),  # unset: Kill allowed exactly when a token is set
    ("FT_ALLOW_KILL", {"FT_ALLOW_KILL": "1"}, False, True, "env FT_ALLOW_KILL"),
    ("FT_TOKEN", {"FT_TOKEN": "s"}, "t", "s", "env FT_TOKEN"),
    ("FT_TOKEN", {}, "t", "t", "argument"),
    ("FT_BABY_START_METHOD", {}, None, "forkserver", "default"),
    ("REPLICA_GROUP_ID", {"REPLICA_GROUP_ID": "2"}, 0, 2, "env REPLICA_GROUP_ID"),
    ("NUM_REPLICA_GROUPS", {}, None, 1, "default"),
]


@pytest.mark.parametrize("key,environ,arg,expected,source", PRECEDENCE)
def test_environment_overrides_argument_overrides_default(key, environ, arg, expected, source):
    assert settings.resolve(key, arg, environ) == (expected, source)
    assert settings.value(key, arg, environ) == expected


def test_the_process_environment_is_read_when_no_mapping_is_given(clean_env):
    clean_env.setenv("TORCHFT_QUORUM_RETRIES", "4")
    assert settings.value("FT_QUORUM_RETRIES", 1) == 4
    assert settings.lookup("FT_QUORUM_RETRIES") == "4"
    assert settings.find("FT_QUORUM_RETRIES") == ("TORCHFT_QUORUM_RETRIES", "4")


BAD_VALUES = [
    # (setting, environment, argument, words the error must contain)
    ("FT_WORLD_SIZE_MODE", {"FT_WORLD_SIZE_MODE": "static"}, None, ["FT_WORLD_SIZE_MODE", "dynamic|fixed_with_spares"]),
    ("FT_WORLD_SIZE_MODE", {}, "static", ["world_size_mode", "dynamic|fixed_with_spares"]),
    ("FT_BACKEND", {"FT_BACKEND": "mpi"}, None, ["FT_BACKEND", "auto|gloo|nccl"]),
    ("FT_BACKEND", {}, "mpi", ["cross_group_backend", "auto|gloo|nccl"]),
    ("FT_BABY_START_METHOD", {"FT_BABY_START_METHOD": "fork"}, None, ["FT_BABY_START_METHOD", "forkserver|spawn"]),
    ("FT_TIMEOUT_SEC", {"FT_TIMEOUT_SEC": "-1"}, None, ["FT_TIMEOUT_SEC", "positive number of seconds"]),
    ("FT_TIMEOUT_SEC", {"FT_TIMEOUT_SEC": "soon"}, None, ["FT_TIMEOUT_SEC", "seconds"]),
    ("FT_TIMEOUT_SEC", {"TORCHFT_TIMEOUT_SEC": "soon"}, None, ["TORCHFT_TIMEOUT_SEC", "seconds"]),
    ("FT_TIMEOUT_SEC", {}, 0, ["timeout", "seconds"]),
    ("FT_ASYNC_QUORUM", {"FT_ASYNC_QUORUM": "maybe"}, None, ["FT_ASYNC_QUORUM", "boolean"]),
    ("FT_ASYNC_QUORUM", {}, 1, ["use_async_quorum", "boolean"]),
    ("FT_MANAGER_PORT", {"FT_MANAGER_PORT": "http"}, None, ["FT_MANAGER_PORT", "integer"]),
    ("FT_MIN_REPLICA_SIZE", {}, True, ["min_replica_size", "integer"]),
    ("REPLICA_GROUP_ID", {"REPLICA_GROUP_ID": "train_a"}, None, ["REPLICA_GROUP_ID", "integer"]),
]


@pytest.mark.parametrize("key,environ,arg,words", BAD_VALUES)
def test_bad_values_are_config_errors_naming_the_variable_and_the_valid_values(key, environ, arg, words):
    with pytest.raises(ConfigError) as err:
        settings.value(key, arg, environ)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("setting", [s for s in settings.SETTINGS if s.parse is not settings.parse_str],
                         ids=lambda s: s.env)
def test_every_typed_setting_rejects_garbage_and_lists_what_it_accepts(setting):
    with pytest.raises(ConfigError) as err:
        settings.value(setting.env, None, {setting.env: "not a value!"})
    message = str(err.value)
    assert setting.env in message and setting.doc in message
    assert (setting.kind in message) if setting.choices else ("valid" in message)


def test_unknown_setting_is_a_key_error():
    with pytest.raises(KeyError, match="FT_NOPE"):
        settings.value("FT_NOPE")


def test_secrets_are_redacted_for_logs():
    assert settings.redact({"FT_TOKEN": "s3cret", "token": "s3cret", "FT_TIMEOUT_SEC": 5}) == \
        {"FT_TOKEN": "***", "token": "***", "FT_TIMEOUT_SEC": 5}
    assert settings.redact({"FT_TOKEN": None}) == {"FT_TOKEN": None}


CROSS_GROUP = [
    ("cpu", None, {}, "gloo"),
    ("cuda", None, {}, "nccl"),
    ("cuda", "gloo", {}, "gloo"),
    ("cuda", "nccl", {"FT_BACKEND": "gloo"}, "gloo"),
]


@pytest.mark.parametrize("device,backend,environ,expected", CROSS_GROUP)
def test_core_users_resolve_ft_backend_like_the_integrations(device, backend, environ, expected):
    assert settings.cross_group_backend(device, backend, environ) == expected


def test_nccl_on_a_cpu_rank_is_a_config_error():
    with pytest.raises(ConfigError, match="FT_BACKEND"):
        settings.cross_group_backend("cpu", None, {"FT_BACKEND": "nccl"})


# --- (d) the Manager gets every setting the integrations offer ------------------------------------------

MANAGER_BASE = dict(replica_id="g", rank=0, world_size=1, min_replica_size=None, use_async_quorum=None, timeout=None,
                    quorum_timeout=None, connect_timeout=None, world_size_mode=None, lighthouse_addr=LH, port=None,
                    hostname="127.0.0.1", heartbeat_interval=timedelta(milliseconds=100), init_sync=True,
                    max_retries=None, quorum_retries=None, token=None)

MANAGER_CASES = [
    # (environment, arguments, (min_replica_size, world_size_mode, use_async_quorum))
    ({}, {}, (1, D, True)),
    ({"FT_MIN_REPLICA_SIZE": "2", "FT_WORLD_SIZE_MODE": "fixed_with_spares", "FT_ASYNC_QUORUM": "0"}, {},
     (2, F, False)),
    ({}, {"min_replica_size": 3, "world_size_mode": F, "use_async_quorum": False}, (3, F, False)),
    ({}, {"world_size_mode": "fixed-with-spares"}, (1, F, True)),
    ({"FT_MIN_REPLICA_SIZE": "2", "FT_ASYNC_QUORUM": "true"}, {"min_replica_size": 3, "use_async_quorum": False},
     (2, D, True)),
    ({"FT_WORLD_SIZE_MODE": "dynamic"}, {"world_size_mode": F}, (1, D, True)),
]


@pytest.mark.parametrize("environ,arguments,expected", MANAGER_CASES)
def test_min_replica_size_world_size_mode_and_async_quorum_reach_the_manager_config(environ, arguments, expected):
    cfg = resolve_config(**{**MANAGER_BASE, **arguments}, environ=environ)
    assert (cfg.min_replica_size, cfg.world_size_mode, cfg.use_async_quorum) == expected


def test_manager_config_reads_the_process_environment(clean_env):
    clean_env.setenv("FT_MIN_REPLICA_SIZE", "2")
    clean_env.setenv("FT_WORLD_SIZE_MODE", "fixed_with_spares")
    clean_env.setenv("FT_ASYNC_QUORUM", "no")
    cfg = resolve_config(**MANAGER_BASE)
    assert (cfg.min_replica_size, cfg.world_size_mode, cfg.use_async_quorum) == (2, F, False)


@pytest.mark.parametrize("environ,words", [
    ({"FT_WORLD_SIZE_MODE": "static"}, ["FT_WORLD_SIZE_MODE", "dynamic|fixed_with_spares"]),
    ({"FT_MIN_REPLICA_SIZE": "0"}, ["FT_MIN_REPLICA_SIZE", ">= 1"]),
    ({"FT_ASYNC_QUORUM": "sometimes"}, ["FT_ASYNC_QUORUM", "boolean"]),
])
def test_bad_manager_settings_from_the_environment_are_config_errors(environ, words):
    with pytest.raises(ConfigError) as err:
        resolve_config(**MANAGER_BASE, environ=environ)
    for word in words:
        assert word in str(err.value)


def test_the_manager_takes_its_defaults_from_the_table():
    params = inspect.signature(Manager.__init__).parameters
    for name in ("min_replica_size", "use_async_quorum", "timeout", "quorum_timeout", "connect_timeout",
                 "world_size_mode", "quorum_retries", "port", "token", "lighthouse_addr"):
        assert params[name].default is None, name
    cfg = resolve_config(**MANAGER_BASE, environ={})
    assert (cfg.timeout, cfg.quorum_timeout, cfg.connect_timeout) == (settings.get("FT_TIMEOUT_SEC").default,
                                                                    settings.get("FT_QUORUM_TIMEOUT_SEC").default,
                                                                    settings.get("FT_CONNECT_TIMEOUT_SEC").default)
    assert (cfg.port, cfg.quorum_retries, cfg.token) == (0, 0, None)
    assert "s3cret" not in repr(resolve_config(**{**MANAGER_BASE, "token": "s3cret"}, environ={}))


def test_one_connect_timeout_default_for_manager_server_and_lighthouse_client():
    server = manager_server.resolve_config("g", LH, "127.0.0.1", "127.0.0.1:0", "", 1, timedelta(milliseconds=100),
                                           None, None, None, None)
    client = lighthouse_client.resolve_client_config(LH, None, None)
    default = settings.get("FT_CONNECT_TIMEOUT_SEC").default
    assert server.connect_timeout == client.connect_timeout == resolve_config(**MANAGER_BASE).connect_timeout == default
    assert (server.quorum_retries, server.allow_kill, server.kill_allowed) == (0, None, False)


def test_manager_server_and_lighthouse_client_read_the_environment(clean_env):
    clean_env.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "3")
    clean_env.setenv("FT_ALLOW_KILL", "1")
    server = manager_server.resolve_config("g", LH, "127.0.0.1", "127.0.0.1:0", "", 1, timedelta(milliseconds=100),
                                           timedelta(seconds=10), None, None, None)
    assert server.connect_timeout == timedelta(seconds=3) and server.kill_allowed
    assert lighthouse_client.resolve_client_config(LH, 10, None).connect_timeout == timedelta(seconds=3)


def test_integrations_use_the_table_defaults():
    lightning = FTSettings.resolve()
    assert (lightning.timeout, lightning.quorum_timeout, lightning.connect_timeout) == (timedelta(seconds=60),) * 3
    assert (lightning.min_replica_size, lightning.world_size_mode, lightning.backend, lightning.use_async_quorum,
            lightning.replica_group_id, lightning.num_replica_groups) == \
        tuple(settings.get(env).default for env in ("FT_MIN_REPLICA_SIZE", "FT_WORLD_SIZE_MODE", "FT_BACKEND",
                                                    "FT_ASYNC_QUORUM", "REPLICA_GROUP_ID", "NUM_REPLICA_GROUPS"))
    accelerate = FaultTolerancePlugin(lighthouse=LH).settings()
    for s in accelerate_plugin.SETTINGS:
        assert s.core is settings.get(s.env), s.name
        if s.name != "lighthouse":
            assert accelerate[s.name] == s.default == accelerate_plugin._plain(s.core.default), s.name


def test_every_setting_the_integrations_offer_is_in_the_core_table_under_the_same_variable():
    offered = {s.env for s in accelerate_plugin.SETTINGS}
    lightning_source = (ROOT / "ft_lightning" / "_common.py").read_text(encoding="utf-8")
    offered |= set(re.findall(r'value\("([A-Z_]+)"', lightning_source))
    assert {"FT_MIN_REPLICA_SIZE", "FT_WORLD_SIZE_MODE", "FT_ASYNC_QUORUM", "FT_BACKEND"} <= offered
    assert offered <= {s.env for s in settings.SETTINGS}


# --- one name per idea: the group's index is replica_group_id --------------------------------------------

def test_accelerate_replica_id_is_a_deprecated_alias_of_replica_group_id(clean_env):
    with pytest.warns(DeprecationWarning, match="replica_group_id"):
        plugin = FaultTolerancePlugin(lighthouse=LH, replica_id=1, num_replica_groups=2)
    assert plugin.replica_group_id == 1 and plugin.sources["replica_group_id"] == "argument"
    with pytest.warns(DeprecationWarning, match="replica_group_id"):
        assert plugin.replica_id == 1
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match="replica_group_id"):
        FaultTolerancePlugin(lighthouse=LH, replica_id=1, replica_group_id=0, num_replica_groups=2)
    with pytest.warns(DeprecationWarning):
        assert settings_to_env({"replica_id": 1}) == {"REPLICA_GROUP_ID": "1"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name never warns
        assert FaultTolerancePlugin(lighthouse=LH, replica_group_id=1, num_replica_groups=2).replica_group_id == 1


def test_accelerate_config_file_key_replica_id_still_loads_with_a_warning(tmp_path):
    path = tmp_path / "ft.yaml"
    path.write_text(f"lighthouse: {LH}\nreplica_id: 1\n")
    with pytest.warns(DeprecationWarning, match="replica_group_id"):
        assert load_config(str(path)) == {"lighthouse": LH, "replica_group_id": 1}


def test_sampler_takes_the_group_index_as_replica_group_id_or_torchfts_replica_rank():
    data = list(range(20))
    by_new = DistributedSampler(data, replica_group_id=1, num_replica_groups=2, shuffle=False)
    by_torchft = DistributedSampler(data, replica_rank=1, num_replica_groups=2, shuffle=False)
    positional = DistributedSampler(data, 1, 2, shuffle=False)
    assert list(by_new) == list(by_torchft) == list(positional) == list(range(1, 20, 2))
    assert by_new.replica_group_id == by_new.replica_rank == 1
    with pytest.raises(ConfigError, match="replica_group_id"):
        DistributedSampler(data, replica_rank=1, replica_group_id=1, num_replica_groups=2)


def test_python_m_ft_core_settings_prints_the_table_without_importing_torch():
    code = ("import runpy, sys; sys.argv = ['ft_core.settings', '--markdown']\n"
            "try:\n    runpy.run_module('ft_core.settings', run_name='__main__')\n"
            "except SystemExit as done:\n    assert done.code == 0 and 'torch' not in sys.modules, sys.modules")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout == settings.markdown_table()
