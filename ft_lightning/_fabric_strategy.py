"""The fault-tolerant Fabric strategy, written once for `lightning.fabric` and `lightning_fabric`.

Fabric has no loop, so the step is marked by the user's calls:
- quorum: started by the first training-mode forward of a module set up by Fabric after the last
  optimizer step (a forward pre-hook), or explicitly with `strategy.start_quorum()`;
- backward: DDP's comm hook averages gradients inside the group, then across groups;
- `optimizer.step()`: applied only when `manager.should_commit()` votes yes (once per step, shared
  by every optimizer); `strategy.last_step_committed` tells the loop (e.g. to skip a scheduler);
- healing: the modules and optimizers set up by Fabric, the precision (GradScaler), RNG states, and
  anything passed to `strategy.register_state(name, obj)` (objects with `state_dict`/
  `load_state_dict`: LR schedulers, a data position...) are loaded from a live group;
- durable checkpoints: `fabric.save` adds the fault-tolerance state (`ft_manager`: the Manager's step
  and batches committed; `ft_data`: the position of the `ft_core.data.DistributedSampler` of a loader
  given to `fabric.setup_dataloaders`), and `fabric.load(path, state)` restores it, so a job whose
  groups all died resumes at the saved step and data position.

Drive the loop by committed steps so a healed group continues where the others are:
`while strategy.manager.current_step() < total_steps: batch = data[strategy.manager.current_step()]`.
"""

from __future__ import annotations

import atexit
import logging
from typing import Any

from ft_core.data import DistributedSampler as FTSampler
from ft_core.ddp import backward_scale, register_comm_hook
from ft_lightning._common import (
    capture_rng,
    create_manager,
    forget_unscale,
    from_transport,
    restore_rng,
    to_transport,
)
from ft_lightning._data import training_shard
from ft_lightning._strategy_base import FTStrategyBase

logger = logging.getLogger(__name__)


class FaultTolerantFabricMixin(FTStrategyBase):
    """Fault tolerance across replica groups for a Fabric `DDPStrategy` (see the module docstring).

    Takes the arguments of `FTStrategyBase` (each falling back to its environment variable); other
    keyword arguments go to Fabric's `DDPStrategy`.
    """

    MANAGER_MISSING = ("the fault-tolerant Manager is created when Fabric sets up the strategy "
                       "(fabric.launch()); call it first")

    def __init__(self, lighthouse_addr: str | None = None, **kwargs: Any) -> None:
        super().__init__(lighthouse_addr, **kwargs)
        self._ft_modules: list[Any] = []
        self._ft_optimizers: list[Any] = []
        self._ft_stateful: dict[str, Any] = {}
        self._quorum_open = False
        self._commit: bool | None = None
        self._rng_at_quorum: dict[str, Any] | None = None
        self.last_step_committed: bool | None = None
        self._ft_sampler: Any = None  # the ft_core.data sampler of a loader set up by Fabric (saved in checkpoints)
        self._ft_data_resume: dict[str, Any] | None = None  # a loaded position waiting for that loader

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shards across every process of every replica group (Fabric's `setup_dataloaders`)."""
        s = self._ft_settings
        return training_shard(s.num_replica_groups, s.replica_group_id, self.world_size,  # type: ignore[attr-defined]
                              self.global_rank)  # type: ignore[attr-defined]

    def register_state(self, name: str, obj: Any) -> None:
        """Also heal `obj` (anything with `state_dict()` / `load_state_dict()`), e.g. an LR scheduler."""
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"register_state({name!r}, ...) needs an object with state_dict() and load_state_dict(), "
                            f"got {type(obj).__name__}")
        self._ft_stateful[name] = obj

    # ---- set-up -----------------------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]   # the group-only default process group
        several = self.world_size > 1  # type: ignore[attr-defined]
        env = self.cluster_environment  # type: ignore[attr-defined]
        self._manager = create_manager(
            self._ft_settings, group_rank=self.global_rank, group_world_size=self.world_size,  # type: ignore[attr-defined]
            device=self.root_device, store_addr=env.main_address if several else None,  # type: ignore[attr-defined]
            store_port=env.main_port if several else None, extra=self._manager_kwargs)
        self._manager_live = True
        self._manager.register_state_dict_fn("fabric", self._load_healed_state, self._healing_state)
        atexit.register(self.shutdown)

    def setup_module(self, module: Any) -> Any:
        ddp = super().setup_module(module)  # type: ignore[misc]
        register_comm_hook(ddp, self.manager)
        ddp.register_forward_pre_hook(self._before_forward)
        self._ft_modules.append(ddp.module)
        return ddp

    def setup_optimizer(self, optimizer: Any) -> Any:
        self._ft_optimizers.append(optimizer)
        return super().setup_optimizer(optimizer)  # type: ignore[misc]

    def process_dataloader(self, dataloader: Any) -> Any:
        """Remember the `ft_core.data.DistributedSampler` of a loader (pass `use_distributed_sampler=False`
        with it), so `fabric.save` / `fabric.load` carry its position."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        for candidate in (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None)):
            if isinstance(candidate, FTSampler):
                if self._ft_sampler is not None and self._ft_sampler is not candidate:
                    logger.warning("ft_lightning: a second ft_core.data.DistributedSampler was set up; checkpoints "
                                   "carry the position of the last one only")
                self._ft_sampler = candidate
                if self._ft_data_resume is not None:
                    candidate.load_state_dict(self._ft_data_resume)
                    self._ft_data_resume = None
                break
        return dataloader

    @property
    def data_sampler(self) -> Any:
        """The `ft_core.data.DistributedSampler` whose position checkpoints carry (None: none set up)."""
        return self._ft_sampler

    # ---- durable checkpoints -------------------------------------------------------------------

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any = None,
                        filter: Any = None) -> None:
        """`fabric.save`: the user's state plus `ft_manager` (step, batches committed) and `ft_data`
        (the sampler's committed position). Save after a committed step, outside a step."""
        state = dict(state)
        if self._manager is not None:
            state["ft_manager"] = dict(self._manager.state_dict())
        if self._ft_sampler is not None:
            state["ft_data"] = self._ft_sampler.state_dict()
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)  # type: ignore[misc]

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """`fabric.load(path, state)`: restores `state` as Fabric does, and the Manager's step and the
        sampler's position from the file (before the first step; a sampler set up later gets it then).
        `fabric.load(path)` with no state only reads: everything comes back, nothing is applied."""
        remainder = super().load_checkpoint(path, state=state, strict=strict,  # type: ignore[misc]
                                            weights_only=weights_only)
        if not state or not isinstance(remainder, dict):
            return remainder
        saved, data = remainder.pop("ft_manager", None), remainder.pop("ft_data", None)
        if saved is not None and self._manager is not None:
            self._manager.load_state_dict(saved)
            logger.info("ft_lightning: resumed the Manager at step %d from %s", self._manager.current_step(), path)
        if data is not None:
            if self._ft_sampler is not None:
                self._ft_sampler.load_state_dict(data)
            else:
                self._ft_data_resume = data
        return remainder

    # ---- the step ---------------------------------------------------------------------------

    def start_quorum(self) -> None:
        """Start this step's quorum now (otherwise the first training forward does it)."""
        self._rng_at_quorum = capture_rng()
        self._commit = None
        self._quorum_open = True
        self.manager.start_quorum()

    def _before_forward(self, module: Any, args: Any) -> None:
        if module.training and not self._quorum_open and self._manager_live:
            self.start_quorum()

    def backward(self, tensor: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        """One vote per optimizer step: a backward after a vote (without a forward in between) starts
        the next step, so its gradients are voted on in a step of their own."""
        if self._manager is not None and self._commit is not None and self._manager_live:
            self.start_quorum()
        if self._manager is None or not self._manager_live:
            super().backward(tensor, module, *args, **kwargs)  # type: ignore[misc]
            return
        with backward_scale(self._manager) as scale:  # the average's division, by the loss (ft_core.ddp)
            loss = tensor if scale == 1.0 else tensor * scale
            super().backward(loss, module, *args, **kwargs)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self._manager is None:
            return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        if self._commit is None:  # one vote covers the optimizers that step before the next backward
            if not self._quorum_open:
                raise RuntimeError("optimizer.step() before any training forward of this step: run the forward "
                                   "pass through the module Fabric set up, or call strategy.start_quorum() first")
            self._commit = bool(self._manager.should_commit())  # applies a healed state first
            self._quorum_open = False
        self.last_step_committed = self._commit
        if self._commit:
            return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]
        forget_unscale(getattr(self.precision, "scaler", None), optimizer)  # type: ignore[attr-defined]
        logger.info("ft_lightning: step not committed; optimizer unchanged (step %d)", self._manager.current_step())
        return None

    # ---- healing ------------------------------------------------------------------------------

    def _healing_state(self) -> dict[str, Any]:
        rng = self._rng_at_quorum if self._rng_at_quorum is not None else capture_rng()
        return {
            "modules": [to_transport(m.state_dict(), clone=True, where="module") for m in self._ft_modules],
            "optimizers": [to_transport(o.state_dict(), clone=True, where="optimizer") for o in self._ft_optimizers],
            "precision": to_transport(self.precision.state_dict(), clone=True, where="precision"),  # type: ignore[attr-defined]
            "stateful": {name: to_transport(obj.state_dict(), clone=True, where=name)
                         for name, obj in self._ft_stateful.items()},
            "rng": to_transport(rng, clone=True, where="rng"),
        }

    def _load_healed_state(self, state: dict[str, Any]) -> None:
        state = from_transport(state)
        if len(state["modules"]) != len(self._ft_modules) or len(state["optimizers"]) != len(self._ft_optimizers):
            raise ValueError(f"healing state has {len(state['modules'])} modules and {len(state['optimizers'])} "
                             f"optimizers, this group set up {len(self._ft_modules)} and {len(self._ft_optimizers)}; "
                             f"every group must set up the same ones in the same order")
        for module, sd in zip(self._ft_modules, state["modules"]):
            module.load_state_dict(sd)
        for optimizer, sd in zip(self._ft_optimizers, state["optimizers"]):
            optimizer.load_state_dict(sd)
        if state.get("precision"):
            self.precision.load_state_dict(state["precision"])  # type: ignore[attr-defined]
        for name, obj in self._ft_stateful.items():
            if name in state["stateful"]:
                obj.load_state_dict(state["stateful"][name])
        restore_rng(state["rng"])

    def shutdown(self) -> None:
        """Stop this group's Manager (Fabric has no end-of-run hook: call it when training is done; it
        also runs at interpreter exit). Idempotent; `manager.current_step()` stays readable."""
        self._quorum_open = False
        self._stop_manager()

    def teardown(self) -> None:
        self.shutdown()
        super().teardown()  # type: ignore[misc]
