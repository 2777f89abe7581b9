"""LocalSGD and (Streaming) DiLoCo numerics: real Managers, a real lighthouse and real Gloo groups,
one thread per replica group, against a hand-written reference of the algorithm and against the
expected parameter values of torchft's public regression fixtures (diloco_regression_test.py)."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
from torch import nn

from ft_core.control.lighthouse import LighthouseServer
from ft_core.errors import ConfigError
from ft_core.local_sgd import DiLoCo, LocalSGD
from ft_core.manager import Manager
from ft_core.process_groups import ProcessGroupGloo

TIMEOUT = timedelta(seconds=15)


class FixedStep(torch.optim.Optimizer):
    """p -= lr * grad (torchft's MockOptimizer: deterministic, no state)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class Layers(nn.Module):
    def __init__(self, n: int, shape: tuple[int, ...] = (1, 1)) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(n):
            layer = nn.Module()
            layer.weight = nn.Parameter(torch.ones(shape))
            self.layers.append(layer)


def make_manager(lighthouse: LighthouseServer, replica_id: str, **kwargs: Any) -> tuple[Manager, ProcessGroupGloo]:
    pg = ProcessGroupGloo(timeout=TIMEOUT)
    settings = dict(timeout=TIMEOUT, quorum_timeout=TIMEOUT, connect_timeout=TIMEOUT, use_async_quorum=False)
    settings.update(kwargs)
    return Manager(pg, lighthouse_addr=lighthouse.address(), replica_id=replica_id, **settings), pg


def run_threads(bodies: list[Callable[[], Any]], join_s: float = 60.0) -> list[Any]:
    results: list[Any] = [None] * len(bodies)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = bodies[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), name=f"group-{i}") for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), "a replica group thread hung"
    if errors:
        raise errors[0]
    return results


# ------------------------------------------------------------------ the hand-written reference

def grad_of(group: int, step: int, fragment: int) -> float:
    """A gradient that differs per group, step and fragment, exact in float32."""
    return float((group + 1) * ((step % 3) + 1) + fragment) / 4.0


def reference_diloco(*, groups: int, fragments: int, sync_every: int, delay: int, alpha: float, steps: int,
                     inner_lr: float, outer_lr: float, momentum: float) -> dict[str, list[float]]:
    """DiLoCo written out on floats: every group, every fragment, Nesterov-momentum outer SGD."""
    period = sync_every // fragments
    local = [[1.0] * fragments for _ in range(groups)]
    glob = [1.0] * fragments
    buf: list[float | None] = [None] * fragments
    manager_step, local_step, pending = 0, 0, None
    for t in range(steps):
        for g in range(groups):
            for f in range(fragments):
                local[g][f] -= inner_lr * grad_of(g, t, f)
        local_step += 1
        if local_step == period - delay:
            f = manager_step % fragments
            pending = sum(glob[f] - local[g][f] for g in range(groups)) / groups
        if local_step == period:
            f = manager_step % fragments
            g_avg = pending
            buf[f] = g_avg if buf[f] is None else momentum * buf[f] + g_avg
            new_global = glob[f] - outer_lr * (g_avg + momentum * buf[f])
            for g in range(groups):
                local[g][f] = new_global + alpha * (local[g][f] - new_global)
            glob[f] = new_global
            manager_step += 1
            local_step = 0
    return {"local": [x for row in local for x in row], "global": glob}


def run_diloco(lighthouse: LighthouseServer, i: int, *, fragments: int, sync_every: int, delay: int, alpha: float,
               steps: int, per_fragment_outer: bool, bucketize: bool = False) -> dict[str, Any]:
    manager, pg = make_manager(lighthouse, f"r{i}")
    try:
        model = Layers(fragments)
        inner = FixedStep(model.parameters(), lr=0.5)
        if per_fragment_outer:
            outer: Any = [torch.optim.SGD(layer.parameters(), lr=0.7, momentum=0.9, nesterov=True)
                          for layer in model.layers]
        else:
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        with DiLoCo(manager, list(model.layers), inner, outer, sync_every=sync_every, fragment_sync_delay=delay,
                    fragment_update_alpha=alpha, use_bucketization=bucketize, bucket_cap_mb=1e-6) as diloco:
            for t in range(steps):
                for f, layer in enumerate(model.layers):
                    layer.weight.grad = torch.full_like(layer.weight, grad_of(i, t, f))
                inner.step()
        state = manager.healing_state()["user"]
        return {"local": [layer.weight.item() for layer in model.layers],
                "global": [state[f"StreamingDiLoCoFragment_{f}"]["original_parameters"]["weight"].item()
                           for f in range(fragments)],
                "step": manager.current_step(), "local_step": diloco.local_step}
    finally:
        manager.shutdown()
        pg.shutdown()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fragments,sync_every,delay,alpha,per_fragment_outer", [
    (1, 3, 0, 0.0, False),   # plain DiLoCo
    (1, 4, 2, 0.0, False),   # delay on one fragment
    (2, 6, 0, 0.0, True),    # Streaming: two fragments, an outer optimizer each
    (2, 6, 1, 0.5, True),    # with delay and alpha
    (3, 6, 1, 1.0, False),   # three fragments, one shared outer optimizer, alpha 1
])
def test_diloco_matches_the_hand_written_reference(fragments, sync_every, delay, alpha, per_fragment_outer):
    steps = 2 * sync_every + sync_every // fragments  # ends right after a fragment sync
    with LighthouseServer(min_replicas=3, join_timeout_ms=10_000) as lighthouse:
        results = run_threads([
            (lambda i=i: run_diloco(lighthouse, i, fragments=fragments, sync_every=sync_every, delay=delay,
                                    alpha=alpha, steps=steps, per_fragment_outer=per_fragment_outer))
            for i in range(3)])
    expected = reference_diloco(groups=3, fragments=fragments, sync_every=sync_every, delay=delay, alpha=alpha,
                                steps=steps, inner_lr=0.5, outer_lr=0.7, momentum=0.9)
    syncs = steps // (sync_every // fragments)
    for i, r in enumerate(results):
        assert r["step"] == syncs and r["local_step"] == 0
        assert r["global"] == pytest.approx(expected["global"], abs=1e-5)
        assert r["local"] == pytest.approx(expected["local"][i * fragments:(i + 1) * fragments], abs=1e-5)


@pytest.mark.timeout(60)
def test_bucketized_pseudo_gradients_give_the_same_result():
    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000) as lighthouse:
        results = run_threads([
            (lambda i=i: run_diloco(lighthouse, i, fragments=2, sync_every=4, delay=1, alpha=0.5, steps=6,
                                    per_fragment_outer=False, bucketize=True)) for i in range(2)])
    expected = reference_diloco(groups=2, fragments=2, sync_every=4, delay=1, alpha=0.5, steps=6, inner_lr=0.5,
                                outer_lr=0.7, momentum=0.9)
    for r in results:
        assert r["global"] == pytest.approx(expected["global"], abs=1e-5)


@pytest.mark.timeout(60)
def test_local_sgd_averages_parameters_every_sync_every_steps():
    def body(lighthouse: LighthouseServer, i: int) -> list[float]:
        manager, pg = make_manager(lighthouse, f"r{i}", use_async_quorum=True, init_sync=False)
        try:
            model = nn.Linear(2, 1, bias=False)
            with torch.no_grad():
                model.weight.fill_(1.0)
            opt = FixedStep(model.parameters(), lr=1.0)
            seen = []
            with LocalSGD(manager, model, opt, sync_every=2):
                for t in range(5):
                    model.weight.grad = torch.full_like(model.weight, float(i + t))
                    opt.step()
                    seen.append(model.weight[0, 0].item())
            assert manager.current_step() == 2
            return seen
        finally:
            manager.shutdown()
            pg.shutdown()

    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000) as lighthouse:
        a, b = run_threads([lambda: body(lighthouse, 0), lambda: body(lighthouse, 1)])
    # by hand: group g's weight after steps t=0,1 is 1 - g - (g+1); averaged over g=0,1 -> -1
    assert a[0] == 1.0 and b[0] == 0.0
    assert a[1] == b[1] == pytest.approx(-1.0)  # synced: (1 - 0 - 1 + 1 - 1 - 2) / 2
    assert a[2] == pytest.approx(-3.0) and b[2] == pytest.approx(-4.0)
    assert a[3] == b[3] == pytest.approx((-3.0 - 3.0 - 4.0 - 4.0) / 2)
    assert a[4] != b[4]  # between syncs each group trains on its own


# ------------------------------------------------------------------ torchft's regression fixtures

# Expected values from torchft's test_fixtures/torchft.diloco_regression_test.DiLoCoMockedUpdateTest.*.json:
# two 1x1 layers starting at 1.0, inner lr 1, outer lr 2 (p -= lr * grad), gradient 2 every step,
# sync_every=6, two fragments; "history" (parameters before each inner step) per layer, both replicas.
TORCHFT_FIXTURES = {
    # test_diloco_mocked_updates_0: delay 0, alpha 0
    (0, 0.0): ([1, -1, -3, -11, -13, -15, -17, -19, -21, -35, -37, -39, -41, -43, -45, -59],
               [1, -1, -3, -5, -7, -9, -23, -25, -27, -29, -31, -33, -47, -49, -51, -53]),
    # test_diloco_mocked_updates_4: delay 1, alpha 0.5
    (1, 0.5): ([1, -1, -3, -6, -8, -10, -12, -14, -16, -21.5, -23.5, -25.5, -27.5, -29.5, -31.5, -35.75],
               [1, -1, -3, -5, -7, -9, -15, -17, -19, -21, -23, -25, -29, -31, -33, -35]),
}
# test_diloco_mocked_failure_recovery_0 (delay 0, alpha 0): replica 1 dies after its second sync and
# restarts from the initial model; it heals at its third inner step from replica 0 (at its ninth).
TORCHFT_RECOVERY = {
    0: ([1, -1, -3, -11, -13, -15, -17, -19, -21, -35, -37, -39, -41, -43, -45, -59, -61, -63, -65, -67, -69, -83],
        [1, -1, -3, -5, -7, -9, -23, -25, -27, -29, -31, -33, -47, -49, -51, -53, -55, -57, -71, -73, -75, -77]),
    1: ([1, -1, -3, -35, -37, -39, -41, -43, -45, -59, -61, -63, -65, -67, -69, -83],
        [1, -1, -3, -29, -31, -33, -47, -49, -51, -53, -55, -57, -71, -73, -75, -77]),
}


class _Crash(Exception):
    """Stands in for torchft's injected failure: the replica's loop stops dead."""


def torchft_mock_replica(manager: Manager, *, delay: int, alpha: float, stop_at_step: int,
                         crash_at_step: int | None = None) -> list[list[float]]:
    """torchft's MockDiLoCoTrainer loop: the history of both layers before each inner step."""
    model = Layers(2)
    inner = FixedStep(model.parameters(), lr=1)
    outers = [FixedStep(layer.parameters(), lr=2) for layer in model.layers]
    manager.register_state_dict_fn("default", lambda s: (model.load_state_dict(s["model"]),
                                                         inner.load_state_dict(s["inner_optim"])),
                                   lambda: {"model": model.state_dict(), "inner_optim": inner.state_dict()})
    history: list[list[float]] = [[], []]
    with DiLoCo(manager, list(model.layers), inner, outers, sync_every=6, fragment_sync_delay=delay,
                fragment_update_alpha=alpha):
        while True:
            for f, layer in enumerate(model.layers):
                history[f].append(layer.weight.item())
            if manager.current_step() == stop_at_step:
                return history
            for layer in model.layers:
                layer.weight.grad = torch.full_like(layer.weight, 2.0)
            inner.step()
            if crash_at_step is not None and manager.current_step() == crash_at_step:
                raise _Crash()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("delay,alpha", sorted(TORCHFT_FIXTURES))
def test_reproduces_torchft_mocked_update_fixtures(delay, alpha):
    def body(lighthouse: LighthouseServer, i: int) -> list[list[float]]:
        manager, pg = make_manager(lighthouse, f"replica_{i}")
        try:
            return torchft_mock_replica(manager, delay=delay, alpha=alpha, stop_at_step=5)
        finally:
            manager.shutdown()
            pg.shutdown()

    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000) as lighthouse:
        results = run_threads([lambda: body(lighthouse, 0), lambda: body(lighthouse, 1)])
    layer0, layer1 = TORCHFT_FIXTURES[(delay, alpha)]
    for history in results:
        assert history == [[float(x) for x in layer0], [float(x) for x in layer1]]


@pytest.mark.timeout(90)
def test_reproduces_torchft_failure_recovery_fixture():
    def survivor(lighthouse: LighthouseServer) -> list[list[float]]:
        manager, pg = make_manager(lighthouse, "replica_0")
        try:
            return torchft_mock_replica(manager, delay=0, alpha=0.0, stop_at_step=7)
        finally:
            manager.shutdown()
            pg.shutdown()

    def crashing_then_restarted(lighthouse: LighthouseServer) -> list[list[float]]:
        manager, pg = make_manager(lighthouse, "replica_1")
        try:
            with pytest.raises(_Crash):
                torchft_mock_replica(manager, delay=0, alpha=0.0, stop_at_step=7, crash_at_step=2)
        finally:
            manager.shutdown()
            pg.shutdown()
        manager, pg = make_manager(lighthouse, "replica_1_restarted")  # a fresh incarnation, fresh model
        try:
            return torchft_mock_replica(manager, delay=0, alpha=0.0, stop_at_step=7)
        finally:
            manager.shutdown()
            pg.shutdown()

    with LighthouseServer(min_replicas=2, join_timeout_ms=10_000, heartbeat_timeout_ms=1_000) as lighthouse:
        results = run_threads([lambda: survivor(lighthouse), lambda: crashing_then_restarted(lighthouse)])
    for replica, history in enumerate(results):
        layer0, layer1 = TORCHFT_RECOVERY[replica]
        assert history == [[float(x) for x in layer0], [float(x) for x in layer1]]


# ------------------------------------------------------------------ bad input

@pytest.mark.timeout(30)
def test_bad_arguments_are_refused_with_the_fix():
    with LighthouseServer(min_replicas=1) as lighthouse:
        manager, pg = make_manager(lighthouse, "r0")
        async_manager, pg2 = make_manager(lighthouse, "r1", use_async_quorum=True)
        try:
            model = Layers(2)
            inner = FixedStep(model.parameters(), lr=1)
            outer = FixedStep(model.parameters(), lr=1)
            frags = list(model.layers)
            with pytest.raises(ConfigError, match="use_async_quorum=False"):
                DiLoCo(async_manager, frags, inner, outer, sync_every=2)
            with pytest.raises(ConfigError, match="multiple of the number of fragments"):
                DiLoCo(manager, frags, inner, outer, sync_every=3)
            with pytest.raises(ConfigError, match="fragment_sync_delay"):
                DiLoCo(manager, frags, inner, outer, sync_every=4, fragment_sync_delay=2)
            with pytest.raises(ConfigError, match="fragment_update_alpha"):
                DiLoCo(manager, frags, inner, outer, sync_every=4, fragment_update_alpha=1.5)
            with pytest.raises(ConfigError, match="one per fragment"):
                DiLoCo(manager, frags, inner, [outer], sync_every=4)
            with pytest.raises(ConfigError, match="sync_every must be an integer"):
                LocalSGD(manager, model, inner, sync_every=0)
        finally:
            for m, p in ((manager, pg), (async_manager, pg2)):
                m.shutdown()
                p.shutdown()
