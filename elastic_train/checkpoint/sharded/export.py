"""A sharded checkpoint's model as one plain state dict (``elastic-train ckpt export``, tests, tools).

Every tensor of the model is read whole from the DCP directory — each stored chunk once, each 8 MiB piece
of a file verified against the manifest — whatever the world size that wrote it.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_train.checkpoint.codec import dtype_of
from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.sharded.dcp import DcpReader
from elastic_train.checkpoint.storage import Storage


def model_tensors(storage: Storage, path: str, manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of the model in the sharded checkpoint at ``path`` (whole tensors, on the CPU).

    Raises:
        CheckpointError: the checkpoint holds no model, or a file fails its checksum.
    """
    reader = DcpReader(storage, path, {f["name"]: list(f["pieces"]) for f in manifest["files"]})
    out: dict[str, torch.Tensor] = {}
    for t in manifest["tensors"]:
        if t["path"].startswith("/model/"):
            whole = torch.empty(tuple(t["shape"]), dtype=dtype_of(t["dtype"]))
            reader.read(t["key"], whole)
            out[t["path"][len("/model/") :]] = whole
    if not out:
        raise CheckpointError(f"{path}: the checkpoint holds no model state")
    return out
