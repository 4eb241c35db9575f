"""The training loop: sampler → micro-batches → DDP gradient → optimizer step → checkpoint, once per step.

The loop is a user of the public API of :mod:`elastic_train.elastic`, as a script with its own loop is: its
state is a :class:`~elastic_train.elastic.TrainState`, restored and committed by a
:class:`~elastic_train.elastic.Checkpointer`, its data order an
:class:`~elastic_train.train.sampler.ElasticBatchSampler` (which writes the audit lines).

The loop is world-size agnostic: the sampler's global cursor decides which samples a step trains and
:mod:`elastic_train.train.batching` weights the losses so the update is the mean-loss gradient over the step,
so a job that resumes at another world size continues the same optimisation.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elastic_train.log import get_logger
from elastic_train.train.api import Task
from elastic_train.train.batching import loss_scale, micro_batches
from elastic_train.train.busy import StepClock, time_collectives
from elastic_train.train.checkpointer import Checkpointer, Manager
from elastic_train.train.config import TrainConfig
from elastic_train.train.errors import TrainingError
from elastic_train.train.events import EventWriter
from elastic_train.train.group import World
from elastic_train.train.lossreduce import LossCarrier
from elastic_train.train.sampler import ElasticBatchSampler
from elastic_train.train.state import TrainState

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one optimizer step did."""

    step: int
    epoch: int
    samples: int
    loss: float
    seconds: float


def to_device(batch: Any, device: torch.device) -> Any:
    """Move a batch (tensor, or tuple/list/dict of them) to ``device``; a no-op on the CPU."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@contextlib.contextmanager
def _fsdp_no_sync(model: torch.nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed of the RNGs at ``step`` on ``rank``: training randomness is a function of (seed, step, rank)."""
    return (seed * 1_000_003 + step * 7919 + rank) % 2**63


class Trainer:
    """Trains ``task`` with DDP in the current process group.

    Args:
        cfg: the ``train`` section of the job.
        task: the user's task (model on the CPU, seeded identically on every rank).
        rank: global rank in the current worker group.
        world_size: size of the current worker group.
        round: rendezvous round of the current worker group (audit and events).
        device: device the model trains on.
        checkpointer: where state is restored from and saved to after every optimizer step.
        events: progress events (a writer that does nothing on ranks other than 0).
        audit_dir: where the sampler appends this rank's per-step audit lines, or ``None``.
        sharded: the task's model sharded over this group with FSDP2 (``train.fsdp``), trained as it is
            (no DDP); a first start loads its initial weights (each rank its rows).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        task: Task,
        *,
        rank: int,
        world_size: int,
        round: int,
        device: torch.device,
        checkpointer: Manager,
        events: EventWriter,
        audit_dir: str | None = None,
        sharded: tuple[torch.nn.Module, Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        self.cfg = cfg
        self.task = task
        self.rank = rank
        self.world_size = world_size
        self.round = round
        self.device = device
        self.checkpointer = checkpointer
        self.events = events
        self.sharded = sharded
        self.model = sharded[0] if sharded is not None else task.model.to(device)
        self.sampler = ElasticBatchSampler(
            len(task.dataset),
            cfg.global_batch,
            seed=cfg.seed,
            world_size=world_size,
            rank=rank,
            round=round,
            audit_dir=audit_dir,
            pad_empty=False,  # make_batch takes an empty share
            shares=cfg.shares,
        )
        self.train_state = TrainState(
            model=self.model, optimizer=task.optimizer, scheduler=task.scheduler, sampler=self.sampler
        )
        group_world = World(
            rank=rank,
            world_size=world_size,
            local_rank=0,
            local_world_size=world_size,
            device=device,
            backend=str(dist.get_backend()) if dist.is_initialized() else "gloo",
            round=round,
            run_id="",
            restart_count=0,
        )
        self.ckpt = Checkpointer(
            self.train_state, manager=checkpointer, world=group_world, events=events,
            clock=StepClock(loop_carries=True),  # the loss sum carries the busy times of a sharded model
        )  # fmt: skip
        self.ckpt.skip_restore()  # restore() is the worker's call; tests and benchmarks start fresh
        self.ddp: torch.nn.Module | None = None
        self._carrier: LossCarrier | None = None
        self._batches: Iterator[list[int]] | None = None

    @property
    def step(self) -> int:
        """Optimizer steps done (restored ones included)."""
        return self.train_state.step

    # -- state -----------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The checkpoint state (see docs/checkpoints.md); tensors are referenced, not copied."""
        return self.train_state.state_dict()

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a restored state.

        Raises:
            StateMismatch: the state does not fit this task (its CheckpointError is raised before this).
        """
        self._batches = None
        self.ckpt.load(state)

    def restore(self) -> None:
        """Collective: load the newest state anywhere, or start fresh; emits ``resumed`` or ``started``."""
        self._batches = None
        self.ckpt.restore()
        if self.sharded is not None and self.ckpt.source is None:  # a first start: the initial weights
            from elastic_train.train.fsdp import load_full

            load_full(self.model, self.sharded[1])

    # -- training --------------------------------------------------------------------------------------------

    def wrap(self) -> torch.nn.Module:
        """Wrap the model in DDP (no buffer broadcast per forward: micro-batch counts differ by rank).

        After a restore every rank holds the same broadcast state, so DDP's own broadcast of every parameter
        and buffer at construction is skipped (``init_sync=False``): it would send the model a second time.
        """
        if self.sharded is not None:  # FSDP2 reduces the gradients itself
            if self.world_size > 1:
                time_collectives(self.model, self.ckpt.clock)  # its all-gathers and reduce-scatters
            self.ddp = self.model
            return self.model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # Buffers are synced once at construction, never per forward (torch >= 2.13 spells this
        # forward_sync_buffers; older releases broadcast_buffers).
        params = inspect.signature(DistributedDataParallel.__init__).parameters
        key = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
        options: dict[str, Any] = {key: False}
        if self.ckpt.source is not None and "init_sync" in params:
            options["init_sync"] = False
        ddp = DistributedDataParallel(self.model, device_ids=device_ids, **options)
        if self.world_size > 1 and LossCarrier.suitable(self.model):
            self._carrier = LossCarrier(clock=self.ckpt.clock)
            self._carrier.register(ddp)
        elif self.world_size > 1:
            time_collectives(ddp, self.ckpt.clock)  # the clock's values (speed shares) ride with it too
        self.ddp = ddp
        return ddp

    def unwrap(self, *, collect: bool = True) -> None:
        """Drop the DDP wrapper (and its reducer) while the process group still exists.

        A reducer that outlives ``destroy_process_group`` can abort the process when it is freed later
        (gloo: ``terminate called without an active exception``), so callers unwrap before destroying it.

        Args:
            collect: run the garbage collector now (False when ``elastic.shutdown``, which collects first,
                destroys the group: a full collection costs tens of milliseconds, more on a busy machine).
        """
        self.ddp = None
        self._carrier = None
        if collect:
            gc.collect()

    def _seed_step(self, step: int) -> None:
        """Seed the generators the step may draw from (dropout …) as a function of (seed, step, rank).

        Only the CPU and this device's generators: ``torch.manual_seed`` would touch every device type and
        costs more than a small step's whole bookkeeping.
        """
        seed = step_seed(self.cfg.seed, step, self.rank)
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index or 0].manual_seed(seed)

    def train_step(self) -> StepResult:
        """One optimizer step over the next ``G`` samples of the global order."""
        assert self.ddp is not None, "call wrap() first"
        started = time.perf_counter()
        step = self.step + 1
        indices = self._next_share()
        plan = self.sampler.current()
        self._seed_step(step)
        scale = loss_scale(plan.size, self.world_size)
        chunks = micro_batches(indices, self.cfg.micro_batch)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, chunk in enumerate(chunks):
            sync = contextlib.nullcontext() if i == len(chunks) - 1 else self._no_sync()
            with sync:
                batch = to_device(self.task.make_batch(chunk), self.device)
                losses = self.task.loss_fn(self.ddp, batch)
                if losses.shape != (len(chunk),):
                    raise TrainingError(
                        f"loss_fn returned shape {tuple(losses.shape)}, expected per-sample ({len(chunk)},)"
                    )
                total = losses.sum()
                loss_sum += total.detach()
                if self._carrier is not None and i == len(chunks) - 1:
                    self._carrier.arm(loss_sum)
                (total * scale).backward()
        carried = self._carrier.take() if self._carrier is not None else None
        work = slots = None
        if self.world_size > 1 and carried is None:
            # The speed shares' values, unless a gradient bucket carried them (DDP's hooks): a sharded
            # model's ride with the loss sum, one collective for both.
            slots = self.ckpt.clock.carry()
            if slots is not None:
                loss_sum = torch.cat([loss_sum.reshape(1), slots.reshape(-1).to(loss_sum)])
            work = dist.all_reduce(loss_sum, async_op=True)
        self.task.optimizer.step()
        self.task.optimizer.zero_grad(set_to_none=True)
        if self.task.scheduler is not None:
            self.task.scheduler.step()
        self.ckpt.advance()
        if work is not None:
            waited = time.perf_counter()
            work.wait()  # a wait for the slowest rank's optimizer step: not this rank's work
            self.ckpt.clock.blocked(time.perf_counter() - waited)
            if slots is not None:  # the loss sum and the speed shares' values
                self.ckpt.clock.landed(loss_sum[1:])
                loss_sum = loss_sum[0]
        total_loss = carried[0].item() if carried is not None else loss_sum.item()
        return StepResult(
            step=step,
            epoch=plan.epoch,
            samples=plan.size,
            loss=total_loss / plan.size,
            seconds=time.perf_counter() - started,
        )

    def _no_sync(self) -> Any:
        """Gradients of a micro-batch that is not the step's last are accumulated, not reduced yet."""
        if self.sharded is None:
            return self.ddp.no_sync()  # type: ignore[union-attr,operator]
        return _fsdp_no_sync(self.model)

    def _next_share(self) -> list[int]:
        """This rank's indices of the next step, from the sampler (which writes the step's audit line)."""
        if self._batches is not None:
            share = next(self._batches, None)
            if share is not None:
                return share
        self._batches = iter(self.sampler)  # a new epoch (or the first step after a restore)
        return next(self._batches)

    def run(self) -> int:
        """Train until ``cfg.steps``, saving after every optimizer step; returns the final step."""
        if self.ddp is None:
            self.wrap()
        last = time.perf_counter()
        while self.step < self.cfg.steps:
            result = self.train_step()
            self.ckpt.save(loss=result.loss, samples=result.samples, epoch=result.epoch)
            if result.step % self.cfg.log_every == 0 or result.step == self.cfg.steps:
                now = time.perf_counter()
                rate = result.samples / max(now - last, 1e-9)
                log.info(
                    "step_done", step=result.step, loss=round(result.loss, 6), samples_per_s=round(rate, 1)
                )
            last = time.perf_counter()
        self.ckpt.finalize()
        return self.step
