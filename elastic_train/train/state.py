"""What a checkpoint of a training loop holds: :class:`TrainState` over the user's state-dict-able objects."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from elastic_train.train import rng
from elastic_train.train.errors import NotStateful, StateMismatch
from elastic_train.train.sampler import ElasticBatchSampler, ElasticSampler


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (modules, optimizers, schedulers …)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


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
