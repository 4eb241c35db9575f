"""Fault tolerance for your own training loop: process group, state tiers, exactly-once data.

A torchrun script of the usual DDP kind keeps its model, optimizer, Dataset, DataLoader and loop, and adds::

    import elastic_train as et

    world = et.init()                                     # process group from torchrun's environment
    model = Net().to(world.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = et.ElasticBatchSampler(dataset, global_batch=64, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
    ckpt = et.Checkpointer(et.TrainState(model=model, optimizer=optimizer, sampler=sampler), "ckpts")
    ckpt.restore()                                        # newest state: memory, durable, resume_from
    ddp = DDP(model, device_ids=world.device_ids)
    for epoch in range(sampler.epoch, epochs):
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y) * sampler.loss_weight()
            loss.backward(); optimizer.step(); optimizer.zero_grad()
            ckpt.commit()                                 # memory snapshot every step, durable every N
    ckpt.finalize()                                       # final checkpoint, shared memory released
    et.shutdown()

The state goes through the same :class:`~elastic_train.checkpoint.CheckpointManager` as the built-in loop
(which is itself a user of this module), so ``elastic-train ckpt ls/verify/export`` read it, a restarted
worker group resumes from a surviving rank's shared memory (at most one step redone), and the data order is
the built-in one: every sample once per epoch across any resize, with a constant global batch.
See docs/own-loop.md.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.errors import ElasticTrainError
from elastic_train.log import bind_context, configure_logging, get_logger
from elastic_train.train import rng
from elastic_train.train.errors import NotStateful, StateMismatch, TrainingError
from elastic_train.train.events import EventWriter
from elastic_train.train.sampler import ElasticBatchSampler, ElasticSampler
from elastic_train.worker.env import WorkerEnv

if TYPE_CHECKING:
    from elastic_train.checkpoint.manager import Committed

log = get_logger(__name__)

__all__ = [
    "Checkpointer",
    "ElasticBatchSampler",
    "Stateful",
    "TrainState",
    "World",
    "current_world",
    "init",
    "resolve_backend",
    "shutdown",
]

#: Run id of the checkpoints when torchrun gives none (``TORCHELASTIC_RUN_ID`` unset: a plain process).
DEFAULT_RUN_ID = "default"

StepHook = Callable[[int], None]
"""Called with the step number at :meth:`Checkpointer.commit`, before the state is saved (test faults)."""


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (modules, optimizers, schedulers …)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


# -- the process group ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the current worker group (what :func:`init` formed)."""

    rank: int
    """Global rank."""
    world_size: int
    """Processes in the group."""
    local_rank: int
    """Rank on this node (the CUDA device index with NCCL)."""
    local_world_size: int
    """Processes on this node."""
    device: torch.device
    """Where this rank trains: ``cuda:LOCAL_RANK`` with NCCL, the CPU with gloo."""
    backend: str
    """Process-group backend (``gloo`` or ``nccl``)."""
    round: int
    """Rendezvous round of the group (grows with every restart; audit lines and events carry it)."""
    run_id: str
    """Checkpoints go to ``URL/run_id``: torchrun's ``--rdzv-id``, or ``"default"`` outside torchrun."""
    restart_count: int
    """How often this node's agent restarted its workers."""

    @property
    def device_ids(self) -> list[int] | None:
        """``device_ids`` for ``DistributedDataParallel``: ``[index]`` on a GPU, None on the CPU."""
        return [self.device.index or 0] if self.device.type == "cuda" else None

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (where one-per-job things such as printing go)."""
        return self.rank == 0


_WORLD: World | None = None


def resolve_backend(requested: str, cuda: bool) -> str:
    """``auto`` → nccl when CUDA is usable, gloo otherwise.

    Raises:
        ValueError: ``requested`` is not auto, gloo or nccl.
    """
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend: {requested!r} is not one of auto, gloo, nccl")
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    return requested


def init(backend: str = "auto", *, timeout: timedelta | None = None, env: WorkerEnv | None = None) -> World:
    """Form the default process group from torchrun's environment; idempotent.

    The backend is NCCL on ``cuda:LOCAL_RANK`` when a GPU is visible (``torch.cuda.set_device`` first),
    gloo on the CPU otherwise. When torchrun hands its workers the agent's long-lived TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's own dynamic rendezvous), keys are prefixed with the
    group's round, so a restarted group never reads the gloo addresses of the one before. Without torchrun's
    variables (``RANK`` unset) this is a world of one on loopback. A group the script formed itself is
    adopted as is.

    Also configures logging when nothing else did, and renders elastic_train's own errors that reach the top
    of the script as one line (``SCRIPT: error: rank R: ...``) instead of a traceback.

    Args:
        backend: ``auto``, ``gloo`` or ``nccl``.
        timeout: collective timeout of the group (torch's default when None).
        env: torchrun's variables, parsed (default: from ``os.environ``).

    Raises:
        ConfigError: torchrun's variables are inconsistent or not integers.
        TrainingError: ``nccl`` asked for without a visible GPU.
    """
    global _WORLD
    if _WORLD is not None and dist.is_initialized():
        return _WORLD
    env = env or WorkerEnv.from_environ(os.environ)
    import structlog

    if not structlog.is_configured():
        configure_logging()
    _install_excepthook()
    cuda = torch.cuda.is_available()
    if dist.is_initialized():  # the script formed the group itself: adopt it
        chosen = str(dist.get_backend())
        on_gpu = chosen == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        chosen = resolve_backend(backend, cuda)
        if chosen == "nccl":
            if not cuda:
                raise TrainingError("backend nccl needs CUDA, and no GPU is visible")
            device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        _form_group(chosen, device, env, timeout)
        rank, world_size = env.rank, env.world_size
    _WORLD = World(
        rank=rank,
        world_size=world_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        device=device,
        backend=chosen,
        round=env.round,
        run_id=env.run_id or DEFAULT_RUN_ID,
        restart_count=env.restart_count,
    )
    bind_context(rank=rank, world_size=world_size, round=env.round)
    return _WORLD


def _form_group(backend: str, device: torch.device, env: WorkerEnv, timeout: timedelta | None) -> None:
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    if env.master_port == 0:
        assert env.world_size == 1, "MASTER_PORT is required for a multi-process group"
        os.environ["MASTER_PORT"] = str(_free_port(env.master_addr))
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    generation = env.group_generation
    if env.agent_store and generation is not None:
        # torch's dynamic rendezvous hands workers the agent's TCPStore, which outlives worker groups: keys of
        # an earlier group (gloo peer addresses) would be read by the next one; a per-group prefix avoids it.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False)
        kwargs["store"] = dist.PrefixStore(f"elastic_train/{generation}/", store)
    else:
        kwargs["init_method"] = "env://"
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kwargs)


def _free_port(addr: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def current_world() -> World:
    """The :class:`World` of this process: the one :func:`init` formed (forming it if nobody did)."""
    return _WORLD if _WORLD is not None and dist.is_initialized() else init()


def shutdown() -> None:
    """Destroy the process group (a no-op without one).

    Call it at the end instead of ``destroy_process_group()``, after dropping the DDP model: a DDP reducer
    freed after its group is gone can abort the process (gloo: ``terminate called without an active
    exception``); this collects such garbage first.
    """
    global _WORLD
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD = None


def _install_excepthook() -> None:
    """Render an :class:`ElasticTrainError` that ends the script as one line on stderr (exit code 1)."""
    previous = sys.excepthook
    if getattr(previous, "_elastic_train", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
        if isinstance(exc, ElasticTrainError):
            rank = _WORLD.rank if _WORLD is not None else os.environ.get("RANK", "0")
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            sys.stderr.write(f"{prog}: error: rank {rank}: {exc}\n")
            sys.stderr.flush()
            return
        previous(kind, exc, tb)

    hook._elastic_train = True  # type: ignore[attr-defined]
    sys.excepthook = hook


# -- the state -----------------------------------------------------------------------------------------------


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict`` keys are the model's own (no ``module.`` / ``_orig_mod.`` prefix)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):  # torch.compile
            model = model._orig_mod
        else:
            return model


class TrainState:
    """What a checkpoint holds: model, optimizer, scheduler, sampler position, RNGs, step, your extras.

    The model is stored unwrapped (pass the module or its DDP / ``torch.compile`` wrapper: the keys are the
    same either way), so a checkpoint loads into a plain model (``elastic-train ckpt export``).

    Args:
        model: the model (on its device).
        optimizer: its optimizer.
        scheduler: a learning-rate scheduler (anything state-dict-able), or None.
        sampler: the :class:`ElasticBatchSampler` the DataLoader draws from: its cursor is saved with every
            step, which is what makes the data exactly-once across restarts and resizes.
        **extra: further state-dict-able objects (a ``GradScaler``, an EMA model, your own counters with
            ``state_dict``/``load_state_dict``), saved and restored under their keyword.

    Raises:
        NotStateful: an object has no ``state_dict``/``load_state_dict`` (or the model is not a Module).
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        sampler: ElasticSampler | None = None,
        **extra: Stateful,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise NotStateful(f"model: a {type(model).__name__} is not a torch.nn.Module")
        for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), *extra.items()):
            if obj is not None and not _is_stateful(obj):
                raise NotStateful(
                    f"{name}: a {type(obj).__name__} has no state_dict()/load_state_dict(), so it cannot be "
                    "checkpointed (wrap it in an object that has both)"
                )
        if sampler is not None and not isinstance(sampler, ElasticSampler):
            raise NotStateful(
                f"sampler: a {type(sampler).__name__} is not an elastic_train ElasticBatchSampler (its "
                "position must be part of the state for exactly-once data)"
            )
        self.model = _unwrap(model)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.sampler = sampler
        self.extra: dict[str, Stateful] = {k: v for k, v in extra.items() if v is not None}
        #: Optimizer steps committed (restored with the state).
        self.step = 0
        #: Facts about the group that saved the state (``world_size``, ``round``), stored as ``extra``.
        self.meta: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint state; tensors are referenced, not copied (the checkpoint manager copies them)."""
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": rng.capture(),
            "step": self.step,
            "extra": dict(self.meta),
        }
        if self.extra:
            state["objects"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put a restored state into the objects.

        Raises:
            StateMismatch: the state does not fit them (another model or optimizer, a changed dataset, an
                extra object the checkpoint has no state for); the message names which.
        """

        def fit(what: str, load: Callable[[], Any]) -> None:
            try:
                load()
            except (KeyError, ValueError, RuntimeError, TypeError, IndexError) as exc:
                text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise StateMismatch(f"{what}: the restored state does not fit: {text}") from exc

        fit("model", lambda: self.model.load_state_dict(state["model"]))
        if self.optimizer is not None:
            if state.get("optimizer") is None:
                raise StateMismatch("optimizer: the checkpoint holds no optimizer state")
            fit("optimizer", lambda: self.optimizer.load_state_dict(state["optimizer"]))  # type: ignore[union-attr]
        if self.scheduler is not None and state.get("scheduler") is not None:
            fit("scheduler", lambda: self.scheduler.load_state_dict(state["scheduler"]))  # type: ignore[union-attr]
        if self.sampler is not None:
            if state.get("sampler") is None:
                raise StateMismatch("sampler: the checkpoint holds no data position")
            fit("sampler", lambda: self.sampler.load_state_dict(state["sampler"]))  # type: ignore[union-attr]
        objects = state.get("objects") or {}
        for name, obj in self.extra.items():
            if name not in objects:
                raise StateMismatch(f"{name}: the checkpoint holds no state for it")
            fit(name, lambda obj=obj, name=name: obj.load_state_dict(objects[name]))  # type: ignore[misc]
        if state.get("rng") is not None:
            rng.restore(state["rng"])
        self.step = int(state["step"])
        if isinstance(self.sampler, ElasticBatchSampler):
            self.sampler.step = self.step


# -- the checkpointer ----------------------------------------------------------------------------------------


class Manager(Protocol):
    """What :class:`Checkpointer` needs from :class:`elastic_train.checkpoint.CheckpointManager`."""

    def restore(self, model: Mapping[str, Any] | None = None) -> Any: ...

    def save(self, step: int, state: Callable[[], Mapping[str, Any]]) -> None: ...

    def finalize(self, step: int, state: Mapping[str, Any]) -> Any: ...

    def close(self) -> None: ...


class Checkpointer:
    """Restore, per-step commit and finalize of a :class:`TrainState` through both state tiers.

    Every :meth:`commit` copies the state into this rank's shared-memory snapshot; every ``every_steps``
    steps a durable checkpoint is written in the background to ``url/run_id`` (any fsspec URL), in the format
    of the built-in loop. :meth:`restore` is collective and loads the newest valid state held anywhere: a
    surviving rank's memory snapshot (broadcast from it), else the newest durable checkpoint, else
    ``resume_from``. Rank 0 appends progress events to ``$ELASTIC_TRAIN_EVENTS`` (what ``elastic-train
    local`` follows).

    Args:
        state: what to checkpoint.
        url: checkpoint root (default: ``config.url``, itself ``checkpoints`` by default).
        every_steps: durable checkpoint every N steps (0: only the final one; default ``config.every_steps``).
        resume_from: a checkpoint (run root or ``step-N`` directory) to start from when the run has none.
        config: every other checkpoint setting (``keep_last``, ``memory_dir``, ``storage_options`` …).
        run_id: checkpoints go to ``url/run_id`` (default: torchrun's ``--rdzv-id``).
        world: the group the state is trained in (default: :func:`current_world`).
        manager: an existing checkpoint manager to use instead of creating one (the built-in worker's).
        events: progress events (default: rank 0 writes to ``$ELASTIC_TRAIN_EVENTS``).
        hooks: called with the step number at each commit before the save (default: the test-only fault
            hooks of ``$ELASTIC_TRAIN_TEST_FAULT`` / ``$ELASTIC_TRAIN_TEST_STEP_DELAY``).

    Raises:
        StorageError: the URL's filesystem cannot be opened.
        ValueError: a setting is out of range.
    """

    def __init__(
        self,
        state: TrainState,
        url: str | None = None,
        *,
        every_steps: int | None = None,
        resume_from: str | None = None,
        config: CheckpointConfig | None = None,
        run_id: str | None = None,
        world: World | None = None,
        manager: Manager | None = None,
        events: EventWriter | None = None,
        hooks: Sequence[StepHook] | None = None,
    ) -> None:
        if not isinstance(state, TrainState):
            raise NotStateful(f"state: a {type(state).__name__} is not an elastic_train TrainState")
        self.state = state
        self.world = world or current_world()
        state.meta = {"world_size": self.world.world_size, "round": self.world.round}
        self._own_events = events is None
        self.events = events or EventWriter.from_env(
            rank=self.world.rank, round=self.world.round, world_size=self.world.world_size
        )
        if manager is None:
            cfg = config or CheckpointConfig()
            changes: dict[str, Any] = {"url": url, "every_steps": every_steps, "resume_from": resume_from}
            cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if v is not None})
            from elastic_train.checkpoint import CheckpointManager

            manager = CheckpointManager(
                cfg,
                run_id or self.world.run_id,
                rank=self.world.rank,
                world_size=self.world.world_size,
                local_rank=self.world.local_rank,
                group=dist.group.WORLD if self.world.world_size > 1 else None,
                device=self.world.device,
            )
        elif url is not None or every_steps is not None or resume_from is not None or config is not None:
            raise ValueError("Checkpointer: give either a manager or checkpoint settings, not both")
        self.manager: Manager = manager
        self.hooks = list(_env_hooks(self.world) if hooks is None else hooks)
        #: Where the restored state came from (``memory``, ``durable``, ``resume_from``), None when fresh.
        self.source: str | None = None
        self._restored = False
        self._reported: Any = None
        self._last_commit = time.perf_counter()
        # With a manager that can copy the optimizer's tensors while the next step computes (its step
        # pre-hook fences the copy), let it: the snapshot then costs the loop less.
        attach = getattr(manager, "attach", None)
        if attach is not None and isinstance(state.optimizer, torch.optim.Optimizer):
            attach(state.optimizer)

    @property
    def step(self) -> int:
        """Optimizer steps committed so far (restored ones included)."""
        return self.state.step

    # -- restore -------------------------------------------------------------------------------------------
    def restore(self) -> int:
        """Collective: load the newest valid state anywhere into the state's objects; returns its step.

        Call it on every rank before the DataLoader is iterated, and before the first :meth:`commit`.
        Returns 0 (and leaves everything as it is) when there is no state anywhere.

        Raises:
            ModelMismatch: the newest checkpoint is of another model (names, shapes or dtypes differ).
            StateMismatch: it does not fit the optimizer, the dataset or an extra object.
            CheckpointError: storage failure or an unreadable ``resume_from``.
        """
        restored = self.manager.restore(model=self.state.model.state_dict())
        self._restored = True
        self._last_commit = time.perf_counter()
        if restored is None:
            log.info("training_started", step=0)
            self.events.emit("started", 0)
            return 0
        self.load(restored.state)
        self.source = restored.source
        sampler = self.state.sampler
        epoch = sampler.epoch if sampler is not None else None
        log.info("training_resumed", step=self.step, source=restored.source, epoch=epoch)
        self.events.emit("resumed", self.step, source=restored.source, from_step=self.step)
        return self.step

    def load(self, state: Mapping[str, Any]) -> None:
        """Put a state (e.g. one read by hand) into the objects, as :meth:`restore` does with what it finds.

        Raises:
            StateMismatch: the state does not fit the objects.
        """
        fence = getattr(self.manager, "fence", None)
        if fence is not None:  # no snapshot copy may be reading what load_state_dict overwrites
            fence()
        self.state.load_state_dict(state)
        self._restored = True

    def skip_restore(self) -> None:
        """Train from the objects as they are, without looking for a saved state (a later restore still may).

        Only for a state known to be right (e.g. loaded by hand): committing on top of an older state
        than one already saved for this run makes that run's newest snapshot go back in time.
        """
        self._restored = True

    # -- commit --------------------------------------------------------------------------------------------
    def commit(self, loss: float | torch.Tensor | None = None) -> int:
        """After each optimizer step, on every rank: count the step, move the data cursor, save the state.

        The state is copied into shared memory (every ``memory_every_steps``) and handed to the background
        writer when a durable checkpoint is due; this returns without waiting for storage.

        Args:
            loss: this rank's loss of the step, for the progress events (read only when events are on).

        Returns:
            The step number just committed.

        Raises:
            TrainingError: :meth:`restore` was not called first.
            WriteFailed: an earlier background write failed (after its retries).
        """
        samples = self.advance()
        self.save(loss=loss, samples=samples)
        return self.step

    def advance(self) -> int:
        """The first half of :meth:`commit`: count the step and move the sampler past it; returns its size."""
        if not self._restored:
            raise TrainingError("call restore() before the first commit(): it decides where training starts")
        sampler = self.state.sampler
        size = 0
        if sampler is not None:
            plan = (
                sampler.current()
                if isinstance(sampler, ElasticBatchSampler)
                else sampler.plan(self.world.world_size, self.world.rank)
            )
            sampler.advance(plan)
            size = plan.size
        self.state.step += 1
        return size

    def save(
        self, *, loss: float | torch.Tensor | None = None, samples: int = 0, epoch: int | None = None
    ) -> None:
        """The second half of :meth:`commit`: save the state of the step just counted and report it."""
        step = self.step
        for hook in self.hooks:
            hook(step)
        self.manager.save(step, self.state.state_dict)
        self._report_commit()
        if self.events.enabled:
            now = time.perf_counter()
            rate = samples / max(now - self._last_commit, 1e-9)
            self._last_commit = now
            value = float(loss.detach().item()) if isinstance(loss, torch.Tensor) else loss
            if epoch is None and self.state.sampler is not None:
                sampler = self.state.sampler
                epoch = sampler.epoch if sampler.cursor else sampler.epoch - 1  # the step's own epoch
            self.events.emit("step", step, loss=value, samples_per_s=rate, epoch=epoch)

    def _report_commit(self) -> None:
        """Emit a ``checkpoint`` event for a durable checkpoint committed since the last call."""
        committed = getattr(self.manager, "last_committed", None)
        if committed is not None and committed is not self._reported:
            self._reported = committed
            self.events.emit("checkpoint", committed.step, seconds=committed.seconds, bytes=committed.bytes)

    # -- the end -------------------------------------------------------------------------------------------
    def finalize(self) -> Committed | None:
        """Collective, at the end of training: write the final durable checkpoint, wait for it, release the
        shared-memory snapshot; returns the committed checkpoint on rank 0 (None elsewhere).

        Raises:
            WriteFailed: the final checkpoint could not be written (after retries).
        """
        committed: Committed | None = self.manager.finalize(self.step, self.state.state_dict())
        self._report_commit()
        self.events.emit("done", self.step)
        log.info("training_done", step=self.step)
        self._release()
        return committed

    def close(self) -> None:
        """Stop without a final checkpoint (error paths); the memory snapshot stays for a restarted group."""
        self.manager.close()
        self._release()

    def _release(self) -> None:
        if isinstance(self.state.sampler, ElasticBatchSampler):
            self.state.sampler.close()
        if self._own_events:
            self.events.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is not None:
            self.close()


def _env_hooks(w: World) -> list[StepHook]:
    """The test-only fault and delay hooks the environment asks for (none in normal runs)."""
    from elastic_train.worker.faults import ENV_FAULT, ENV_STEP_DELAY, delay_hook, fault_hook

    hooks = (
        fault_hook(os.environ.get(ENV_FAULT), rank=w.rank, restart_count=w.restart_count),
        delay_hook(os.environ.get(ENV_STEP_DELAY)),
    )
    return [h for h in hooks if h is not None]
