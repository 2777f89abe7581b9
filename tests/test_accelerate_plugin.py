"""ft_lightning.accelerate in one process: the plugin's environment resolution, the config file and the
`ftl accelerate config|launch` rules (table-driven), what may travel to a healing group, and commit
gating of a FaultTolerantAccelerator against a real loopback lighthouse."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from datetime import timedelta

import numpy as np
import pytest
import torch

from ft_core.errors import ConfigError
from ft_lightning.accelerate.config import (default_config_path, load_config, resolve_launch_settings,
                                            save_config)
from ft_lightning.accelerate.plugin import SETTINGS, FaultTolerancePlugin, resolve_settings, settings_to_env
from ft_lightning.accelerate.state import capture_rng, load_rng_state, rng_state, transport_problem

from conftest import REPO_ROOT, child_env

LH = "127.0.0.1:29510"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No fault-tolerance variable from the outer environment leaks into a test."""
    for s in SETTINGS:
        monkeypatch.delenv(s.env, raising=False)
    for alias in ("TORCHFT_LIGHTHOUSE", "TORCHFT_TIMEOUT_SEC", "TORCHFT_QUORUM_TIMEOUT_SEC",
                  "TORCHFT_CONNECT_TIMEOUT_SEC"):
        monkeypatch.delenv(alias, raising=False)
    return monkeypatch


# --- plugin: each setting from its environment variable -------------------------------------------------------

ENV_CASES = [
    # (variable, raw value, field, resolved value)
    ("FT_LIGHTHOUSE", "10.0.0.1:29510,10.0.0.2:29510", "lighthouse", "10.0.0.1:29510,10.0.0.2:29510"),
    ("TORCHFT_LIGHTHOUSE", "10.0.0.3:1", "lighthouse", "10.0.0.3:1"),
    ("REPLICA_GROUP_ID", "2", "replica_group_id", 2),
    ("NUM_REPLICA_GROUPS", "4", "num_replica_groups", 4),
    ("FT_MIN_REPLICA_SIZE", "2", "min_replica_size", 2),
    ("FT_TIMEOUT_SEC", "2.5", "timeout", 2.5),
    ("FT_QUORUM_TIMEOUT_SEC", "7", "quorum_timeout", 7.0),
    ("FT_CONNECT_TIMEOUT_SEC", "3", "connect_timeout", 3.0),
    ("FT_WORLD_SIZE_MODE", "fixed_with_spares", "world_size_mode", "fixed_with_spares"),
    ("FT_WORLD_SIZE_MODE", "Fixed-With-Spares", "world_size_mode", "fixed_with_spares"),
    ("FT_BACKEND", "nccl", "backend", "nccl"),
    ("FT_BACKEND", "GLOO", "backend", "gloo"),
    ("FT_ASYNC_QUORUM", "0", "async_quorum", False),
    ("FT_ASYNC_QUORUM", "false", "async_quorum", False),
    ("FT_ASYNC_QUORUM", "yes", "async_quorum", True),
    ("FT_TOKEN", "s3cret", "token", "s3cret"),
]


@pytest.mark.parametrize("var,raw,name,expected", ENV_CASES)
def test_plugin_reads_each_setting_from_its_environment_variable(clean_env, var, raw, name, expected):
    clean_env.setenv("FT_LIGHTHOUSE" if name != "lighthouse" else "UNUSED_X", LH)
    if name == "replica_group_id":
        clean_env.setenv("NUM_REPLICA_GROUPS", "3")
    clean_env.setenv(var, raw)
    plugin = FaultTolerancePlugin()
    assert getattr(plugin, name) == expected
    assert plugin.sources[name].startswith("env ")


def test_environment_overrides_arguments_which_override_defaults(clean_env):
    plugin = FaultTolerancePlugin(lighthouse=LH, min_replica_size=3, timeout=timedelta(seconds=9))
    assert (plugin.min_replica_size, plugin.timeout, plugin.quorum_timeout) == (3, 9.0, 60.0)
    assert plugin.sources["min_replica_size"] == "argument" and plugin.sources["quorum_timeout"] == "default"
    clean_env.setenv("FT_MIN_REPLICA_SIZE", "2")
    clean_env.setenv("FT_TIMEOUT_SEC", "4")
    plugin = FaultTolerancePlugin(lighthouse=LH, min_replica_size=3, timeout=9)
    assert (plugin.min_replica_size, plugin.timeout) == (2, 4.0)
    assert plugin.timedelta("timeout") == timedelta(seconds=4)


def test_plugin_defaults(clean_env):
    plugin = FaultTolerancePlugin(lighthouse=LH)
    assert plugin.settings() == {
        "lighthouse": LH, "replica_group_id": 0, "num_replica_groups": 1, "min_replica_size": 1, "timeout": 60.0,
        "quorum_timeout": 60.0, "connect_timeout": 60.0, "world_size_mode": "dynamic", "backend": "auto",
        "async_quorum": True, "token": None, "host": None, "exactly_once": False, "global_batch_size": None,
        "checkpoint_dir": None}


def test_plugin_is_frozen_and_hides_the_token(clean_env):
    plugin = FaultTolerancePlugin(lighthouse=LH, token="s3cret")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plugin.min_replica_size = 5  # type: ignore[misc]
    assert "s3cret" not in repr(plugin) and "s3cret" not in plugin.describe()


BAD_CASES = [
    # (arguments, environment, words the error must contain)
    ({}, {}, ["no lighthouse", "FT_LIGHTHOUSE", "ftl accelerate config"]),
    ({"lighthouse": LH}, {"FT_TIMEOUT_SEC": "-1"}, ["FT_TIMEOUT_SEC", "seconds"]),
    ({"lighthouse": LH}, {"FT_TIMEOUT_SEC": "soon"}, ["FT_TIMEOUT_SEC"]),
    ({"lighthouse": LH, "timeout": 0}, {}, ["timeout"]),
    ({"lighthouse": LH}, {"FT_BACKEND": "mpi"}, ["FT_BACKEND", "auto|gloo|nccl"]),
    ({"lighthouse": LH, "world_size_mode": "static"}, {}, ["world_size_mode", "dynamic|fixed_with_spares"]),
    ({"lighthouse": LH}, {"FT_ASYNC_QUORUM": "maybe"}, ["FT_ASYNC_QUORUM", "boolean"]),
    ({"lighthouse": LH}, {"REPLICA_GROUP_ID": "train_a"}, ["REPLICA_GROUP_ID", "integer"]),
    ({"lighthouse": LH, "replica_id": 2, "num_replica_groups": 2}, {}, ["REPLICA_GROUP_ID", "0..1"]),
    ({"lighthouse": LH, "num_replica_groups": 0}, {}, ["NUM_REPLICA_GROUPS", ">= 1"]),
    ({"lighthouse": LH, "min_replica_size": 0}, {}, ["FT_MIN_REPLICA_SIZE", ">= 1"]),
    ({"lighthouse": LH, "min_replica_size": True}, {}, ["min_replica_size"]),
    ({"lighthouse": LH, "replica_id": 1.5, "num_replica_groups": 2}, {}, ["replica_id", "integer"]),
    ({"lighthouse": LH, "colour": "blue"}, {}, ["unknown", "colour"]),
]


@pytest.mark.parametrize("arguments,environ,words", BAD_CASES)
def test_invalid_settings_raise_config_errors_that_name_the_cause(arguments, environ, words):
    with pytest.raises(ConfigError) as err:
        resolve_settings(arguments, environ)
    for word in words:
        assert word in str(err.value)


# --- config file ------------------------------------------------------------------------------------------

def test_default_config_path_follows_hf_home():
    assert default_config_path({"HF_HOME": "/data/hf"}) == "/data/hf/accelerate/fault_tolerance.yaml"
    assert default_config_path({"XDG_CACHE_HOME": "/c"}) == "/c/huggingface/accelerate/fault_tolerance.yaml"
    assert default_config_path({}) == os.path.expanduser("~/.cache/huggingface/accelerate/fault_tolerance.yaml")


@pytest.mark.parametrize("name", ["ft.yaml", "ft.json"])
def test_config_file_round_trips_and_is_private(tmp_path, name):
    values = {"lighthouse": LH, "num_replica_groups": 2, "timeout": 5.0, "async_quorum": False,
              "world_size_mode": "fixed_with_spares", "token": "t0k"}
    path = save_config(str(tmp_path / "sub" / name), values)
    assert load_config(path) == values
    assert os.stat(path).st_mode & 0o777 == 0o600


CONFIG_ERRORS = [
    ("lighthouse: [1, 2\n", ["not valid YAML"]),
    ("- a\n- b\n", ["mapping"]),
    ("lighthouse: x\nlighthose: y\n", ["unknown key", "lighthose"]),
    ("min_replica_size: two\n", ["min_replica_size", "integer"]),
    ("async_quorum: 3\n", ["async_quorum", "boolean"]),
]


@pytest.mark.parametrize("text,words", CONFIG_ERRORS)
def test_bad_config_files_are_clear_errors(tmp_path, text, words):
    path = tmp_path / "ft.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    for word in words:
        assert word in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))


LAUNCH_CASES = [
    # (file, environment, flags, expected values, expected sources)
    ({"lighthouse": "f:1", "timeout": 5.0}, {}, {}, {"lighthouse": "f:1", "timeout": 5.0},
     {"lighthouse": "config file", "timeout": "config file"}),
    ({"lighthouse": "f:1"}, {"FT_LIGHTHOUSE": "e:1"}, {}, {"lighthouse": "e:1"}, {"lighthouse": "env FT_LIGHTHOUSE"}),
    ({"lighthouse": "f:1"}, {"FT_LIGHTHOUSE": "e:1"}, {"lighthouse": "c:1"}, {"lighthouse": "c:1"},
     {"lighthouse": "flag"}),
    ({}, {}, {"replica_group_id": "1", "async_quorum": "false"}, {"replica_group_id": 1, "async_quorum": False},
     {"replica_group_id": "flag", "async_quorum": "flag"}),
    ({}, {}, {}, {}, {}),
]


@pytest.mark.parametrize("file_values,environ,flags,values,sources", LAUNCH_CASES)
def test_launch_precedence_is_flag_then_environment_then_config_file(file_values, environ, flags, values, sources):
    assert resolve_launch_settings(file_values, environ, flags) == (values, sources)


def test_settings_travel_as_environment_variables_the_plugin_reads_back(clean_env):
    values = {"lighthouse": LH, "replica_group_id": 1, "num_replica_groups": 2, "timeout": 2.5, "async_quorum": False,
              "world_size_mode": "fixed_with_spares", "backend": "gloo", "min_replica_size": 2,
              "quorum_timeout": 7.0, "connect_timeout": 3.0, "token": "abc", "host": "10.0.0.7",
              "exactly_once": True, "global_batch_size": 24, "checkpoint_dir": "/ckpt/job"}
    env = settings_to_env(values)
    assert env["FT_ASYNC_QUORUM"] == "0" and env["REPLICA_GROUP_ID"] == "1"
    for key, value in env.items():
        clean_env.setenv(key, value)
    assert FaultTolerancePlugin().settings() == values


def test_config_command_writes_flags_and_launch_help_lists_them(tmp_path):
    path = tmp_path / "ft.yaml"
    env = child_env(HF_HOME=str(tmp_path / "hf"))
    run = subprocess.run([sys.executable, "-m", "ft_core.tools.cli", "accelerate", "config", "--config-file", str(path),
                          "--lighthouse", LH, "--num-replica-groups", "2", "--async-quorum", "false"],
                         env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
                         check=False)
    assert run.returncode == 0, run.stderr
    assert load_config(str(path)) == {"lighthouse": LH, "num_replica_groups": 2, "async_quorum": False}
    bad = subprocess.run([sys.executable, "-m", "ft_core.tools.cli", "accelerate", "config", "--config-file", str(path),
                          "--timeout", "-3"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                         stdin=subprocess.DEVNULL, check=False)
    assert bad.returncode == 2 and "timeout" in bad.stderr
    assert load_config(str(path))["lighthouse"] == LH  # a rejected run leaves the file alone


# --- what travels to a healing group ----------------------------------------------------------------------

TRANSPORT_CASES = [
    ({"w": torch.ones(2), "n": np.zeros(3), "lr": 0.1, "k": 3, "name": "x", "on": True, "none": None}, None),
    ({"nested": [{"a": (1, 2.0)}], 0: "int keys are fine"}, None),
    ({"fn": print}, "state['fn'] is a builtins.builtin_function_or_method"),
    ({"s": {1, 2}}, "state['s'] is a builtins.set"),
    ({(1, 2): 3}, "has a key (1, 2)"),
    ({"mode": type("Mode", (str,), {})("max")}, "is a test_accelerate_plugin.Mode"),
    ([object()], "state[0] is a builtins.object"),
]


@pytest.mark.parametrize("value,problem", TRANSPORT_CASES)
def test_only_plain_data_may_travel_to_a_healing_group(value, problem):
    found = transport_problem(value)
    assert (found is None) if problem is None else (problem in found)


def test_rng_states_restore_every_generator():
    import random

    saved = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    for _ in range(3):
        random.random(), np.random.rand(), torch.rand(1)
    # What a transport gives back: lists where tuples were, tensors and numbers otherwise.
    load_rng_state({**saved, "python": {**saved["python"], "internal": saved["python"]["internal"].tolist()}})
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert transport_problem(saved) is None


def test_rng_captured_at_a_step_start_is_sent_as_it_was_then():
    """The step start keeps the generators' states as they are (cheap); a heal converts them later, on the
    quorum thread, after the step has drawn: the peer still gets the step start's states."""
    import random

    captured = capture_rng()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())  # the step draws
    sent = rng_state(captured)  # the source's heal reads it now
    load_rng_state(sent)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    assert transport_problem(sent) is None


# --- commit gating, in this process against a real lighthouse ---------------------------------------------

@pytest.fixture
def accelerator_factory(clean_env):
    """Builds FaultTolerantAccelerators against a loopback lighthouse; shuts them and Accelerate's state down."""
    from accelerate.state import AcceleratorState, GradientState

    from ft_core.control.lighthouse import LighthouseServer
    from ft_lightning.accelerate import FaultTolerantAccelerator

    made = []
    with LighthouseServer(bind="127.0.0.1:0", min_replicas=1, http_bind=None) as lighthouse:
        def make(ft: dict | None = None, cls=FaultTolerantAccelerator, **accelerator_kwargs):
            plugin = FaultTolerancePlugin(lighthouse=lighthouse.address(), timeout=10, quorum_timeout=10,
                                          connect_timeout=10, **(ft or {}))
            made.append(cls(ft=plugin, **{"cpu": True, **accelerator_kwargs}))
            return made[-1]

        try:
            yield make
        finally:
            for accelerator in made:
                accelerator.ft_shutdown()
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _snapshot(model, optimizer, scheduler):
    import copy

    return (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()),
            copy.deepcopy(scheduler.state_dict()))


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def _check_commit_gating(accelerator, clip: bool) -> None:
    """Commit, then a step whose error keeps it from committing, then commit again."""
    device = accelerator.device
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    net = accelerator.unwrap_model(model)
    x, y = torch.randn(8, 4, device=device), torch.randn(8, 1, device=device)

    def train_step(inject_error: bool) -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        if inject_error:  # a failed collective is recorded the same way: the step must not commit
            accelerator.ft_manager.report_error(RuntimeError("injected by the test"))
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    before = _snapshot(net, optimizer, scheduler)
    train_step(inject_error=False)
    assert not accelerator.optimizer_step_was_skipped and accelerator.ft_step == 1
    assert scheduler.get_last_lr() == [0.05]
    assert not torch.equal(net.weight, before[0]["weight"])

    committed = _snapshot(net, optimizer, scheduler)
    train_step(inject_error=True)
    assert accelerator.optimizer_step_was_skipped and accelerator.ft_step == 1
    _assert_same(_snapshot(net, optimizer, scheduler), committed)
    assert scheduler.get_last_lr() == [0.05]

    train_step(inject_error=False)
    assert not accelerator.optimizer_step_was_skipped and accelerator.ft_step == 2
    assert scheduler.get_last_lr() == [0.025]
    assert accelerator.ft_stats == {"step": 2, "commits": 2, "skipped": 1, "cross_group_allreduces": 3}


@pytest.mark.timeout(60)
def test_a_step_that_does_not_commit_is_skipped_and_leaves_optimizer_and_scheduler_unchanged(accelerator_factory):
    _check_commit_gating(accelerator_factory(), clip=True)


@pytest.mark.cuda
@pytest.mark.timeout(90)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_with_nccl_and_fp16_a_skipped_step_changes_nothing_and_training_goes_on(accelerator_factory):
    accelerator = accelerator_factory(cpu=False, mixed_precision="fp16")
    assert accelerator.device.type == "cuda" and accelerator._cross_group_backend() == "nccl"
    _check_commit_gating(accelerator, clip=True)  # clipping unscales: a skipped step must forget that


@pytest.mark.timeout(60)
def test_a_one_process_multi_cpu_group_allreduces_across_groups_once_per_accumulated_step(accelerator_factory,
                                                                                          monkeypatch):
    import socket

    from accelerate.utils import DistributedType

    with socket.socket() as s:  # torchrun's variables for a one-process group, on a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    accelerator = accelerator_factory(gradient_accumulation_steps=4)
    # Accelerate wraps the model in its own DDP here but, with one process, never applies no_sync.
    assert accelerator.distributed_type == DistributedType.MULTI_CPU and not accelerator.use_distributed
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for _ in range(8):
        with accelerator.accumulate(model):
            accelerator.backward(model(torch.randn(2, 4)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
    assert accelerator.ft_stats == {"step": 2, "commits": 2, "skipped": 0, "cross_group_allreduces": 2}


def test_importing_the_accelerate_integration_does_not_import_lightning():
    code = ("import sys, ft_lightning.accelerate as a; a.FaultTolerantAccelerator; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]; "
            "assert not bad, bad")
    run = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr


@pytest.mark.timeout(60)
def test_config_command_asks_on_a_terminal_keeps_defaults_on_enter_and_asks_again_after_a_bad_answer(tmp_path):
    import pty
    import select
    import time

    path = tmp_path / "ft.yaml"
    typed_ahead = [LH,            # lighthouse
                   "two", "2",    # num_replica_groups: a bad answer, then a good one
                   "",            # min_replica_size: keep 1
                   "30",          # timeout
                   "", "",        # quorum_timeout, connect_timeout: keep
                   "fixed_with_spares", "", "n"]  # world_size_mode, backend (keep), async_quorum
    master, slave = pty.openpty()
    # The child takes the pty as its controlling terminal (getpass reads /dev/tty), then runs the command;
    # done in the child itself, since a preexec_fn is unsafe in this threaded test process.
    take_terminal = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                     "os.execv(sys.executable, [sys.executable, '-m', 'ft_core', *sys.argv[1:]])")
    proc = subprocess.Popen([sys.executable, "-c", take_terminal, "accelerate", "config", "--config-file", str(path)],
                            stdin=slave, stdout=slave, stderr=slave, env=child_env(TERM="dumb"), cwd=REPO_ROOT,
                            start_new_session=True)
    os.close(slave)
    transcript = b""

    def read_until(marker: bytes, deadline_s: float) -> None:
        nonlocal transcript
        end = time.monotonic() + deadline_s
        while marker not in transcript and time.monotonic() < end:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    transcript += os.read(master, 4096)
                except OSError:  # the child closed the terminal
                    return

    try:
        os.write(master, ("\n".join(typed_ahead) + "\n").encode())
        read_until(b"(FT_TOKEN)", 30)
        # The hidden token prompt flushes input typed ahead (also an Enter sent just before it switched
        # the echo off): press Enter until the file is written.
        end = time.monotonic() + 20
        while b"wrote " not in transcript and time.monotonic() < end:
            try:
                os.write(master, b"\n")
            except OSError:  # the child is gone
                break
            read_until(b"wrote ", 0.5)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"config still waiting after its last answer:\n{transcript.decode(errors='replace')}")
        assert proc.returncode == 0, transcript.decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"not a valid integer" in transcript
    assert load_config(str(path)) == {
        "lighthouse": LH, "num_replica_groups": 2, "min_replica_size": 1, "timeout": 30.0, "quorum_timeout": 60.0,
        "connect_timeout": 60.0, "world_size_mode": "fixed_with_spares", "backend": "auto", "async_quorum": False,
        "exactly_once": False}


CPU_LAUNCH_CASES = [
    # (cpu, num_processes, mpirun hostfile, rewritten to torchrun on CPU)
    (True, 2, None, True),
    (True, 1, None, False),
    (True, None, None, False),
    (False, 2, None, False),
    (True, 4, "hosts.txt", False),  # MPI launches the processes itself
]


@pytest.mark.parametrize("cpu,num_processes,hostfile,rewritten", CPU_LAUNCH_CASES)
def test_launch_runs_several_cpu_processes_through_torchrun(cpu, num_processes, hostfile, rewritten):
    import argparse

    from ft_lightning.accelerate.cli import run_cpu_processes_with_torchrun

    args = argparse.Namespace(cpu=cpu, num_processes=num_processes, mpirun_hostfile=hostfile, config_file=None,
                              multi_gpu=False)
    environ: dict[str, str] = {}
    assert run_cpu_processes_with_torchrun(args, environ) is rewritten
    assert (args.multi_gpu, args.cpu, environ.get("ACCELERATE_USE_CPU")) == \
        ((True, False, "true") if rewritten else (False, cpu, None))


# --- exactly-once data and save_state / load_state, in this process --------------------------------------------

class _Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i


def _prepared(accelerator, batch_size: int = 4):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(_Indexed(), batch_size=batch_size, shuffle=True)
    return accelerator.prepare(model, optimizer, loader)


@pytest.mark.timeout(60)
def test_exactly_once_refuses_gradient_accumulation(accelerator_factory):
    accelerator = accelerator_factory(ft={"exactly_once": True}, gradient_accumulation_steps=2)
    with pytest.raises(ConfigError, match="gradient_accumulation_steps=2; use 1 with a larger batch_size"):
        _prepared(accelerator)


@pytest.mark.timeout(60)
def test_exactly_once_refuses_diloco_which_has_no_quorum_per_step(accelerator_factory):
    from ft_lightning.accelerate import FaultTolerantDiLoCoAccelerator

    accelerator = accelerator_factory(ft={"exactly_once": True}, cls=FaultTolerantDiLoCoAccelerator)
    with pytest.raises(ConfigError, match="no quorum per step .* use exactly_once=False"):
        accelerator.prepare(torch.utils.data.DataLoader(_Indexed(), batch_size=4))


@pytest.mark.timeout(60)
def test_exactly_once_refuses_a_second_backward_for_one_batch(accelerator_factory):
    accelerator = accelerator_factory(ft={"exactly_once": True})
    model, _, loader = _prepared(accelerator)
    for x, _ in loader:
        accelerator.backward(model(x).sum())
        with pytest.raises(ConfigError, match="one batch per optimizer step"):
            accelerator.backward(model(x).sum())
        break


@pytest.mark.timeout(60)
def test_save_state_holds_the_step_and_data_position_and_load_state_restores_them(accelerator_factory, tmp_path):
    """One group, exactly-once: every training pass is one epoch of 20 samples in 5 steps; save_state after
    step 3 writes the Manager's step and the sampler's position next to Accelerate's files; after two
    more steps load_state brings both back, and the next steps train the samples left after step 3. An
    evaluation pass (model.eval()) reads the whole static shard."""
    accelerator = accelerator_factory(ft={"exactly_once": True})
    model, optimizer, loader = _prepared(accelerator)
    trained: list[int] = []
    for x, idx in loader:
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        trained += idx.tolist()
        if accelerator.ft_step == 3:
            saved_position = loader.ft_sampler.state_dict()
            accelerator.save_state(str(tmp_path / "ckpt"))
        if accelerator.ft_step == 5:
            break
    assert sorted(trained) == list(range(20)) and accelerator.ft_step == 5
    with open(tmp_path / "ckpt" / "fault_tolerance_0.json") as f:
        state = json.load(f)
    assert state["manager"] == {"step": 3, "batches_committed": 3}
    assert state["loaders"][0]["sampler"] == saved_position
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert accelerator.ft_step == 3 and loader.ft_sampler.state_dict() == saved_position
    again: list[int] = []
    for x, idx in loader:
        accelerator.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        again += idx.tolist()
    assert sorted(again) == sorted(trained[12:]) and accelerator.ft_step == 5
    model.eval()
    assert sorted(i for _, idx in loader for i in idx.tolist()) == list(range(20))


def test_final_checkpoint_is_the_newest_save_state_at_the_final_step_or_later(tmp_path):
    from ft_lightning.accelerate.data import final_checkpoint, write_state

    for folder, step in (("group0/step_10", 10), ("group1/step_20", 20), ("group1/step_30", 30), ("lone", 25)):
        os.makedirs(tmp_path / folder)
        write_state(str(tmp_path / folder), 0, {"manager": {"step": step, "batches_committed": step}})
    assert final_checkpoint(str(tmp_path), 20) == (str(tmp_path / "group1" / "step_30"), 30)
    assert final_checkpoint(str(tmp_path), 31) is None
    assert final_checkpoint(str(tmp_path / "lone"), 25) == (str(tmp_path / "lone"), 25)
