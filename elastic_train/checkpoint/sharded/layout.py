"""Where each tensor of a sharded state goes in a DCP directory, and back.

The DCP layout is ``get_state_dict``'s ``{"model": ..., "optim": ...}`` (what anyone's ``dcp.load`` of a
model and its optimizer expects), plus ``elastic_train.<path>`` for the state's other tensors (RNG states):
:func:`dcp_key` names each tensor of a rank's state, :func:`dcp_state` builds the state ``dcp.save`` writes
(DTensors over this world's mesh for the sharded ones), :func:`manifest_tensors` lists them for the
manifest, and :func:`read_like` reads one back in a rank's shape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from elastic_train.checkpoint.codec import Flat
from elastic_train.checkpoint.sharded import dcp
from elastic_train.checkpoint.sharded.local import join, leaves
from elastic_train.checkpoint.sharded.shardmap import ShardMap, fsdp_ranges
from elastic_train.log import get_logger

log = get_logger(__name__)


def pieces(manifest: Mapping[str, Any] | None) -> dict[str, list[str]] | None:
    """The piece digests of each file a manifest lists (None without a manifest)."""
    if manifest is None:
        return None
    return {f["name"]: list(f["pieces"]) for f in manifest["files"]}


def dcp_key(path: str, fqns: list[str]) -> str:
    """The key of a state's tensor in the DCP directory: ``model.<name>``, ``optim.state.<param>.<key>``
    (the layout of ``get_state_dict``'s ``{"model": ..., "optim": ...}``), ``elastic_train.<path>`` for the
    rest (RNG states and the like)."""
    if path.startswith("/model/"):
        return "model." + path[len("/model/") :]
    parts = path.strip("/").split("/")
    if (
        len(parts) == 4
        and parts[:2] == ["optimizer", "state"]
        and parts[2].isdigit()
        and int(parts[2]) < len(fqns)
    ):
        return f"optim.state.{fqns[int(parts[2])]}.{parts[3]}"
    return "elastic_train." + path.strip("/")


def dcp_state(local: Mapping[str, Any], smap: ShardMap, mesh: Any, fqns: list[str]) -> dict[str, Any]:
    """DCP's nested state of a rank's part: ``{"model", "optim", "elastic_train"}`` with DTensors for the
    sharded tensors (views of the slot: DCP copies what it writes)."""
    model: dict[str, Any] = {}
    per_param: dict[str, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    for path, t in leaves(join(local, smap, mesh)):
        if not isinstance(t, torch.Tensor):
            continue
        key = dcp_key(path, fqns)
        if key.startswith("model."):
            model[key[len("model.") :]] = t
        elif key.startswith("optim.state."):
            param, sub = key[len("optim.state.") :].rsplit(".", 1)
            per_param.setdefault(param, {})[sub] = t
        else:
            rest[key[len("elastic_train.") :]] = t
    out: dict[str, Any] = {"model": model}
    optimizer = local.get("optimizer")
    if isinstance(optimizer, Mapping):
        groups = optimizer.get("param_groups") or []
        out["optim"] = {
            "state": per_param,
            "param_groups": [
                {
                    **g,
                    "params": [
                        fqns[i] if type(i) is int and i < len(fqns) else i for i in g.get("params", [])
                    ],
                }
                for g in groups
                if isinstance(g, Mapping)
            ],
        }
    if rest:
        out["elastic_train"] = rest
    return out


def manifest_tensors(flat: Flat, smap: ShardMap, fqns: list[str]) -> tuple[Any, list[dict[str, Any]]]:
    """The state's skeleton (tensor indices into the manifest's list) and that list: each tensor's global
    shape, dtype and DCP key."""
    entries = []
    for spec in flat.specs:
        path = spec.path.removeprefix("/state")
        t = smap.tensors.get(path)
        shape = list(t.shape) if t is not None else list(spec.shape)
        nbytes = t.nbytes if t is not None else spec.nbytes
        entries.append(
            {"path": path, "dtype": spec.dtype, "shape": shape, "nbytes": nbytes, "key": dcp_key(path, fqns)}
        )
    return flat.skeleton["state"], entries


def fingerprint(entries: list[dict[str, Any]]) -> list[list[Any]]:
    return sorted(
        [e["path"][len("/model/") :], e["dtype"], e["shape"]]
        for e in entries
        if e["path"].startswith("/model/")
    )


def read_like(reader: dcp.DcpReader, key: str, like: Any, mesh: Any, rank: int) -> Any:
    """The tensor at ``key``, as ``like`` is sharded: this rank's rows (FSDP2's even chunk) as a DTensor on
    ``mesh`` when ``like`` is a sharded DTensor of that shape, whole otherwise (a step count, a buffer)."""
    from torch.distributed.tensor import DTensor, Shard

    stored = reader.layout.tensors[key]
    if (
        isinstance(like, DTensor)
        and tuple(like.placements) == (Shard(0),)
        and stored.shape == tuple(like.shape)
    ):
        first, rows = fsdp_ranges(stored.shape[0], mesh.size())[rank]
        into = torch.empty((rows, *stored.shape[1:]), dtype=stored.dtype)
        reader.read(key, into, first)
        return DTensor.from_local(
            into, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
        )
    into = torch.empty(stored.shape, dtype=stored.dtype)
    reader.read(key, into)
    return into


def mesh_at(model: torch.nn.Module, rank: int, world_size: int) -> Any:
    """The device mesh of ``model``'s sharded parameters, checked to place this process at ``rank``; a
    fresh 1-D mesh of the group when it does not (a mesh of an earlier group whose DTensors torch kept)."""
    from torch.distributed.tensor import DTensor

    mesh = next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)
    if mesh is None or mesh.get_coordinate() == (rank,):
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    log.warning("device_mesh_stale", coordinate=mesh.get_coordinate(), rank=rank)
    return init_device_mesh(mesh.device_type, (world_size,))
