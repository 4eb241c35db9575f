"""What a checkpoint of a training loop holds: :class:`TrainState` over the user's state-dict-able objects."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from itertools import chain
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elastic_train.checkpoint.plan import Fixed, Planned, Planner
from elastic_train.log import get_logger
from elastic_train.torchcompat import uncompiled
from elastic_train.train import rng
from elastic_train.train.errors import NotStateful, StateMismatch
from elastic_train.train.sampler import ElasticBatchSampler, ElasticSampler

if TYPE_CHECKING:
    from elastic_train.checkpoint.specs import TensorSpec

log = get_logger(__name__)


class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(state)`` (modules, optimizers, schedulers …)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose ``state_dict`` keys are the model's own (no DDP or ``torch.compile`` prefix)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif (inner := uncompiled(model)) is not None:  # torch.compile's wrapper
            model = inner
        else:
            return model


_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_params = itemgetter("params")
_ptr = torch.Tensor.data_ptr
_values = dict.values
_flat = chain.from_iterable
# The structure checks below run at every step: each is a C-level map over a list (no Python per item).


def _marks(tensors: list[torch.Tensor]) -> tuple[list[int], list[Any], list[Any]]:
    """Storage, shape and dtype of each tensor: what must not change under a planned snapshot."""
    return list(map(_ptr, tensors)), list(map(_shape, tensors)), list(map(_dtype, tensors))


def _all(checks: tuple[Callable[[], bool], ...]) -> bool:
    """Every check run (each marks its own part stale), then whether all passed."""
    return all([c() for c in checks])


def _hyper(groups: list[dict[str, Any]]) -> list[Any]:
    """Each param group without its parameters, and its values' types (a float lr that becomes a tensor of
    the same value is a change): the key of the groups' part in a planned snapshot."""
    out: list[Any] = []
    for g in groups:
        h = dict(g)
        del h["params"]
        out.append(h)
        out.append(list(map(type, h.values())))
    return out


#: Parameters, buffers and submodules registered in this process (any module): the training thread's
#: cheap sign that a module tree may have changed. Counted by torch's global registration hooks, installed
#: once by the first planned model.
_registered = 0
_watching = False


def _count_registration(module: torch.nn.Module, name: str, value: Any) -> None:
    global _registered
    _registered += 1


def _watch_registrations() -> None:
    global _watching
    if not _watching:
        from torch.nn.modules import module as nn_module

        nn_module.register_module_parameter_registration_hook(_count_registration)
        nn_module.register_module_buffer_registration_hook(_count_registration)
        nn_module.register_module_module_registration_hook(_count_registration)
        _watching = True


class _ModelMarks:
    """What a plain model's state dict is read from, as it was when planned: every registry (lengths and
    members' identities) and every tensor's storage, shape and dtype. Immutable once built, so another
    thread may check a snapshot against it while the training thread plans anew."""

    __slots__ = ("dicts", "ids", "lens", "live", "marks", "members")

    def __init__(self, modules: list[torch.nn.Module], live: list[torch.Tensor]) -> None:
        self.dicts = [
            d
            for m in modules
            for d in (
                m._parameters,
                m._buffers,
                m._modules,
                m._non_persistent_buffers_set,
                m._state_dict_hooks,
                m._state_dict_pre_hooks,
            )
        ]
        self.lens = list(map(len, self.dicts))
        self.members = [m.__dict__[k] for m in modules for k in ("_parameters", "_buffers", "_modules")]
        self.ids = list(map(id, _flat(map(_values, self.members))))
        self.live = live
        self.marks = _marks(live)

    def holds(self) -> bool:
        """Whether the model's state dict is still made of these tensors (C-level maps: no Python per
        item)."""
        return (
            list(map(len, self.dicts)) == self.lens
            and list(map(id, _flat(map(_values, self.members)))) == self.ids
            and _marks(self.live) == self.marks
        )


class _ModelPart:
    """The model's tensors for a planned snapshot, re-read only when the module tree changes.

    A module whose state dict is not its plain parameters and persistent buffers (a custom
    ``state_dict``/``_save_to_state_dict``, extra state, state-dict hooks) is read from ``state_dict()`` at
    every step instead.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        _watch_registrations()
        self.model = model
        self.key = 0
        self.plain = False
        #: Set (by any thread) when a snapshot's full check failed: the next part() re-reads the model.
        self.stale = False
        #: Snapshots left that check fully although asked for the cheap check (see RECHECK_STEPS).
        self.recheck = 0
        self.marks: _ModelMarks | None = None
        self._refresh()

    def _refresh(self) -> None:
        self.stale = False
        self._registered = _registered
        Module = torch.nn.Module
        modules = list(self.model.modules())
        self.plain = all(
            type(m).state_dict is Module.state_dict
            and type(m)._save_to_state_dict is Module._save_to_state_dict
            and type(m).get_extra_state is Module.get_extra_state
            and not m._state_dict_hooks
            and not m._state_dict_pre_hooks
            for m in modules
        )
        live = list(self.model.state_dict(keep_vars=True).values())
        if not self.plain or not all(isinstance(t, torch.Tensor) for t in live):
            self.plain = False  # read from state_dict() at every step
            self.marks = None
            self.key += 1
            return
        if self.marks is not None and self.marks.holds():
            return  # a registration elsewhere (another module, or one that changed nothing here)
        # Every registry a state dict is read from: a new, removed or replaced parameter, buffer or
        # submodule (or a hook) changes a length or an identity there.
        self.key += 1
        self.marks = _ModelMarks(modules, live)
        self.fixed = Fixed(self.key, [t.detach() for t in live], self.model.state_dict)

    def part(self, *, full: bool = True) -> Any:
        """The model's part of a snapshot. ``full``: check every registry and tensor against the plan
        (C-level maps over them); otherwise only whether anything was registered or a check failed since
        (the caller then hands :meth:`check` to whoever publishes the snapshot)."""
        if not self.plain and not self.stale and _registered == self._registered:
            return self.model.state_dict()
        if not full and self.recheck:
            self.recheck -= 1
            full = True
        marks = self.marks
        if self.stale or _registered != self._registered or marks is None or (full and not marks.holds()):
            self._refresh()
            if not self.plain:
                return self.model.state_dict()
        return self.fixed

    def check(self) -> Callable[[], bool]:
        """The full check of the part just returned by :meth:`part`: False (and the part marked stale) when
        the model's tensors are no longer the planned ones."""
        marks = self.marks if self.plain else None
        return partial(_verify, self, marks)


class _OptimizerMarks:
    """What a plain optimizer's state dict is read from, as it was when planned (immutable: see
    :class:`_ModelMarks`)."""

    __slots__ = ("dict_ids", "dicts", "groups", "keys", "lens", "opt", "params", "tensors")

    def __init__(self, opt: torch.optim.Optimizer, dicts: list[dict[str, Any]], tensors: list[Any]) -> None:
        self.opt = opt
        self.params = list(map(id, _flat(map(_params, opt.param_groups))))
        self.groups = len(opt.param_groups)
        self.keys = list(map(id, opt.state))
        self.dict_ids = list(map(id, dicts))
        self.dicts = dicts
        self.lens = list(map(len, dicts))
        # Identity and storage: an optimizer's own buffers are replaced (load_state_dict), not reshaped.
        self.tensors = list(map(id, tensors)), list(map(_ptr, tensors))

    def holds(self) -> bool:
        opt = self.opt
        if not (
            len(opt.param_groups) == self.groups
            and list(map(id, _flat(map(_params, opt.param_groups)))) == self.params
            and list(map(id, opt.state)) == self.keys
            and list(map(id, opt.state.values())) == self.dict_ids
            and list(map(len, self.dicts)) == self.lens
        ):
            return False
        tensors = list(_flat(map(_values, self.dicts)))
        return list(map(id, tensors)) == self.tensors[0] and list(map(_ptr, tensors)) == self.tensors[1]


#: Snapshots a part is fully checked on the training thread after a full check elsewhere failed: a state
#: that changes behind the cheap check (an optimizer that replaces its state tensors at every step) then
#: costs the full check per step, not a lost snapshot per step.
RECHECK_STEPS = 1000


def _verify(part: _ModelPart | _OptimizerPart, marks: _ModelMarks | _OptimizerMarks | None) -> bool:
    if marks is None:
        return True
    try:
        if marks.holds():
            return True
    except RuntimeError as exc:  # a registry resized while it was read (another thread): a change as well
        log.debug("snapshot_check_raced", error=str(exc))
    part.recheck = RECHECK_STEPS
    part.stale = True
    return False


class _OptimizerPart:
    """A ``torch.optim.Optimizer``'s state for a planned snapshot: the per-parameter tensors are fixed
    (re-read when a parameter, a group or a state entry appears, goes or is replaced), the param groups'
    hyper-parameters are read at every step (a scheduler changes them)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.opt = optimizer
        self.key = 0
        self.plain = False
        #: Set (by any thread) when a snapshot's full check failed: the next part() re-reads the optimizer.
        self.stale = False
        #: Snapshots left that check fully although asked for the cheap check (see RECHECK_STEPS).
        self.recheck = 0
        self.marks: _OptimizerMarks | None = None
        #: The last part returned, with the key and hyper-parameters it was made for.
        self._last: tuple[int, list[Any], dict[str, Any]] | None = None
        self._refresh()

    def _refresh(self) -> None:
        self.key += 1
        self.stale = False
        opt = self.opt
        base = torch.optim.Optimizer
        dicts = list(opt.state.values())
        tensors = [v for d in dicts for v in d.values()]
        self._quick = self._cheap()
        self.plain = (
            type(opt).state_dict is base.state_dict
            and not opt._optimizer_state_dict_pre_hooks
            and not opt._optimizer_state_dict_post_hooks
            and all(isinstance(t, torch.Tensor) for t in tensors)
            and all(isinstance(p, torch.Tensor) for p in opt.state)
        )
        if not self.plain:  # read from state_dict() at every step
            self.marks = None
            return
        # The index lists of the packed param groups, as Optimizer.state_dict numbers the parameters.
        mapping: dict[int, int] = {}
        self._indices = []
        for g in opt.param_groups:
            for p in g["params"]:
                mapping.setdefault(id(p), len(mapping))
            self._indices.append([mapping[id(p)] for p in g["params"]])
        self.marks = _OptimizerMarks(opt, dicts, tensors)
        self.fixed = Fixed(self.key, tensors, lambda: self.opt.state_dict()["state"])

    def _cheap(self) -> tuple[int, int, int, list[int]]:
        """What changes when a group, a parameter or a parameter's state appears, or the state is loaded
        (``load_state_dict`` replaces the state dict): read without touching a tensor."""
        opt = self.opt
        groups = opt.param_groups
        return len(groups), id(opt.state), len(opt.state), list(map(len, map(_params, groups)))

    def part(self, *, full: bool = True) -> Any:
        """The optimizer's part of a snapshot; ``full`` as :meth:`_ModelPart.part`."""
        if not full and self.recheck:
            self.recheck -= 1
            full = True
        marks = self.marks
        if marks is None or self.stale or self._cheap() != self._quick or (full and not marks.holds()):
            self._refresh()
            if not self.plain:
                return self.opt.state_dict()
        # The hyper-parameters (a scheduler changes them) are the key of a part without tensors: their
        # skeleton is encoded again only when one changes, and while none does the part is the same object
        # as at the last step (the plan recognises it by identity).
        hyper = _hyper(self.opt.param_groups)
        last = self._last
        if last is not None and last[0] == self.key and last[1] == hyper:
            return last[2]
        indices = self._indices
        groups = Fixed(
            (self.key, hyper),
            (),
            lambda: [{**h, "params": i} for h, i in zip(hyper[::2], indices, strict=True)],
        )
        part = {"state": self.fixed, "param_groups": groups}
        self._last = (self.key, hyper, part)
        return part

    def check(self) -> Callable[[], bool]:
        """As :meth:`_ModelPart.check`."""
        return partial(_verify, self, self.marks if self.plain else None)


def _identity(value: Any) -> Any:
    return value


def _rng_state(cpu: torch.Tensor, cuda: list[torch.Tensor], python: Fixed, numpy: Any) -> dict[str, Any]:
    """The RNG part's full state: what :func:`rng.capture` returns for these reads, Python's state as its
    own part (see :class:`_RngPart`)."""
    return {"torch": cpu, "cuda": cuda, "python": python, "numpy": list(numpy) if numpy is not None else None}


_nbytes = attrgetter("nbytes")


class _RngPart:
    """The generators' states for a planned snapshot, read at every step.

    torch's generator states are new tensors at each read (the built-in loop re-seeds at every step) but of
    a fixed size, and numpy's key words a tensor of a fixed size: they are the part's tensors, with their
    sizes as its layout. Python's state and numpy's capture are the very same objects while nothing drew
    from those generators (:func:`rng.python_state`, :func:`rng.numpy_state`): they make the part's key, so
    the part is walked again only when one of them changes. Python's state (625 ints) is a part of its own
    inside, keyed by its value: its skeleton is encoded once per change of that state, not whenever numpy's
    state moves.
    """

    def __init__(self) -> None:
        #: The last reads of Python's and numpy's states and the key they make (a new object per change:
        #: compared by identity, as a numpy capture holds a tensor).
        self._last: tuple[Any, Any, object] = (None, None, object())
        self._python: Fixed | None = None
        self._layout: tuple[int, tuple[int, ...], bool] = (-1, (), False)

    def part(self) -> Fixed:
        cpu = torch.default_generator.get_state()
        cuda = rng.cuda_states() if torch.cuda.is_initialized() else []
        python = rng.python_state()
        numpy = rng.numpy_state()
        last = self._last
        py_part = self._python
        if last[0] is not python or last[1] is not numpy:
            last = self._last = (python, numpy, object())
            if py_part is None or py_part.key is not python:
                py_part = self._python = Fixed(python, (), partial(_identity, python))
        assert py_part is not None
        tensors = [cpu, *cuda] if numpy is None else [cpu, *cuda, numpy[1]]
        layout = self._layout  # the same object while it holds: recognised by identity
        if cuda or cpu.nbytes != layout[0] or (numpy is not None) is not layout[2]:
            layout = self._layout = (cpu.nbytes, tuple(map(_nbytes, cuda)), numpy is not None)
        build = partial(_rng_state, cpu, cuda, py_part, numpy)
        return Fixed(last[2], tensors, build, layout)


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
        self._planner: Planner | None = None
        self._parts: tuple[_ModelPart, _OptimizerPart | None] | None = None
        self._rng = _RngPart()
        self._check: tuple[tuple[Any, Any], Callable[[], bool]] | None = None

    def snapshot(self, *, verify: bool = True) -> Planned:
        """The checkpoint state flattened, as ``flatten(self.state_dict())`` but planned: the model's and the
        optimizer's tensors are re-read only when their structure changes (see
        :mod:`elastic_train.checkpoint.plan`), which keeps a snapshot's Python per step small.

        Args:
            verify: check every model and optimizer tensor against the plan now (storage, shape, dtype,
                identity: C-level maps over them). With False only what costs no tensor access is checked
                here (a registration in any module, the optimizer's groups, parameter lists and state
                entries, a failed check of an earlier snapshot); the returned snapshot's ``verify`` then
                does the rest and must pass before its copy is published (the memory tier calls it on its
                copier thread before the seal; see docs/checkpoints.md, "What each step checks").

        Raises:
            CheckpointError: the state holds something that cannot be checkpointed.
        """
        if self._planner is None or self._parts is None:
            self._planner = Planner()
            opt = self.optimizer
            plain_opt = isinstance(opt, torch.optim.Optimizer)
            self._parts = (_ModelPart(self.model), _OptimizerPart(opt) if plain_opt else None)  # type: ignore[arg-type]
        model, opt_part = self._parts
        opt = opt_part.part(full=verify) if opt_part is not None else None
        state = self._state(
            model.part(full=verify), opt, self._rng.part(), planned_optimizer=opt_part is not None
        )
        check = None
        if not verify:
            # The same check object while the parts' marks are the same (they are replaced, never changed).
            marks = (model.marks, opt_part.marks if opt_part is not None else None)
            cached = self._check
            if cached is None or cached[0][0] is not marks[0] or cached[0][1] is not marks[1]:
                checks = (model.check(), opt_part.check()) if opt_part is not None else (model.check(),)
                cached = self._check = (marks, partial(_all, checks))
            check = cached[1]
        return self._planner.flat(state, check)

    def restore_targets(self, specs: Sequence[TensorSpec]) -> list[torch.Tensor | None]:
        """For each tensor of a restored state, the live tensor :meth:`load_state_dict` would put it into
        (a parameter or buffer of the model, an existing optimizer buffer), or None.

        A restore writes the bytes straight into those whose dtype and shape match (see
        ``CheckpointManager.restore(into=...)``), so loading the state copies nothing more for them.
        """
        live: dict[str, torch.Tensor] = {f"/model/{k}": v for k, v in self.model.state_dict().items()}
        if self.optimizer is not None and isinstance(self.optimizer, torch.optim.Optimizer):
            for index, per_param in self.optimizer.state_dict()["state"].items():
                for key, value in per_param.items():
                    if isinstance(value, torch.Tensor):
                        live[f"/optimizer/state/{index}/{key}"] = value
        return [live.get(s.path) for s in specs]

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint state; tensors are referenced, not copied (the checkpoint manager copies them)."""
        return self._state(self.model.state_dict(), None, rng.capture(), planned_optimizer=False)

    def _state(self, model: Any, optimizer: Any, captured: Any, *, planned_optimizer: bool) -> dict[str, Any]:
        """The state around the given model part, optimizer part (when ``planned_optimizer``) and RNG states:
        the one layout :meth:`snapshot` and :meth:`state_dict` share."""
        if not planned_optimizer:
            optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        state: dict[str, Any] = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": None,
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "rng": captured,
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
