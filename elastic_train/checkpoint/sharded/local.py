"""A rank's part of a sharded state: DTensors swapped for their local shards (and back), with the shard map.

A training state (``TrainState.state_dict()``: the model's and the optimizer's state dicts, scheduler, data
position, RNG) of an FSDP2 model holds DTensors: parameters and the optimizer state shaped like them, each
sharded along dim 0 over a 1-D mesh. :func:`split` replaces each by its local tensor and records its global
shape and dtype in a :class:`~elastic_train.checkpoint.sharded.shardmap.ShardMap`, keyed by the tensor's path
in the state (the path :func:`elastic_train.checkpoint.codec.flatten` gives it); what is left is a plain
state the memory tier copies like any other. :func:`join` wraps local tensors of another world's shards as
DTensors on that world's mesh again.

Supported: ``Shard(0)`` over a 1-D mesh of every rank of the world in rank order (FSDP2's ``fully_shard``
on ``init_device_mesh(device, (W,))``), and ``Replicate()`` (kept whole on every rank). Anything else
(a 2-D mesh, ``Shard(1)``, a mesh over some ranks) is refused with one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.sharded.shardmap import ShardMap, fsdp_ranges

_SHARD0 = (Shard(0),)
_REPLICATE = (Replicate(),)


class UnsupportedSharding(CheckpointError):
    """A DTensor whose placement this version cannot keep (one line names it and what is supported)."""


def _walk(v: Any, path: str, leaf: Callable[[Any, str], Any]) -> Any:
    """``v`` rebuilt with every non-container value replaced by ``leaf(value, path)``; paths as
    :func:`elastic_train.checkpoint.codec.flatten` names them (``/model/fc.weight``, ``/optimizer/state/0/
    exp_avg``)."""
    if isinstance(v, Mapping):
        return {k: _walk(x, f"{path}/{k}", leaf) for k, x in v.items()}
    if isinstance(v, list):
        return [_walk(x, f"{path}/{i}", leaf) for i, x in enumerate(v)]
    if isinstance(v, tuple):
        return tuple(_walk(x, f"{path}/{i}", leaf) for i, x in enumerate(v))
    return leaf(v, path)


def leaves(state: Any) -> list[tuple[str, Any]]:
    """Every non-container value of ``state`` with its path (as :func:`_walk` names them)."""
    out: list[tuple[str, Any]] = []

    def leaf(v: Any, path: str) -> Any:
        out.append((path, v))
        return v

    _walk(state, "", leaf)
    return out


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2's ``fully_shard``, or a DTensor model)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def check_mesh(t: DTensor, path: str, rank: int, world_size: int) -> None:
    """Refuse a DTensor the sharded tiers cannot keep (one line: where, what, what is supported).

    Raises:
        UnsupportedSharding: a mesh that is not 1-D over ranks 0..W-1, or a placement other than
            ``Shard(0)`` and ``Replicate()``, or local rows other than FSDP2's even chunks.
    """
    mesh = t.device_mesh
    where = f"state at {path}"
    if mesh.ndim != 1:
        raise UnsupportedSharding(
            f"{where}: a {mesh.ndim}-D device mesh (hybrid sharding) is not supported; shard over a 1-D mesh "
            "of every rank (fully_shard(module, mesh=init_device_mesh(device, (world_size,))))"
        )
    if mesh.mesh.tolist() != list(range(world_size)):
        raise UnsupportedSharding(
            f"{where}: the device mesh holds ranks {mesh.mesh.tolist()}, not every rank of the world of "
            f"{world_size} in order"
        )
    if tuple(t.placements) == _REPLICATE:
        return
    if tuple(t.placements) != _SHARD0:
        raise UnsupportedSharding(
            f"{where}: placement {tuple(t.placements)} is not supported (FSDP2's Shard(0) and Replicate() "
            "are)"
        )
    rows = fsdp_ranges(t.shape[0], world_size)[rank][1] if t.ndim else 0
    local = t.to_local()
    if t.ndim == 0 or local.shape[0] != rows:
        raise UnsupportedSharding(
            f"{where}: rank {rank} holds {local.shape[0] if local.ndim else 0} rows of {tuple(t.shape)}, not "
            f"FSDP2's even chunk of {rows}"
        )


def split(state: Any, *, rank: int, world_size: int) -> tuple[Any, ShardMap]:
    """The state with every sharded DTensor replaced by this rank's local shard (and every replicated one by
    its local, whole tensor), and the map of the sharded ones.

    Raises:
        UnsupportedSharding: a DTensor the sharded tiers cannot keep (:func:`check_mesh`).
    """
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}

    def leaf(v: Any, path: str) -> Any:
        if not isinstance(v, DTensor):
            return v
        check_mesh(v, path, rank, world_size)
        local = v.to_local()
        if tuple(v.placements) == _SHARD0:
            shapes[path] = (tuple(v.shape), str(v.dtype).removeprefix("torch."))
            if not local.is_contiguous():
                local = local.contiguous()
        return local.detach()

    return _walk(state, "", leaf), ShardMap.even(shapes, world_size)


def join(state: Any, smap: ShardMap, mesh: Any) -> Any:
    """The state with each tensor at a path of ``smap`` (a local shard of ``mesh``'s world) wrapped as the
    DTensor ``Shard(0)`` over ``mesh``, with the map's global shape."""

    def leaf(v: Any, path: str) -> Any:
        t = smap.tensors.get(path)
        if t is None or not isinstance(v, torch.Tensor):
            return v
        shape = torch.Size(t.shape)
        return DTensor.from_local(
            v, mesh, _SHARD0, run_check=False, shape=shape, stride=_contiguous_stride(t.shape)
        )

    return _walk(state, "", leaf)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def live_shards(model_state: Mapping[str, Any], prefix: str = "/model") -> dict[str, torch.Tensor]:
    """The local tensors of a sharded model's state dict by path (``/model/<name>``): where a restore lands
    the model's shards (they are views of the parameters' own storage)."""
    out: dict[str, torch.Tensor] = {}
    for name, v in model_state.items():
        if isinstance(v, DTensor) and tuple(v.placements) == _SHARD0:
            out[f"{prefix}/{name}"] = v.to_local()
    return out


def mesh_of(model_state: Mapping[str, Any]) -> Any:
    """The device mesh of a sharded model's state dict (its first DTensor's); None without one."""
    for v in model_state.values():
        if isinstance(v, DTensor):
            return v.device_mesh
    return None
