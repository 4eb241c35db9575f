"""Hugging Face's ``Trainer`` with every guarantee of the own-loop API: ``ElasticTrainer`` for ``Trainer``.

A Trainer script keeps its model, ``TrainingArguments``, datasets, collator, callbacks and
``trainer.train(resume_from_checkpoint=...)``, and changes two lines::

    from elastic_train.hf import ElasticTrainer

    trainer = ElasticTrainer(model=model, args=args, train_dataset=data, global_batch=96)

:class:`ElasticTrainer` is ``transformers.Trainer`` with:

- the world size and ranks of the current rendezvous round, any size in the node range (the process group
  accelerate formed from torchrun's environment, adopted by :func:`elastic_train.init`);
- the training DataLoader over a :class:`~elastic_train.integrations.hf_data.MicroBatchSampler`: every sample
  once per epoch across resizes, ``global_batch`` samples per optimizer step at every world size, each rank's
  share in micro-batches of at most ``per_device_train_batch_size`` (``gradient_accumulation_steps`` is set
  for the round), each micro-batch's loss weighted so the update is the gradient of the mean over the step;
  with ``shares="speed"``, each step split by the ranks' measured speeds (docs/stragglers.md);
- a :class:`~elastic_train.Checkpointer` over the model, optimizer, LR scheduler, GradScaler, data position
  and the Trainer's ``state`` (global step, epoch, log history, best metric, stateful callbacks): a memory
  snapshot after every optimizer step, durable checkpoints in the project's format, and the newest state
  anywhere restored when ``train()`` starts; the Trainer's own ``save_steps`` checkpoints are written as
  before and resumed from when the run has no state of ours;
- ``train()`` run through :func:`elastic_train.run`: when a node dies or joins, the survivors re-form their
  process group in-process and re-enter the Trainer's loop (a new DDP wrapper, the same model, optimizer and
  scheduler), restoring the step they agree on;
- the torch generators re-seeded at every optimizer step from (seed, step, rank), so dropout and collator
  randomness do not depend on restarts.

Refused, one line each (:mod:`~elastic_train.integrations.hf_checks`): DeepSpeed, FSDP, tensor/sequence
parallelism, streaming/iterable datasets, other sampling strategies, ``dataloader_drop_last``,
``ignore_data_skip``, ``auto_find_batch_size``, ``average_tokens_across_devices=False``, JIT checkpoints,
hyperparameter search. See docs/huggingface.md.

Private names of transformers and accelerate this module relies on (one place to look when they change):
``Trainer._init_training_state``, ``_prepare_for_training``, ``_run_epoch``, ``_load_rng_state``,
``_load_from_checkpoint``, ``_maybe_log_save_evaluate``, ``_created_lr_scheduler`` and ``_eval_dataloaders``;
accelerate's ``PartialState._shared_state`` and ``AcceleratorState._shared_state``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import deque
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
import transformers.trainer as hf_trainer
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_callback import ExportableState, TrainerControl
from transformers.trainer_utils import get_last_checkpoint

from elastic_train import elastic as et
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.errors import NonRetryableError
from elastic_train.integrations.hf_checks import unsupported_arguments, unsupported_dataset
from elastic_train.integrations.hf_data import (
    MicroBatchSampler,
    default_global_batch,
    micro_weights,
    steps_per_epoch,
)
from elastic_train.log import get_logger
from elastic_train.train.busy import time_collectives
from elastic_train.train.checkpointer import StepHook
from elastic_train.train.config import check_shares
from elastic_train.train.errors import TrainingError
from elastic_train.train.loop import step_seed
from elastic_train.train.sampler import rebuild

log = get_logger(__name__)

__all__ = ["ElasticTrainer", "HFUnsupported"]

#: What ``_run_epoch`` is told it resumes from (the data position is the sampler's, the generators are
#: seeded per step: no file of a Trainer checkpoint is read there).
RESUMED = "<elastic_train snapshot>"
#: Labels the loss ignores (the Trainer's and the models' convention): a padding micro-batch's labels.
IGNORE_INDEX = -100


class HFUnsupported(TrainingError, NonRetryableError):
    """The Trainer is set up in a way ElasticTrainer cannot keep its guarantees with."""

    exit_code = 2


class ElasticTrainer(Trainer):
    """``transformers.Trainer`` made elastic: ranks from the round, exactly-once data, per-step state tiers.

    Takes every argument of ``Trainer`` and these keyword arguments:

    Args:
        global_batch: samples per optimizer step over all ranks, at every world size (default:
            ``per_device_train_batch_size * gradient_accumulation_steps`` * the processes of one node).
        checkpoint: checkpoint root, any fsspec URL (default ``<output_dir>/elastic``); the run's
            checkpoints go to ``checkpoint/run_id`` (``run_id``: torchrun's ``--rdzv-id``).
        every_steps: durable checkpoint every N optimizer steps (default ``config.every_steps``).
        seed: epoch ``e`` of the data walks the permutation seeded ``seed + e``; step ``s`` of rank ``r``
            seeds the torch generators from ``(seed, s, r)`` (default ``args.data_seed``, else ``args.seed``).
        resume_from: a checkpoint of ours to start from when the run has none.
        config: every other checkpoint setting (``keep_last``, ``memory_dir``, ``storage_options`` …).
        run_id: checkpoints go to ``checkpoint/run_id`` (default: torchrun's ``--rdzv-id``).
        hooks: called with the step number at every commit, before the state is saved.
        shares: ``"even"`` or ``"speed"``: each step split by the ranks' measured speeds
            (docs/stragglers.md); the busy times ride in the DDP model's communication hook (none when
            accelerate was given a hook of its own: shares stay even). The number of micro-batches stays
            that of even shares, so a rank with a larger share trains larger micro-batches: up to twice
            ``per_device_train_batch_size`` samples.

    Raises:
        HFUnsupported: a setting it cannot keep its promises with (docs/huggingface.md).
    """

    def __init__(
        self,
        *args: Any,
        global_batch: int | None = None,
        checkpoint: str | None = None,
        every_steps: int | None = None,
        seed: int | None = None,
        resume_from: str | None = None,
        config: CheckpointConfig | None = None,
        run_id: str | None = None,
        hooks: Sequence[StepHook] = (),
        shares: str = "even",
        **kwargs: Any,
    ) -> None:
        check_shares(shares)
        if global_batch is not None and global_batch < 1:
            raise ValueError(f"global_batch: {global_batch} must be >= 1")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        backend = getattr(training_args, "ddp_backend", None)
        # The process group: accelerate formed it when TrainingArguments was made (torchrun), or a world of
        # one; adopting it also makes an elastic_train error that ends the script one line.
        et.init(backend if backend in ("gloo", "nccl") else "auto")
        if training_args is not None:
            _refuse(unsupported_arguments(training_args))
        super().__init__(*args, **kwargs)
        _refuse(unsupported_arguments(self.args))
        # (load-time sharding: transformers 5.25 and later)
        sharded_load = getattr(self, "is_distributed_loading_by_transformers", False)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or sharded_load:
            _refuse(
                "a DeepSpeed, FSDP or load-time sharded model (set up through accelerate's environment or "
                "from_pretrained) is not supported by ElasticTrainer: ElasticTrainer is DDP"
            )
        if self.accelerator.distributed_type == DistributedType.NO and "LOCAL_RANK" in os.environ:
            _refuse(
                "accelerate sees no distributed set-up (no GPU, and use_cpu is not set), so the Trainer "
                "would train each rank on its own: give TrainingArguments(use_cpu=True) for DDP on CPUs"
            )
        if self.args.n_gpu > 1:
            _refuse(
                f"{self.args.n_gpu} GPUs in one process (DataParallel) are not supported by ElasticTrainer: "
                "start one process per device (torchrun --nproc-per-node)"
            )
        configured = self.args.gradient_accumulation_steps
        self.global_batch = global_batch or default_global_batch(
            self.args.per_device_train_batch_size, configured, et.current_world().local_world_size
        )
        self.seed = seed if seed is not None else (self.args.data_seed or self.args.seed)
        self.shares = shares
        self._backend = backend if backend in ("gloo", "nccl") else "auto"
        self._ckpt_args: dict[str, Any] = {
            "url": checkpoint or os.path.join(str(self.args.output_dir), "elastic"),
            "every_steps": every_steps,
            "resume_from": resume_from,
            "config": config,
            "run_id": run_id,
            "hooks": tuple(hooks),
        }
        #: The sampler the training DataLoader draws from (made by the first ``get_train_dataloader``).
        self.sampler: MicroBatchSampler | None = None
        #: The state tiers of the ``train()`` in progress (None outside it).
        self.checkpointer: et.Checkpointer | None = None
        self._configured_accumulation = configured
        self._resumed: str | None = None  # this train() entry resumed: "ours", or "trainer" (its checkpoint)
        self._trainer_checkpoint: str | bool | None = None  # train()'s resume_from_checkpoint
        self._weights: deque[float] = deque()  # loss factors of the step's micro-batches still to come
        self._timed: Any = None  # the DDP wrapper whose all-reduce waits are timed
        self._step_loss: torch.Tensor | None = None
        self._backward = self.accelerator.backward
        self.accelerator.backward = self._weighted_backward

    # -- the round -------------------------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train`` in the current round's group, entered again in each group re-formed in-process
        after a membership change; resumes from the newest state of ours (else ``resume_from_checkpoint``)
        and writes the final durable checkpoint at the end."""
        if trial is not None:
            _refuse("hyperparameter search (a trial) is not supported by ElasticTrainer: one run, one state")

        def body(world: et.World) -> Any:
            self._adopt(world)
            # read in _init_training_state, and only when the run has no state of ours (the Trainer would read
            # it first, to have it overwritten by ours: seconds of a large model's weights at every restart)
            self._trainer_checkpoint = resume_from_checkpoint
            try:
                output = Trainer.train(self, None, None, ignore_keys_for_eval, **kwargs)
                if self.checkpointer is not None:
                    self.checkpointer.finalize()  # collective: a peer lost here re-forms and finalizes again
                    self.checkpointer = None
            except BaseException as exc:
                self._leave_group(exc)
                raise
            return output

        try:
            return et.run(body, backend=self._backend)
        finally:
            self.args.gradient_accumulation_steps = self._configured_accumulation

    def _adopt(self, world: et.World) -> None:
        """Make accelerate's view of the process group (the ranks TrainingArguments and the Trainer read) the
        round's: a group re-formed in-process has other ranks than the one accelerate formed."""
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            if shared.get("distributed_type") not in (None, DistributedType.NO):
                shared.update(num_processes=world.world_size, process_index=world.rank)
        if hasattr(self, "_eval_dataloaders"):
            del self._eval_dataloaders  # prepared for the previous group's ranks
        self._resumed = None
        self._weights.clear()

    def _leave_group(self, exc: BaseException) -> None:
        """Drop what belongs to the current process group (its DDP wrapper, the checkpoint manager) after
        ``exc``: the group is destroyed next (a re-formation: the agent is asked for it first) or the process
        ends; the memory snapshot stays."""
        ckpt, self.checkpointer = self.checkpointer, None
        if ckpt is not None:
            ckpt.close_after(exc)
        self.model_wrapped = self.model  # type: ignore[assignment]
        self._timed = None
        self.accelerator.free_memory()
        self._weights.clear()
        self._step_loss = None

    # -- data ------------------------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader[Any]:
        """The Trainer's training DataLoader (its collator, workers, pinning …) drawing from the elastic
        sampler; sets ``gradient_accumulation_steps`` for this world size."""
        _refuse(unsupported_dataset(self.train_dataset))
        loader = super().get_train_dataloader()
        if self.sampler is None:
            self.sampler = MicroBatchSampler(
                loader.dataset, self.global_batch, self._train_batch_size, seed=self.seed, shares=self.shares
            )
        self.args.gradient_accumulation_steps = self.sampler.accumulation
        log.info(
            "hf_batches",
            global_batch=self.global_batch,
            world_size=self.sampler.world_size,
            micro_batch=self._train_batch_size,
            accumulation=self.sampler.accumulation,
        )
        return rebuild(loader, self.sampler)

    def get_resumed_dataloader(self, dataloader: DataLoader[Any], num_batches: int) -> DataLoader[Any]:
        """The elastic sampler already starts at the saved position: nothing to skip (transformers 5.25
        and later ask this; earlier ones call accelerate's ``skip_first_batches``, see :func:`_no_skip`)."""
        if dataloader.batch_sampler is self.sampler:
            return dataloader
        skip: Any = getattr(super(), "get_resumed_dataloader", None) or hf_trainer.skip_first_batches
        return skip(dataloader, num_batches)

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], Any]:
        """The step's micro-batches (padding ones with their labels masked) and the loss factor of each."""
        sampler = self.sampler
        if sampler is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        self._seed_step(self.state.global_step + 1)
        size, counts = sampler.micro_counts()
        if len(counts) != num_batches:
            raise TrainingError(
                f"the Trainer asks for {num_batches} micro-batches of step {self.state.global_step + 1}, the "
                f"elastic sampler has {len(counts)}: gradient_accumulation_steps was changed during training"
            )
        pairs = zip(counts, epoch_iterator, strict=False)  # never reads past the step's micro-batches
        masked = (_mask(batch) if count == 0 else batch for count, batch in pairs)
        samples, num_items = super().get_batch_samples(masked, num_batches, device)
        self._weights = deque(self._loss_factors(counts, size, num_items))
        return samples, num_items

    def _loss_factors(self, counts: list[int], size: int, num_items: Any) -> list[float]:
        """Each micro-batch's factor, for the loss the Trainer computes (see ``Trainer.training_step``)."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers 5.25 and later say it
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs and num_items is not None
            scaled = scaled or self.compute_loss_func is not None
        if scaled and num_items is not None:
            # Normalised by the step's label count over all ranks (average_tokens_across_devices) and
            # multiplied by the world size: the step's mean after DDP's average; padding has no labels left.
            return [1.0 if k else 0.0 for k in counts]
        # A mean over the micro-batch, divided by the accumulation steps unless the loss says it is scaled.
        return micro_weights(counts, size, self.args.world_size, 1 if scaled else len(counts))

    def _weighted_backward(self, loss: torch.Tensor, **kwargs: Any) -> Any:
        """``accelerator.backward`` of the micro-batch's loss times its factor (what is logged stays the
        Trainer's loss)."""
        detached = loss.detach()
        self._step_loss = detached if self._step_loss is None else self._step_loss + detached
        if self._weights:
            factor = self._weights.popleft()
            if factor != 1.0:
                loss = loss * factor
        return self._backward(loss, **kwargs)

    def _seed_step(self, step: int) -> None:
        """Seed the generators the step draws from (dropout, a collator's masking) from (seed, step, rank):
        the same after any resume, different on every rank at every world size."""
        value = step_seed(self.seed, step, self.args.process_index)
        torch.default_generator.manual_seed(value)
        if self.args.device.type == "cuda":
            torch.cuda.default_generators[self.args.device.index or 0].manual_seed(value)

    # -- restore ---------------------------------------------------------------------------------------------
    def _init_training_state(
        self,
        max_steps: int,
        num_update_steps_per_epoch: int,
        num_train_epochs: int,
        resume_from_checkpoint: str | None,
        trial: Any,
    ) -> tuple[int, int]:
        """Collectively, the newest state of ours anywhere into the model, optimizer, scheduler, scaler, data
        position, RNGs and the Trainer's state; without one, the Trainer's checkpoint given to ``train()``
        (as the Trainer resumes from it); returns where the epoch loop starts (epoch, micro-batches of that
        epoch already trained)."""
        epochs, micro_done = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, None, trial
        )
        sampler = self.sampler
        assert sampler is not None, "get_train_dataloader() makes the sampler first"
        # The optimizer and scheduler are made now (the Trainer makes them in _prepare_for_training), so the
        # restore can load into them; the Trainer keeps them.
        self.create_optimizer()
        self.create_scheduler(num_training_steps=max_steps)
        optimizer = self.optimizer
        if isinstance(optimizer, AcceleratedOptimizer):
            optimizer = optimizer.optimizer
        extra: dict[str, Any] = {"trainer": _Progress(self)}
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            extra["scaler"] = scaler
        assert self.model is not None, "the Trainer has its model by now"
        state = et.TrainState(
            model=self.model, optimizer=optimizer, scheduler=self.lr_scheduler, sampler=sampler, **extra
        )
        args = {k: v for k, v in self._ckpt_args.items() if k not in ("url", "hooks")}
        self.checkpointer = et.Checkpointer(
            state, self._ckpt_args["url"], **args, hooks=self._ckpt_args["hooks"]
        )
        step = self.checkpointer.restore()
        if step > 0:
            if sampler.cursor % self.global_batch:
                _refuse(
                    f"the run's checkpoint was trained with another global batch (its data position "
                    f"{sampler.cursor} is not a step boundary of global_batch={self.global_batch})"
                )
            self._resumed = "ours"
            log.info("hf_resumed", step=step, epoch=sampler.epoch, source=self.checkpointer.source)
            return sampler.epoch, sampler.cursor // self.global_batch * sampler.accumulation
        checkpoint = self._trainer_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(str(self.args.output_dir))
            if checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if isinstance(checkpoint, str):
            # nothing of ours: what Trainer.train does with resume_from_checkpoint, in the same order (the
            # weights before the model is prepared, the optimizer and scheduler in _prepare_for_training)
            self._trainer_checkpoint = checkpoint
            self._load_from_checkpoint(checkpoint)
            epochs, micro_done = super()._init_training_state(
                max_steps, num_update_steps_per_epoch, num_train_epochs, checkpoint, trial
            )
            self._resumed = "trainer"
            log.info("hf_resumed", step=self.state.global_step, source=checkpoint)
        # the data position of the Trainer's global step (every epoch has the same steps of global_batch)
        global_step = self.state.global_step
        sampler.epoch, done = divmod(global_step, steps_per_epoch(sampler.dataset_len, self.global_batch))
        sampler.cursor = done * self.global_batch
        state.step = sampler.step = global_step
        return epochs, micro_done

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any
    ) -> Any:
        created = self._created_lr_scheduler
        self._created_lr_scheduler = False  # keep the scheduler made (and restored) in _init_training_state
        checkpoint = self._trainer_checkpoint if self._resumed == "trainer" else None
        try:
            return super()._prepare_for_training(max_steps, train_dataloader, checkpoint)
        finally:
            self._created_lr_scheduler = created

    def _run_epoch(
        self,
        model: Any,
        epoch: Any,
        train_dataloader: Any,
        steps_in_epoch: Any,
        num_update_steps_per_epoch: Any,
        trial: Any,
        ignore_keys_for_eval: Any,
        start_time: Any,
        resume_from_checkpoint: Any,
        epochs_trained: Any,
        steps_trained_in_current_epoch: Any,
    ) -> Any:
        """The Trainer's epoch; the first one after a restore resumes at its data position (the sampler
        starts there: the Trainer only counts the micro-batches trained before)."""
        if self._resumed and epoch == epochs_trained:
            resume_from_checkpoint = RESUMED
        self._time_collectives(model)
        with _no_skip(self):
            return super()._run_epoch(
                model=model,
                epoch=epoch,
                train_dataloader=train_dataloader,
                steps_in_epoch=steps_in_epoch,
                num_update_steps_per_epoch=num_update_steps_per_epoch,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                start_time=start_time,
                resume_from_checkpoint=resume_from_checkpoint,
                epochs_trained=epochs_trained,
                steps_trained_in_current_epoch=steps_trained_in_current_epoch,
            )

    def _time_collectives(self, model: Any) -> None:
        """The group's DDP model times its wait for the others' gradients (slow-node detection tells a
        rank's work from that wait), once per wrapper and before its first backward; a model given a
        communication hook through accelerate keeps that one, untimed."""
        ckpt = self.checkpointer
        if not isinstance(model, DistributedDataParallel) or model is self._timed or ckpt is None:
            return
        self._timed = model
        try:
            time_collectives(model, ckpt.clock)
        except RuntimeError as exc:  # a hook is registered already (one per DDP model)
            log.info("hf_untimed", reason=str(exc).splitlines()[0])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Nothing: the torch generators are seeded per step (:meth:`_seed_step`), the others restored with
        the snapshot; a Trainer checkpoint's per-rank files would not fit another world size anyway."""

    # -- the step --------------------------------------------------------------------------------------------
    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's logging, evaluation and save of the step, then the commit: the step's snapshot holds
        its log entries and the data position after it."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        ckpt = self.checkpointer
        if ckpt is None or self.state.global_step <= ckpt.step:
            return  # the epoch's end: its last step is committed already
        if self._weights:
            raise TrainingError(
                f"step {self.state.global_step}: {len(self._weights)} micro-batch(es) did not go through "
                "accelerator.backward (a training_step of your own must call it once per micro-batch)"
            )
        loss, self._step_loss = self._step_loss, None
        ckpt.commit(loss)


class _Progress:
    """The Trainer's ``state`` (and its stateful callbacks) as a state-dict-able part of the snapshot."""

    #: TrainerState fields that are progress; the others are set from the arguments at every ``train()``.
    FIELDS = (
        "epoch",
        "global_step",
        "num_input_tokens_seen",
        "total_flos",
        "best_metric",
        "best_global_step",
        "best_model_checkpoint",
        "stateful_callbacks",
    )

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._logs: list[str] = []  # log_history entries as JSON, kept: the history only grows
        self._logged: list[Any] = []

    def state_dict(self) -> dict[str, Any]:
        state = self.trainer.state
        fields = {name: getattr(state, name) for name in self.FIELDS}
        history = state.log_history
        kept = zip(self._logged, history, strict=False)
        if len(history) < len(self._logs) or any(a is not b for a, b in kept):
            self._logs, self._logged = [], []
        for entry in history[len(self._logs) :]:
            self._logs.append(json.dumps(entry))
            self._logged.append(entry)
        callbacks = {
            type(cb).__name__: cb.state()
            for cb in self.trainer.callback_handler.callbacks
            if isinstance(cb, ExportableState) and not isinstance(cb, TrainerControl)
        }
        return {
            "state": json.dumps(fields),
            "log_history": "[" + ",".join(self._logs) + "]",
            "callbacks": json.dumps(callbacks),
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        state = self.trainer.state
        for name, value in json.loads(saved["state"]).items():
            if name in self.FIELDS:
                setattr(state, name, value)
        state.log_history = json.loads(saved["log_history"])
        self._logs, self._logged = [], []
        callbacks = json.loads(saved["callbacks"])
        for cb in self.trainer.callback_handler.callbacks:
            kept = callbacks.get(type(cb).__name__)
            if isinstance(kept, Mapping) and isinstance(cb, ExportableState):
                for name, value in (kept.get("attributes") or {}).items():
                    setattr(cb, name, value)


def _mask(batch: Any) -> Any:
    """A padding micro-batch: its labels ignored by the loss (and by the Trainer's label count)."""
    if isinstance(batch, MutableMapping):
        for key in ("labels", "shift_labels"):
            value = batch.get(key)
            if isinstance(value, torch.Tensor):
                batch[key] = torch.full_like(value, IGNORE_INDEX)
    return batch


def _refuse(reason: str | None) -> None:
    if reason is not None:
        raise HFUnsupported(reason)


def _import_what_train_imports() -> None:
    """Import now what a Trainer imports on its way to the first step, so a fork server that preloads this
    module (``--preload elastic_train.hf``) hands it to every worker it forks."""
    import importlib

    for name in ("manager", "durable", "memory", "preflight", "schema"):
        importlib.import_module(f"elastic_train.checkpoint.{name}")
    for name in ("transformers.data.data_collator", "accelerate.data_loader"):
        importlib.import_module(name)


_import_what_train_imports()


@contextlib.contextmanager
def _no_skip(trainer: ElasticTrainer) -> Iterator[None]:
    """Trainers before transformers 5.25 skip a resumed epoch's trained micro-batches with accelerate's
    ``skip_first_batches`` called by name, not through :meth:`ElasticTrainer.get_resumed_dataloader`:
    route that name through the method for the epoch, so the elastic sampler (already at the saved position)
    is not skipped twice."""
    if hasattr(Trainer, "get_resumed_dataloader") or not hasattr(hf_trainer, "skip_first_batches"):
        yield
        return
    original = hf_trainer.skip_first_batches

    def skip(dataloader: Any, num_batches: int = 0) -> Any:
        if dataloader.batch_sampler is trainer.sampler:
            return dataloader
        return original(dataloader, num_batches)

    hf_trainer.skip_first_batches = skip
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = original
