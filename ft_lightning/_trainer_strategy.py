"""The fault-tolerant Trainer strategy, written once for both Lightning namespaces.

`ft_lightning.strategy.FaultTolerantDDPStrategy` (lightning.pytorch) and
`ft_lightning.pytorch_lightning.FaultTolerantDDPStrategy` are this mixin over each namespace's
`DDPStrategy`. One Trainer is one replica group: Lightning's world (its default process group,
barriers, broadcasts, `sync_dist`) is the group's ranks only and never changes size; everything
that crosses groups goes through the Manager:

- step start (first micro-batch of an accumulation window): `manager.start_quorum()`;
- backward: DDP's comm hook averages gradients inside the group, then across groups;
- `optimizer_step`: the closure always runs, then `manager.should_commit()`; the optimizer steps
  only on commit. A skipped step leaves `global_step`, step-interval LR schedulers, the scheduler
  progress, the optimizer and the GradScaler as they were;
- healing: model, optimizers, LR schedulers, precision (GradScaler), loop progress, RNG and
  callback state are sent to a group that is behind, which continues at the same epoch and batch;
- callbacks and metrics: `reduce` (`self.log(sync_dist=True)`) and `reduce_boolean_decision`
  (ModelCheckpoint, EarlyStopping) run over the live groups, torchmetrics states at a training epoch's
  end (ft_lightning/_metrics.py), and with `rank_zero="quorum"` (the default) one process of the live
  quorum is rank zero, the checkpoints are in one folder shared by the groups (ft_lightning/_dirs.py),
  and `broadcast`/`barrier` at validation and epoch ends span the groups (ft_lightning/_callbacks.py);
- a group that starts after the job finished (its first quorum refused with JobFinishedError) loads
  the job's final checkpoint and ends fit there, or stops with that error (ft_lightning/_late_resume.py).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

from ft_core import settings as ft_settings
from ft_core.data import DistributedSampler as ExactlyOnceSampler
from ft_core.ddp import backward_scale, register_comm_hook
from ft_core.errors import ConfigError, JobFinishedError
from ft_lightning import _callbacks, _data, _dirs, _late_resume, _metrics, _progress
from ft_lightning._common import (
    capture_rng,
    create_manager,
    cross_group_pg,
    forget_unscale,
    from_transport,
    restore_rng,
    to_transport,
)
from ft_lightning._strategy_base import FTStrategyBase

logger = logging.getLogger(__name__)


def window_state(trainer: Any) -> dict[str, Any]:
    """The loop counters and RNG states now, taken at a step start: what a group healing from this step adopts."""
    return {"loops": _progress.snapshot(trainer), "rng": capture_rng()}


class FaultTolerantTrainerMixin(FTStrategyBase):
    """Fault tolerance across replica groups for a Lightning `DDPStrategy` (see the module docstring).

    Arguments: those of `FTStrategyBase` (each falls back to its FT_* variable), plus
        per_group_dirs: write `default_root_dir` and file loggers under `replica_group_<id>` (default True;
            checkpoints too with rank_zero="group"). False leaves every folder as Lightning makes it.
        exactly_once: FT_EXACTLY_ONCE, train every sample once per epoch whatever groups die and heal
            (the training loader gets `ft_core.data.DistributedSampler(manager=...)`; docs/data.md).
            Default False: a static shard per group, lossy while a group is down.
        global_batch_size: FT_GLOBAL_BATCH_SIZE, samples per committed step whatever the number of
            participants (implies exactly_once).
        rank_zero: FT_RANK_ZERO, who is `trainer.is_global_zero` (and Lightning's rank_zero_only):
            "quorum" (default): group rank 0 of the live participating group with the lowest replica rank,
            so one process writes each checkpoint file and log line, as under DDP; the checkpoints go to one
            folder shared by the groups (`<default_root_dir>/checkpoints`, or the ModelCheckpoint's dirpath),
            where `ckpt_path="last"` finds them from any group; logs stay in each group's folder.
            "group" (the opt-out): group rank 0 of every group, each writing its own checkpoints and logs
            under `replica_group_<id>` (docs/lightning.md).
    """

    MANAGER_MISSING = ("the fault-tolerant Manager exists once trainer.fit() has set up the strategy "
                       "(it is created in setup_environment, in every process)")

    def __init__(self, lighthouse_addr: str | None = None, *, per_group_dirs: bool = True,
                 exactly_once: bool | None = None, global_batch_size: int | None = None,
                 rank_zero: str | None = None, **kwargs: Any) -> None:
        super().__init__(lighthouse_addr, **kwargs)
        self._per_group_dirs = per_group_dirs
        self._quorum_rank_zero = ft_settings.value("FT_RANK_ZERO", rank_zero) == "quorum"
        self._live: _callbacks.LiveQuorum | None = None
        self._global_batch_size = ft_settings.value("FT_GLOBAL_BATCH_SIZE", global_batch_size)
        self._exactly_once = bool(ft_settings.value("FT_EXACTLY_ONCE", exactly_once)) or \
            self._global_batch_size is not None
        if self._global_batch_size is not None and self._global_batch_size < 1:
            raise ConfigError(f"global_batch_size (FT_GLOBAL_BATCH_SIZE) must be >= 1, got {self._global_batch_size}")
        self._ft_sampler: Any = None
        self._ft_data_resume: dict[str, Any] | None = None
        namespace = "pytorch_lightning" if any(c.__module__.startswith("pytorch_lightning")
                                               for c in type(self).__mro__) else "lightning.pytorch"
        _dirs.resolve_special_ckpt_paths_per_group(namespace, FaultTolerantTrainerMixin)
        self._window_open = False
        self._window_snapshot: dict[str, Any] | None = None
        self._commit: bool | None = None
        self._window_continues_batch = False  # this step is a batch's second (or later) optimizer step
        self._last_step_applied = True
        self._first_window = False  # the next step start is a fit's first (set when the Manager starts)
        self._job_end_loops: dict[str, Any] | None = None  # loop counters of the job's final checkpoint, loaded
        self._warned_callbacks: set[str] = set()
        self._validating = False  # from a fit's validation start to the next training batch
        self._in_training_step = False

    # ---- set-up -----------------------------------------------------------------------------

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        kwargs = super().distributed_sampler_kwargs  # type: ignore[misc]
        module = self.lightning_module  # type: ignore[attr-defined]
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if trainer is not None and trainer.state.stage == "train":
            s = self._ft_settings
            kwargs = _data.training_shard(s.num_replica_groups, s.replica_group_id, self.world_size,  # type: ignore[attr-defined]
                                          self.global_rank)  # type: ignore[attr-defined]
        return kwargs

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]   # Lightning's group-only default process group
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        self._apply_dirs(trainer)
        if trainer.state.fn == "fit":
            self._start_manager()

    def _apply_dirs(self, trainer: Any) -> None:
        """Per-group log folders, and the shared checkpoint folder with rank_zero="quorum" (_dirs.py)."""
        _dirs.apply_dirs(trainer, self._ft_settings.group_dir_name(), per_group=self._per_group_dirs,
                         shared_checkpoints=self._quorum_rank_zero)

    def _start_manager(self) -> None:
        previous = self._manager.state_dict() if self._manager is not None else None
        several = self.world_size > 1  # type: ignore[attr-defined]
        env = self.cluster_environment  # type: ignore[attr-defined]
        pg = cross_group_pg(self._ft_settings, self.root_device)  # type: ignore[attr-defined]
        self._manager = create_manager(
            self._ft_settings, group_rank=self.global_rank, group_world_size=self.world_size,  # type: ignore[attr-defined]
            device=self.root_device, store_addr=env.main_address if several else None,  # type: ignore[attr-defined]
            store_port=env.main_port if several else None, extra=self._manager_kwargs, pg=pg)
        self._manager_live = True
        self._first_window = True
        self._live = _callbacks.LiveQuorum(
            self._manager, pg, group_rank=self.global_rank,  # type: ignore[attr-defined]
            replica_group_id=self._ft_settings.replica_group_id,
            timeout_s=self._ft_settings.timeout.total_seconds(), in_step=self._in_step,
            at_sync_point=self._at_sync_point)
        if self._quorum_rank_zero:
            _callbacks.set_rank_zero(self._live.leader, self.global_rank)  # type: ignore[attr-defined]
        if previous is not None:  # a second fit() on the same trainer continues the step count
            self._manager.load_state_dict(previous)

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # type: ignore[misc]   # DDP wrap (our comm hook), optimizers, precision
        if self._manager is None or trainer.state.fn != "fit":
            return
        self._manager.register_state_dict_fn("lightning", self._load_healed_state, self._healing_state)
        _metrics.install(self.lightning_module, _metrics.MetricSync(lambda: self._live, self._metrics_cross))  # type: ignore[attr-defined]
        _progress.gate_step_schedulers(trainer, self._scheduler_may_step)
        if self._exactly_once:
            if trainer.accumulate_grad_batches != 1:
                raise ConfigError(f"exactly-once data assigns one batch per step, but accumulate_grad_batches="
                                  f"{trainer.accumulate_grad_batches}; use accumulate_grad_batches=1 with a larger "
                                  f"batch_size (or global_batch_size=), or exactly_once=False")
            if not self.lightning_module.automatic_optimization:  # type: ignore[attr-defined]
                raise ConfigError("exactly-once data scales a batch's loss to 0 when it is not the step's "
                                  "assignment, which needs automatic optimization; use exactly_once=False with "
                                  "manual optimization")

    # ---- exactly-once training data -------------------------------------------------------------

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        trainer = getattr(self.lightning_module, "_trainer", None)  # type: ignore[attr-defined]
        if not self._exactly_once or self._manager is None or trainer is None or trainer.state.stage != "train":
            return dataloader
        why = _data.exactly_once_unsupported(dataloader)
        if why is not None:
            _data._warn_once("unsupported", "ft_lightning: exactly-once data is off for this run: %s", why)
            return dataloader
        assert isinstance(dataloader, _data.DataLoader)
        if self._ft_sampler is None:
            shuffle, seed = _data.sampler_settings(dataloader)
            s = self._ft_settings
            batch = None if self._global_batch_size is not None else dataloader.batch_size
            self._ft_sampler = ExactlyOnceSampler(
                dataloader.dataset, replica_group_id=s.replica_group_id, num_replica_groups=s.num_replica_groups,
                group_rank=self.global_rank, num_replicas=self.world_size,  # type: ignore[attr-defined]
                shuffle=shuffle, seed=seed, manager=self._manager, batch_size=batch,
                global_batch_size=self._global_batch_size)
            if self._ft_data_resume is not None:
                self._ft_sampler.load_state_dict(self._ft_data_resume)
                self._ft_data_resume = None
        elif len(dataloader.dataset) != self._ft_sampler._size:  # type: ignore[arg-type]
            raise ConfigError("the reloaded training dataset changed size; exactly-once data needs the same dataset "
                              "for the whole fit")
        return _data.exactly_once_loader(dataloader, self._ft_sampler)

    @property
    def data_sampler(self) -> Any:
        """The exactly-once training sampler (None when off or before the training loader is set up)."""
        return self._ft_sampler

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._in_training_step = True  # its self.log(sync_dist=True) reduces across groups, in the step
        try:
            output = super().training_step(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._in_training_step = False
        if self._ft_sampler is None or self._manager is None:
            return output
        # After the forward (the quorum overlapped it), before backward: a batch that is not this step's
        # assignment (a prediction the quorum proved wrong) must not train.
        return _data.scale_loss(output, self._ft_sampler.loss_weight())

    def _register_ddp_hooks(self) -> None:
        # Lightning registers comm hooks on CUDA only; ours must run on every device.
        if self._manager is None:
            return super()._register_ddp_hooks()  # type: ignore[misc]
        register_comm_hook(self.model, self._manager)  # type: ignore[attr-defined]

    # ---- the step ---------------------------------------------------------------------------

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)  # type: ignore[misc]
        self._validating = False
        if self._manager is None:
            return
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if batch_idx % trainer.accumulate_grad_batches == 0 or not self._window_open:
            first, self._first_window = self._first_window, False
            try:
                self._open_window(trainer)
                if first:
                    self._first_quorum()
            except JobFinishedError as exc:  # the first quorum: a late group (_late_resume.py)
                self._end_after_job_finished(trainer, exc)

    # ---- a group that starts after the job finished (_late_resume.py) ------------------------

    def _first_quorum(self) -> None:
        """The first quorum of a fit is awaited before its forward pass: a group refused because the job
        finished (JobFinishedError) learns it before training anything. Any other quorum error is the
        step's, raised where it always is (`should_commit`)."""
        try:
            self._manager.wait_quorum()
        except JobFinishedError:
            raise
        except Exception as exc:  # noqa: BLE001 (kept by the quorum future: should_commit raises it)
            logger.debug("ft_lightning: first quorum failed, left to the step: %s", exc)

    def _end_after_job_finished(self, trainer: Any, exc: JobFinishedError) -> None:
        """Load the job's final checkpoint and end fit here (or raise the JobFinishedError, with its fix).
        Ends the epoch loop as Lightning's own `on_train_batch_start() == -1` does, before this batch
        trains; `should_stop` then ends fit."""
        _late_resume.resume_finished_job(self, trainer, exc, self._ft_settings.group_dir_name())
        self._job_end_loops = _progress.snapshot(trainer)
        self._window_open = False
        self._live = None  # no live groups to reduce with or to be rank zero among: this group alone
        if self._quorum_rank_zero:
            _callbacks.set_rank_zero(self.global_rank == 0, self.global_rank)  # type: ignore[attr-defined]
        trainer.should_stop = True
        trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
        raise StopIteration

    def _open_window(self, trainer: Any) -> None:
        # Taken on this (main) thread: the healing state may be read on the Manager's thread while
        # the loop counters and RNG move on.
        self._window_snapshot = window_state(trainer)
        self._commit = None
        self._window_open = True
        self._manager.start_quorum()

    def pre_backward(self, closure_loss: Any) -> None:
        """One vote per optimizer step: a backward after this batch's previous optimizer voted (manual
        optimization, e.g. a GAN's second optimizer) starts the next step, so its gradients are
        reduced and voted on in a step of their own (the Manager refuses a reduction after a vote)."""
        super().pre_backward(closure_loss)  # type: ignore[misc]
        if self._manager is not None and self._commit is not None:
            self._open_window(self.lightning_module.trainer)  # type: ignore[attr-defined]
            self._window_continues_batch = True

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's Strategy.backward, with the loss divided for the cross-group average after the hooks saw
        it and before it is backpropagated (ft_core.ddp.backward_scale: one pass over the gradients less)."""
        if self._manager is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc]
        self.pre_backward(closure_loss)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)  # type: ignore[attr-defined]
        with backward_scale(self._manager) as scale:
            loss = closure_loss if scale == 1.0 else closure_loss * scale
            self.precision_plugin.backward(loss, module, optimizer, *args, **kwargs)  # type: ignore[attr-defined]
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)  # type: ignore[attr-defined]
        self.post_backward(closure_loss)  # type: ignore[attr-defined]
        return closure_loss

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._manager is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        if not self._window_open and self._commit is None:
            self._open_window(trainer)
        result = closure()  # forward + backward: gradients averaged in the group, then across groups
        if self._commit is None:  # one vote covers the optimizers that step before the next backward
            self._commit = bool(self._manager.should_commit())  # applies a healed state first
            self._window_open = False
            self._after_vote()
            if not self._commit and not self._window_continues_batch:  # the batch's logger step, once
                _progress.undo_batches_stepped(trainer)
            self._window_continues_batch = False
        self._last_step_applied = self._commit
        if self._commit:
            return super().optimizer_step(optimizer, lambda: result, model, **kwargs)  # type: ignore[misc]
        forget_unscale(getattr(self.precision_plugin, "scaler", None), optimizer)  # type: ignore[attr-defined]
        _progress.undo_optimizer_step(trainer)
        logger.info("ft_lightning: step not committed; optimizer, LR and global_step (%d) unchanged",
                    trainer.global_step)
        return result

    def _scheduler_may_step(self) -> bool:
        if self._last_step_applied:
            return True
        _progress.undo_scheduler_step(self.lightning_module.trainer)  # type: ignore[attr-defined]
        return False

    # ---- callbacks and metrics over the live quorum (_callbacks.py) ----------------------------

    def _in_step(self) -> bool:
        """Inside `training_step`, between this step's quorum and its vote: every group of the quorum runs
        it, so its reductions are part of the step. (Callbacks that run in the step window, such as
        `on_train_batch_end` of an accumulation window's micro-batches, may run on one group only.)"""
        return self._in_training_step and self._window_open and self._commit is None

    def on_validation_start(self) -> None:
        super().on_validation_start()  # type: ignore[misc]
        self._validating = True

    def _at_sync_point(self) -> bool:
        """Validation (it runs at the same batch on every group, committed or not) or a training epoch's
        end (after its last batch completed): every group of the quorum reduces here, in the same order."""
        return self._validating or self._at_epoch_end()

    def _at_epoch_end(self) -> bool:
        progress = self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress  # type: ignore[attr-defined]
        return bool(progress.is_last_batch) and progress.current.completed == progress.current.ready

    def _metrics_cross(self) -> bool:
        """torchmetrics states cross groups at a training epoch's end only (_metrics.py)."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        return self._manager_live and not trainer.validating and not trainer.sanity_checking and self._at_epoch_end()

    def _after_vote(self) -> None:
        if self._live is None:
            return
        self._live.after_vote()
        if self._quorum_rank_zero:
            _callbacks.set_rank_zero(self._live.leader, self.global_rank)  # type: ignore[attr-defined]

    @property
    def is_global_zero(self) -> bool:
        live = getattr(self, "_live", None)
        if live is not None and self._quorum_rank_zero and self._manager_live:
            return live.leader
        return self.global_rank == 0  # type: ignore[attr-defined]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduction inside the group, then across the live groups (`self.log(sync_dist=True)`).
        A custom `group`, a non-tensor, an unsupported op, or a failed cross-group reduction: the in-group value."""
        out = super().reduce(tensor, group=group, reduce_op=reduce_op)  # type: ignore[misc]
        op = _callbacks.reduce_op_name(reduce_op)
        if self._live is None or not self._manager_live or group is not None or op is None \
                or not isinstance(out, torch.Tensor):
            return out
        reduced = self._live.reduce(out, op)
        return out if reduced is None else reduced

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Lightning's broadcast inside the group; with rank_zero="quorum", at a sync point, then the leader
        group's value to every live group (JSON values only, never pickled; anything else stays in-group)."""
        out = super().broadcast(obj, src)  # type: ignore[misc]
        if self._live is None or not self._manager_live or not self._quorum_rank_zero:
            return out
        made, value = self._live.broadcast(out)
        return value if made else out

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        """Lightning's barrier inside the group; with rank_zero="quorum", at a sync point, then a checked
        barrier of the live groups, bounded by `timeout` (it fails open: logged, never wedged)."""
        super().barrier(name, *args, **kwargs)  # type: ignore[misc]
        if self._live is not None and self._manager_live and self._quorum_rank_zero \
                and _callbacks.crosses_groups(name):
            self._live.barrier()

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """All (or any) of the group's ranks, then of the live groups; the group's answer when that fails."""
        votes = torch.tensor(int(decision), device=self.root_device)  # type: ignore[attr-defined]
        votes = super().reduce(votes, reduce_op="sum")  # type: ignore[misc]
        local = bool(votes == self.world_size) if all else bool(votes)  # type: ignore[attr-defined]
        if self._live is None or not self._manager_live:
            return local
        reduced = self._live.decide(local, all)
        return local if reduced is None else reduced

    # ---- healing ------------------------------------------------------------------------------

    def _healing_state(self) -> dict[str, Any]:
        """What a healing group needs, as the transport carries it (tensors copied: we train on)."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        snap = self._window_snapshot
        if snap is None:
            snap = window_state(trainer)
        return {
            "model": to_transport(self.lightning_module.state_dict(), clone=True, where="model"),  # type: ignore[attr-defined]
            "optimizers": [to_transport(self.optimizer_state(o), clone=True, where="optimizer")  # type: ignore[attr-defined]
                           for o in self.optimizers],  # type: ignore[attr-defined]
            "lr_schedulers": [to_transport(c.scheduler.state_dict(), clone=True, where="lr_scheduler")
                              for c in trainer.lr_scheduler_configs],
            "precision": to_transport(self.precision_plugin.state_dict(), clone=True, where="precision"),  # type: ignore[attr-defined]
            "callbacks": self._callback_states(trainer),
            "loops": to_transport(snap["loops"]),
            "rng": to_transport(snap["rng"], clone=True, where="rng"),
        }

    def _callback_states(self, trainer: Any) -> dict[str, Any]:
        states: dict[str, Any] = {}
        for callback in trainer.callbacks:
            key = str(callback.state_key)
            if _dirs.is_model_checkpoint(callback):
                if self._quorum_rank_zero:  # one writer per event: the healed group takes over the top-k
                    states[key] = to_transport(_callbacks.checkpoint_state(callback), where=f"callback {key}")
                continue  # "group": its paths name this group's files; the healed group keeps its own
            try:
                state = callback.state_dict()
                if state:
                    states[key] = to_transport(state, clone=True, where=f"callback {key}")
            except TypeError as exc:
                if key not in self._warned_callbacks:
                    self._warned_callbacks.add(key)
                    logger.warning("ft_lightning: callback state not sent to healing groups: %s", exc)
        return states

    def _load_healed_state(self, state: dict[str, Any]) -> None:
        """Runs inside `manager.should_commit()` (or a synchronous quorum) on this thread: load the
        source's state, then move the loop counters and the training data to where the source is."""
        trainer = self.lightning_module.trainer  # type: ignore[attr-defined]
        state = from_transport(state)
        self.lightning_module.load_state_dict(state["model"])  # type: ignore[attr-defined]
        for optimizer, sd in zip(self.optimizers, state["optimizers"]):  # type: ignore[attr-defined]
            optimizer.load_state_dict(sd)
        for config, sd in zip(trainer.lr_scheduler_configs, state["lr_schedulers"]):
            config.scheduler.load_state_dict(sd)
        if state.get("precision"):
            self.precision_plugin.load_state_dict(state["precision"])  # type: ignore[attr-defined]
        callbacks = state.get("callbacks") or {}
        for callback in trainer.callbacks:
            key = str(callback.state_key)
            if key not in callbacks:
                continue
            if _dirs.is_model_checkpoint(callback):
                _callbacks.load_checkpoint_state(callback, callbacks[key])
            else:
                callback.load_state_dict(callbacks[key])
        restore_rng(state["rng"])
        local = _progress.snapshot(trainer)
        before = self._window_snapshot["loops"] if self._window_snapshot else local
        now = _progress.adopt(trainer, state["loops"], before)
        epoch = now["epoch"]["current"]["processed"]
        next_batch = now["batch"]["current"]["ready"]
        moved = (epoch, next_batch) != (local["epoch"]["current"]["processed"], local["batch"]["current"]["ready"])
        if moved and self._ft_sampler is None:  # the exactly-once sampler heals its own position
            _data.reposition(trainer, epoch, next_batch)
        if epoch != local["epoch"]["current"]["processed"]:
            self._epoch_started(trainer)
        logger.info("ft_lightning: healed to epoch %d, batch %d, global_step %d", epoch, next_batch - 1,
                    trainer.global_step)

    def _epoch_started(self, trainer: Any) -> None:
        """A heal moved this group into another epoch: its epoch-start hooks run, as after a resume
        into that epoch (callbacks first, then the LightningModule, as Lightning orders them)."""
        call = importlib.import_module(type(trainer).__module__.rsplit(".", 1)[0] + ".call")
        call._call_callback_hooks(trainer, "on_train_epoch_start")
        call._call_lightning_module_hook(trainer, "on_train_epoch_start")

    # ---- checkpoints and teardown --------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self._manager is not None:
            checkpoint["ft_manager"] = dict(self._manager.state_dict())
        if self._ft_sampler is not None:
            checkpoint["ft_data"] = self._ft_sampler.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        saved = checkpoint.get("ft_manager")
        if saved is not None and self._manager is not None:
            self._manager.load_state_dict(saved)
            logger.info("ft_lightning: resumed the Manager at step %d from %s", self._manager.current_step(),
                        checkpoint_path)
        data = checkpoint.get("ft_data")
        if data is not None and self._exactly_once:
            if self._ft_sampler is not None:
                self._ft_sampler.load_state_dict(data)
            else:  # applied when the training loader is set up
                self._ft_data_resume = data
        return checkpoint

    def on_train_end(self) -> None:
        super().on_train_end()  # type: ignore[misc]
        if self._job_end_loops is not None:  # fit ended at the job's final checkpoint (_end_after_job_finished)
            _late_resume.settle_loops(self.lightning_module.trainer, self._job_end_loops)  # type: ignore[attr-defined]
            self._job_end_loops = None
        if self._manager is not None and self._manager_live:  # fit ended normally: a late group is refused
            self._manager.finish()

    def teardown(self) -> None:
        self._window_open = False
        self._stop_manager()
        if self._quorum_rank_zero:  # validate/test after fit: Lightning's own rank zero again
            _callbacks.set_rank_zero(self.global_rank == 0, self.global_rank)  # type: ignore[attr-defined]
        super().teardown()  # type: ignore[misc]
