"""FSDP2 in an elastic job: the mesh of the current group, a sharded model built from a meta-device skeleton,
and the same initial weights at every world size.

A sharded model belongs to its process group (its parameters are DTensors on a mesh of the group), so a
training function re-entered after a membership change (``et.run``) builds it again on the new mesh. From a
meta-device skeleton that costs no memory and no initialisation: :func:`shard_model` builds the module on
``meta``, applies ``fully_shard`` and allocates only this rank's shards, which the restore then fills from
the survivors' memory. Only a job's first start (nothing to restore) initialises weights:
:func:`load_full` copies each rank's rows out of a full state dict (built once, seeded), so the initial
weights do not depend on the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from elastic_train.checkpoint.sharded.shardmap import fsdp_ranges
from elastic_train.train.config import check_mixed_precision
from elastic_train.train.group import current_world


def device_mesh(device_type: str | None = None) -> Any:
    """The 1-D device mesh over every rank of the current group, in rank order (what ``fully_shard`` takes
    and what the sharded checkpoint tiers support)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = current_world()
    return init_device_mesh(device_type or world.device.type, (world.world_size,))


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``fully_shard`` is applied to one by one by default: every entry of every
    ``nn.ModuleList`` (a transformer's layers), outermost first."""
    out: list[torch.nn.Module] = []
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            out.extend(m for m in module if not any(m is o for o in out))
    return out


def shard_model(
    build: Callable[[], torch.nn.Module],
    *,
    mesh: Any = None,
    shard: Callable[[torch.nn.Module, Any], None] | None = None,
    device: torch.device | str | None = None,
    **options: Any,
) -> torch.nn.Module:
    """``build()`` on the meta device, sharded with ``fully_shard`` over ``mesh``, with this rank's shards
    allocated (uninitialised) on ``device``: fill them with a restore, or :func:`load_full` on a first start.

    Args:
        build: makes the model (called under ``torch.device("meta")``: no memory, no initialisation).
        mesh: the device mesh (default: :func:`device_mesh`).
        shard: applies ``fully_shard`` (default: to each of :func:`blocks`, then to the whole model).
        device: where the shards live (default: the current group's device).
        options: passed to each ``fully_shard`` call of the default sharding, e.g.
            ``mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` (compute in bfloat16; the shards,
            the optimizer state and the checkpoints keep the parameters' own dtype) or
            ``reshard_after_forward=False``.

    Raises:
        ValueError: ``options`` with a ``shard`` function (which makes its own ``fully_shard`` calls).

    Buffers registered with ``persistent=False`` are not part of a checkpoint: a model that has them sets
    them again after a restore (they are left uninitialised here).
    """
    from torch.distributed.fsdp import fully_shard

    if options and shard is not None:
        raise ValueError(
            f"shard_model: fully_shard options ({', '.join(sorted(options))}) apply to the default sharding; "
            "a shard function passes its own"
        )
    mesh = mesh if mesh is not None else device_mesh()
    with torch.device("meta"):
        model = build()
    if shard is None:
        for block in blocks(model):
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
    else:
        shard(model, mesh)
    model.to_empty(device=device if device is not None else current_world().device)
    return model


@torch.no_grad()
def load_full(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state dict into a sharded model: each rank takes its own rows of each
    parameter (FSDP2's even dim-0 chunk) and whole buffers.

    Raises:
        KeyError: ``full`` lacks one of the model's tensors.
        ValueError: a tensor's shape differs.
    """
    for name, value in _tensors(model):
        source = full[name]
        if tuple(source.shape) != tuple(value.shape):
            raise ValueError(
                f"{name}: {tuple(source.shape)} in the state dict, {tuple(value.shape)} in the model"
            )
        if isinstance(value, DTensor):
            local = value.to_local()
            if local.ndim == 0 or tuple(value.placements) != (Shard(0),):
                local.copy_(source)
                continue
            mesh = value.device_mesh
            first, rows = fsdp_ranges(source.shape[0], mesh.size())[mesh.get_local_rank()]
            local.copy_(source[first : first + rows])
        else:
            value.copy_(source)


def _tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters()
    persistent = model.state_dict(keep_vars=True)
    for name, buf in model.named_buffers():
        if name in persistent:
            yield name, buf


def precision_options(mixed_precision: str) -> dict[str, Any]:
    """``fully_shard``'s options for the built-in loop's ``train.mixed_precision``: none for ``none``;
    ``mp_policy=MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` for ``bfloat16``.

    Raises:
        ValueError: another name (:func:`~elastic_train.train.config.check_mixed_precision`).
    """
    check_mixed_precision(mixed_precision)
    if mixed_precision == "none":
        return {}
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = getattr(torch, mixed_precision)  # a name of MIXED_PRECISION other than none is a torch dtype's
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}


class ShardedTask:
    """The built-in loop's FSDP2 (``train.fsdp: true``): the task's model sharded anew in each group, the
    task's optimizer pointed at the new shards.

    The task builds its model once, on the CPU, seeded: those are the initial weights (:attr:`initial`),
    kept for a first start, and the model itself becomes a meta-device skeleton. Each group then builds a
    copy of the skeleton, shards it (:func:`shard_model`), sets the buffers a checkpoint does not hold
    (``persistent=False``) to their initial values, and re-points the optimizer's parameter groups at the new
    shards with an empty state — the restore loads the step's state into them. The optimizer and the
    scheduler stay the task's own objects. ``mixed_precision`` (``train.mixed_precision``) sets the compute
    dtype of every ``fully_shard`` call (:func:`precision_options`).
    """

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, mixed_precision: str = "none"
    ) -> None:
        self._options = precision_options(mixed_precision)
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self._buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
        names = {id(p): n for n, p in model.named_parameters()}
        self._names = [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
        self._skeleton = model.to("meta")
        self.optimizer = optimizer

    def build(self, device: torch.device) -> torch.nn.Module:
        """The model sharded over the current group, its shards allocated on ``device``; the optimizer now
        steps them."""
        import copy
        from collections import defaultdict

        model = shard_model(lambda: copy.deepcopy(self._skeleton), device=device, **self._options)
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(self._buffers[name])
        params = dict(model.named_parameters())
        for group, names in zip(self.optimizer.param_groups, self._names, strict=True):
            group["params"] = [params[n] for n in names]
        self.optimizer.state = defaultdict(dict)
        return model
