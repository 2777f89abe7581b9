"""`FaultTolerantAccelerator`: an `accelerate.Accelerator` whose replica group survives the others' failures.

Accelerate's world stays ONE replica group (its processes, its default process group); the
groups meet only through the Manager: gradients are averaged inside the group, then across the
live groups; `optimizer.step()` applies only when every group's step commits; a group that
joins late heals (model, optimizers, schedulers, scaler, RNG, step, registered objects) from a
live peer inside the commit, then trains on identical to the others.

Step protocol in Accelerate terms: the quorum starts at the first training forward (or at
`accumulate()`) of each accumulation window; the first gated `optimizer.step()` of the window
votes (`Manager.should_commit`); on False every optimizer skips, `optimizer_step_was_skipped`
is True and the schedulers do not step.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from ft_core import ddp
from ft_core.data import DistributedSampler as ExactlyOnceSampler
from ft_core.data import global_shard
from ft_core.errors import ConfigError, FTError, JobFinishedError
from ft_core.manager import Manager, WorldSizeMode
from ft_core.process_groups import (
    ProcessGroupDelegate,
    ProcessGroupGloo,
    ProcessGroupNCCL,
)
from ft_lightning import _data
from ft_lightning._events import attach_console
from ft_lightning.accelerate.data import (
    ExactlyOnceLoader,
    final_checkpoint,
    read_state,
    write_state,
)
from ft_lightning.accelerate.plugin import FaultTolerancePlugin
from ft_lightning.accelerate.state import (
    EpochAlignedLoader,
    capture_rng,
    check_transport_safe,
    load_rng_state,
    rng_state,
)

logger = logging.getLogger(__name__)

# Accelerate modes in which the group's model is (or may be) a plain torch DDP: we can take over its gradients.
SUPPORTED_TYPES = {DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU,
                   DistributedType.MULTI_XPU, DistributedType.MULTI_NPU, DistributedType.MULTI_MLU,
                   DistributedType.MULTI_MUSA, DistributedType.MULTI_SDAA, DistributedType.MULTI_HPU}


class FaultTolerantOptimizer(AcceleratedOptimizer):
    """An `AcceleratedOptimizer` whose step applies only when the replica groups commit.

    On a step that does not commit it sets the overflow flag Accelerate already uses for skipped
    mixed-precision steps, so `accelerator.optimizer_step_was_skipped` is True and every prepared
    scheduler leaves its learning rate alone.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, commit_gate: Callable[[], bool],
                 device_placement: bool = True, scaler: Any = None) -> None:
        super().__init__(optimizer, device_placement=device_placement, scaler=scaler)
        self._commit_gate = commit_gate

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if self.gradient_state.sync_gradients and not self._commit_gate():
            self._is_overflow = True
            if self.scaler is not None:  # forget an unscale_ (gradient clipping) of this skipped step
                self.scaler._per_optimizer_states.pop(id(self.optimizer), None)
            return
        if self.scaler is None:
            self._is_overflow = False  # the scaler path sets it itself
        super().step(closure)


class CountingProcessGroup(ProcessGroupDelegate):
    """The cross-group process group behind a delegate that counts allreduces (reported by `ft_stats`)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.allreduces = 0

    def _collective(self, name: str, args: tuple, opts: Any) -> Any:
        if name.startswith("allreduce"):
            self.allreduces += 1
        return super()._collective(name, args, opts)


@dataclass
class _Window:
    """One accumulation window: its quorum has started; its commit vote, once taken."""

    quorum_started: bool = False
    committed: bool | None = None


class FaultTolerantAccelerator(Accelerator):
    """`Accelerator(**accelerator_kwargs)` plus fault tolerance across replica groups.

    `ft` holds the settings; without it they come from FT_* environment variables (what
    `ftl accelerate launch` exports). `ft_manager` is the `ft_core.Manager` of this process.
    """

    def __init__(self, ft: FaultTolerancePlugin | None = None, **accelerator_kwargs: Any) -> None:
        self.ft = ft if ft is not None else FaultTolerancePlugin()
        if not isinstance(self.ft, FaultTolerancePlugin):
            raise ConfigError(f"ft must be a FaultTolerancePlugin, got {type(self.ft).__name__}")
        super().__init__(**accelerator_kwargs)
        if self.distributed_type not in SUPPORTED_TYPES:
            raise ConfigError(f"FaultTolerantAccelerator supports data parallelism with DDP inside a replica group "
                              f"(single process, multi-CPU, multi-GPU); {self.distributed_type} is not supported: "
                              f"launch without FSDP/DeepSpeed/Megatron/XLA")
        self._ft_window = _Window()
        self._ft_loaders: list[EpochAlignedLoader | ExactlyOnceLoader] = []
        self._ft_warned: set[str] = set()
        self._ft_first_window = True
        self._ft_counts = {"model": 0, "optimizer": 0, "scheduler": 0, "commits": 0, "skipped": 0}
        self._ft_final_step = 0
        logger.info("replica group %s, group rank %d/%d: %s", self.ft.replica_group_id, self.process_index,
                    self.num_processes, self.ft.describe())
        self._ft_rng_at_window_start: dict[str, Any] = capture_rng()
        attach_console()  # one line per membership change, heal and failed step on the console
        self.ft_manager = self._create_manager()
        # The source sends its state from the quorum thread in the middle of its step: the RNG states
        # it sends are those captured at the start of that step's window (never read mid-forward).
        self.ft_manager.register_state_dict_fn("rng", load_rng_state, lambda: rng_state(self._ft_rng_at_window_start))
        if self.scaler is not None:
            self.ft_manager.register_state_dict_fn("scaler", self.scaler.load_state_dict, self.scaler.state_dict)
        # accelerator.save_state / load_state carry the step and the data position too (data.py).
        self.register_load_state_pre_hook(self._ft_load_state_hook)

    # --- construction -------------------------------------------------------------------------------------

    def _cross_group_backend(self) -> str:
        backend = self.ft.backend
        if backend == "auto":
            return "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "nccl" and self.device.type != "cuda":
            raise ConfigError(f"cross-group backend nccl needs a CUDA device, this process runs on {self.device}; "
                              f"set FT_BACKEND=gloo (or auto)")
        return backend

    def _create_process_group(self) -> Any:
        """The cross-group process group the Manager reconfigures on each quorum change (counted)."""
        timeout = self.ft.timedelta("timeout")
        if self._cross_group_backend() == "nccl":
            pg = ProcessGroupNCCL(timeout=timeout)
        else:
            pg = ProcessGroupGloo(timeout=timeout)
        return CountingProcessGroup(pg)

    def _group_store(self) -> tuple[str | None, int | None]:
        """The group's TCPStore (torchrun's, where torch.distributed found its peers) when it has several ranks."""
        if self.num_processes <= 1:
            return None, None
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise ConfigError(f"replica group of {self.num_processes} processes but MASTER_ADDR/MASTER_PORT are "
                              f"unset: start the group with `ftl accelerate launch` / `accelerate launch` / torchrun")
        return addr, int(port)

    def _create_manager(self) -> Any:
        store_addr, store_port = self._group_store()
        mode = {"dynamic": WorldSizeMode.DYNAMIC,
                "fixed_with_spares": WorldSizeMode.FIXED_WITH_SPARES}[self.ft.world_size_mode]
        self._ft_pg = self._create_process_group()
        return Manager(
            self._ft_pg,
            min_replica_size=self.ft.min_replica_size,
            use_async_quorum=self.ft.async_quorum,
            timeout=self.ft.timedelta("timeout"),
            quorum_timeout=self.ft.timedelta("quorum_timeout"),
            connect_timeout=self.ft.timedelta("connect_timeout"),
            rank=self.process_index,
            world_size=self.num_processes,
            world_size_mode=mode,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=self.ft.lighthouse,
            replica_id=str(self.ft.replica_group_id),
            token=self.ft.token,
            hostname=self.ft.host,
        )

    # --- the step protocol --------------------------------------------------------------------------------

    def ft_start_step(self) -> None:
        """Start this accumulation window's quorum (idempotent inside a window; called for you)."""
        window = self._ft_window
        if window.quorum_started and window.committed is None:
            return
        self._ft_rng_at_window_start = capture_rng()  # converted for sending only when a heal reads it
        for loader in self._ft_loaders:
            loader.on_step_start()
        self.ft_manager.start_quorum()
        self._ft_window = _Window(quorum_started=True)
        if self._ft_first_window:
            self._ft_first_window = False
            self._ft_check_job_not_finished()

    # --- a group that comes back after the job finished ---------------------------------------------------

    def _ft_checkpoint_root(self) -> str | None:
        """Where the job's save_state folders are: FT_CHECKPOINT_DIR, else Accelerate's automatic naming."""
        if self.ft.checkpoint_dir:
            return self.ft.checkpoint_dir
        if self.project_configuration.automatic_checkpoint_naming and self.project_dir:
            return os.path.join(self.project_dir, "checkpoints")
        return None

    def _ft_check_job_not_finished(self) -> None:
        """The first quorum, awaited when a checkpoint folder is configured: a job that finished ahead of
        this group with nobody live to heal from (the engine's JobFinishedError) is resumed from its
        checkpoint at the final step instead of being retrained alone; with none, the error ends the run."""
        if self._ft_checkpoint_root() is None:
            return  # the JobFinishedError reaches the script from the step (should_commit), with the engine's advice
        try:
            self.ft_manager.wait_quorum()
        except JobFinishedError as exc:
            self._ft_resume_finished_job(exc)
        except Exception:  # noqa: BLE001 (any other quorum error is the step's, raised where it always is)
            return

    def _ft_resume_finished_job(self, exc: JobFinishedError) -> None:
        root = self._ft_checkpoint_root()
        final = exc.finished_step if exc.finished_step is not None else 0
        found = final_checkpoint(root, final) if root else None
        if found is None:
            raise JobFinishedError(f"{exc}. {root} holds no accelerator.save_state checkpoint at step {final} or "
                                   f"later, so this group stops instead of retraining alone; save_state at the end "
                                   f"of training (into FT_CHECKPOINT_DIR) to let a late group resume",
                                   code=exc.code, finished_step=exc.finished_step, step=exc.step,
                                   finished_groups=exc.finished_groups) from exc
        folder, step = found
        logger.warning("replica group %s: the job finished at step %d while this group was at step %s; resuming "
                       "from its checkpoint %s (step %d) instead of retraining alone", self.ft.replica_group_id,
                       final, exc.step, folder, step)
        self.load_state(folder)
        self.ft_manager.start_quorum()  # at the job's final step now: admitted
        # The batch in hand was drawn before the resume: this step trains nothing.
        self.ft_manager.report_error(FTError(f"resumed from {folder} at step {step}: the step in flight was "
                                             f"started before the resume and does not commit"))

    def ft_should_commit(self) -> bool:
        """The window's commit vote, taken once (at the first gated optimizer step) and then reused."""
        if self._ft_window.committed is None:
            if not self._ft_window.quorum_started:
                self.ft_start_step()
            self._ft_window.committed = bool(self.ft_manager.should_commit())
            self._ft_counts["commits" if self._ft_window.committed else "skipped"] += 1
        return self._ft_window.committed

    @property
    def ft_step(self) -> int:
        """Committed optimizer steps of the job (the same on every live group)."""
        manager = self.ft_manager
        return int(manager.current_step()) if manager is not None else self._ft_final_step

    @property
    def ft_stats(self) -> dict[str, int]:
        """This process's counters: committed step, steps committed and skipped here, cross-group allreduces."""
        return {"step": self.ft_step, "commits": self._ft_counts["commits"], "skipped": self._ft_counts["skipped"],
                "cross_group_allreduces": int(self._ft_pg.allreduces)}

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """One vote per optimizer step: a backward after this window's vote (without a training forward
        in between) starts the next step, so its gradients are reduced and voted on in a step of their own."""
        if self.ft_manager is not None and self._ft_window.committed is not None:
            self.ft_start_step()
        weight = self._ft_loss_weight()
        if self.ft_manager is None:
            super().backward(loss if weight == 1.0 else loss * weight, **kwargs)
            return
        with ddp.backward_scale(self.ft_manager) as scale:  # the average's division, by the loss (ft_core.ddp)
            weight *= scale
            super().backward(loss if weight == 1.0 else loss * weight, **kwargs)

    def _ft_loss_weight(self) -> float:
        """The exactly-once loaders' verdict on this step's batch: 0.0 when it is not the step's assignment
        (a prediction the quorum proved wrong), so it trains nothing; else 1.0."""
        weight = 1.0
        for loader in self._ft_loaders:
            if isinstance(loader, ExactlyOnceLoader) and loader.active and self.ft_manager is not None:
                if not self._ft_window.quorum_started:
                    self.ft_start_step()
                weight *= loader.weigh()
        return weight

    def _on_training_forward(self, module: torch.nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self.ft_start_step()

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        with super().accumulate(*models):
            self.ft_start_step()
            yield

    @contextlib.contextmanager
    def no_sync(self, model: torch.nn.Module) -> Iterator[None]:
        # Accelerate applies DDP's no_sync only when use_distributed (num_processes > 1); with one
        # process per group our DDP still talks to the other groups, so it must be silenced too.
        if not self.use_distributed and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            with super().no_sync(model):
                yield

    # --- prepare ------------------------------------------------------------------------------------------

    def _ft_register(self, kind: str, obj: Any) -> None:
        """Send `obj`'s state_dict to a healing group as the next `<kind>_<n>` (model, optimizer, scheduler)."""
        index = self._ft_counts[kind]
        self._ft_counts[kind] += 1
        self.ft_manager.register_state_dict_fn(f"{kind}_{index}", obj.load_state_dict, obj.state_dict)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        already = getattr(model, "_is_accelerate_prepared", False)
        prepared = super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if evaluation_mode or already or not any(p.requires_grad for p in prepared.parameters()):
            return prepared
        inner = getattr(prepared, "_orig_mod", prepared)  # torch.compile wraps last
        if isinstance(inner, torch.nn.parallel.DistributedDataParallel):
            ddp.register_comm_hook(inner, self.ft_manager)
        else:  # one process, DistributedType.NO: Accelerate did not wrap; the cross-group DDP is ours
            prepared = ddp.DistributedDataParallel(self.ft_manager, prepared)
            prepared._is_accelerate_prepared = True
        prepared.register_forward_pre_hook(self._on_training_forward)
        self._ft_register("model", self.unwrap_model(prepared))
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None
                          ) -> torch.optim.Optimizer:
        if getattr(optimizer, "_is_accelerate_prepared", False) or isinstance(optimizer, AcceleratedOptimizer):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if device_placement is None:
            device_placement = self.device_placement
        # As Accelerate does: MS-AMP's optimizer handles loss scaling itself (FP8BackendType is a str enum).
        scaler = None if getattr(self, "fp8_backend", None) == "MSAMP" else self.scaler
        prepared = FaultTolerantOptimizer(optimizer, self.ft_should_commit, device_placement=device_placement,
                                          scaler=scaler)
        self._optimizers.append(prepared)
        self._ft_register("optimizer", prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> Any:
        already = getattr(scheduler, "_is_accelerate_prepared", False)
        prepared = super().prepare_scheduler(scheduler)
        if not already:
            self._ft_register("scheduler", prepared)
            step = prepared.step

            def aligned_step(*args: Any, **kwargs: Any) -> Any:
                # The epochs a heal skips are not stepped: the healed schedule is already past them.
                if any(loader.aligning for loader in self._ft_loaders):
                    return None
                return step(*args, **kwargs)

            prepared.step = aligned_step
        return prepared

    def prepare_data_loader(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        """Shard across every process of every replica group: process g*W + r of G*W. The result keeps a
        plain `for epoch in range(N)` loop on the job's position after a heal (`EpochAlignedLoader`).
        With exactly-once data, training passes read the exactly-once sampler instead (`ExactlyOnceLoader`)."""
        if isinstance(data_loader, (EpochAlignedLoader, ExactlyOnceLoader)):
            return data_loader
        static = self._ft_static_shard(data_loader, device_placement, slice_fn_for_dispatch)
        if self.ft.exactly_once or self.ft.global_batch_size is not None:
            why = _data.exactly_once_unsupported(data_loader)
            if why is None:
                return self._ft_exactly_once(data_loader, static, device_placement)
            self._ft_warn_once("unsupported", "ft_lightning: exactly-once data is off for a prepared loader: %s", why)
        return self._ft_aligned(static)

    def _ft_static_shard(self, data_loader: torch.utils.data.DataLoader, device_placement: bool | None,
                         slice_fn_for_dispatch: Any) -> Any:
        if self.ft.num_replica_groups == 1 or getattr(data_loader, "_is_accelerate_prepared", False):
            return super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        if self.dispatch_batches:
            raise ConfigError("dispatch_batches=True (one process loads and sends batches) cannot shard across "
                              "replica groups; use DataLoaderConfiguration(dispatch_batches=False)")
        if device_placement is None:
            device_placement = self.device_placement
        shard, shards = global_shard(self.ft.replica_group_id, self.ft.num_replica_groups, self.process_index,
                                     self.num_processes)
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=shards, process_index=shard,
            split_batches=self.split_batches, put_on_device=device_placement, rng_types=self.rng_types.copy(),
            dispatch_batches=False, even_batches=self.even_batches, slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=self.use_seedable_sampler, data_seed=self.dataloader_config.data_seed,
            non_blocking=self.non_blocking, use_stateful_dataloader=self.use_stateful_dataloader,
            torch_device_mesh=self._prepare_device_mesh())
        self._dataloaders.append(prepared)
        return prepared

    def _ft_aligned(self, prepared: Any) -> EpochAlignedLoader:
        loader = EpochAlignedLoader(prepared)
        self.ft_manager.register_state_dict_fn(f"loader_{len(self._ft_loaders)}", loader.load_state_dict,
                                               loader.state_dict)
        self._ft_loaders.append(loader)
        return loader

    def _ft_exactly_once(self, data_loader: torch.utils.data.DataLoader, static: Any,
                         device_placement: bool | None) -> ExactlyOnceLoader:
        """The training loader over the exactly-once sampler (ft_core.data), its position registered with
        the Manager; `static` serves evaluation passes."""
        if self.gradient_accumulation_steps != 1:
            raise ConfigError(f"exactly-once data assigns one batch per optimizer step, but "
                              f"gradient_accumulation_steps={self.gradient_accumulation_steps}; use 1 with a larger "
                              f"batch_size (or global_batch_size=), or exactly_once=False")
        if type(self).ft_start_step is not FaultTolerantAccelerator.ft_start_step:
            raise ConfigError(f"exactly-once data checks every optimizer step's batch in that step's quorum; "
                              f"{type(self).__name__} has no quorum per step (DiLoCo meets every sync_every steps): "
                              f"use exactly_once=False with it")
        if self.split_batches:
            raise ConfigError("exactly-once data assigns each process its own samples; split_batches=True is not "
                              "supported with it (leave split_batches=False, or use exactly_once=False)")
        index = len(self._ft_loaders)
        gbs = self.ft.global_batch_size
        seed = self.dataloader_config.data_seed
        sampler = ExactlyOnceSampler(
            data_loader.dataset, replica_group_id=self.ft.replica_group_id,
            num_replica_groups=self.ft.num_replica_groups, group_rank=self.process_index,
            num_replicas=self.num_processes, shuffle=isinstance(data_loader.sampler, torch.utils.data.RandomSampler),
            seed=0 if seed is None else int(seed), manager=self.ft_manager,
            batch_size=None if gbs is not None else data_loader.batch_size, global_batch_size=gbs,
            state_key="data" if index == 0 else f"data_{index}")
        if device_placement is None:
            device_placement = self.device_placement
        exact = prepare_data_loader(
            _data.exactly_once_loader(data_loader, sampler), self.device, num_processes=1, process_index=0,
            put_on_device=device_placement, rng_types=None, dispatch_batches=False, even_batches=False,
            non_blocking=self.non_blocking)
        loader = ExactlyOnceLoader(exact, static, sampler, self._ft_training_pass, self.ft.num_replica_groups)
        self.ft_manager.register_state_dict_fn(f"loader_{index}", loader.load_state_dict, loader.state_dict)
        self._ft_loaders.append(loader)
        logger.info("exactly-once training data: %d samples, %s per step, seed %d", len(data_loader.dataset),
                    f"{gbs} samples" if gbs is not None else f"batch {data_loader.batch_size} per process",
                    sampler.seed)
        return loader

    def _ft_training_pass(self) -> bool:
        """A loader pass trains unless every prepared model is in eval mode."""
        return not self._models or any(m.training for m in self._models)

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """Accelerate's, except for an exactly-once loader: its position is the sampler's (healed, and
        restored by load_state), so nothing is skipped."""
        if isinstance(dataloader, ExactlyOnceLoader):
            self._ft_warn_once("skip", "ft_lightning: skip_first_batches(%d) ignored for an exactly-once loader: "
                                       "load_state restored its data position already", num_batches)
            return dataloader
        return super().skip_first_batches(dataloader, num_batches)

    def _ft_warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._ft_warned:
            self._ft_warned.add(key)
            logger.warning(message, *args)

    # --- durable checkpoints: save_state / load_state -----------------------------------------------------

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's save_state, then (last, so its presence marks a complete checkpoint) this process's
        fault-tolerance state: the Manager's step and batches committed, and each prepared loader's position."""
        location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        if self.ft_manager is not None:
            path = write_state(location, self.process_index, {
                "replica_group_id": self.ft.replica_group_id, "manager": dict(self.ft_manager.state_dict()),
                "loaders": [loader.checkpoint_state() for loader in self._ft_loaders]})
            logger.info("fault-tolerance state at step %d written to %s", self.ft_step, path)
        return location

    def _ft_load_state_hook(self, models: Any, input_dir: str) -> None:
        if self.ft_manager is None:
            return
        state = read_state(input_dir, self.process_index)
        if state is None:
            logger.warning("%s holds no fault-tolerance state (written without it?): the step and the data "
                           "position start from the beginning", input_dir)
            return
        saved = state.get("loaders", [])
        if len(saved) != len(self._ft_loaders):
            raise ConfigError(f"{input_dir} holds the position of {len(saved)} prepared loader(s), this script "
                              f"prepared {len(self._ft_loaders)}; prepare the same loaders before load_state")
        self.ft_manager.load_state_dict(state["manager"])
        for loader, loader_state in zip(self._ft_loaders, saved):
            loader.load_checkpoint_state(loader_state)
        logger.info("resumed at step %d from %s", self.ft_step, input_dir)

    # --- healing of other state ---------------------------------------------------------------------------

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Accelerate's registration, plus: the objects are sent to (and loaded by) a healing group."""
        for obj in objects:
            if hasattr(obj, "state_dict"):
                check_transport_safe(obj.state_dict(), f"{type(obj).__name__}.state_dict()")
        first = len(self._custom_objects)
        super().register_for_checkpointing(*objects)
        for offset, obj in enumerate(objects):
            self.ft_manager.register_state_dict_fn(f"custom_{first + offset}", obj.load_state_dict, obj.state_dict)

    # --- shutdown -----------------------------------------------------------------------------------------

    def ft_shutdown(self) -> None:
        """Stop this process's Manager (its servers and threads). Idempotent."""
        manager = getattr(self, "ft_manager", None)
        if manager is not None:
            self._ft_final_step = int(manager.current_step())
            self.ft_manager = None
            manager.shutdown()

    def end_training(self) -> None:
        """Accelerate's end of training, after stopping the Manager (it outlives no process group). Training
        ended normally: the lighthouse records this group's final step, so a group restarted later is not
        admitted to retrain the job alone (it resumes from the final checkpoint or stops)."""
        manager = self.ft_manager
        if manager is not None:
            manager.finish()
        self.ft_shutdown()
        super().end_training()

    def __enter__(self) -> FaultTolerantAccelerator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ft_shutdown()
