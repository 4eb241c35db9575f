"""Other people's code around a DCP checkpoint, run by tests/integration/test_fsdp_train.py under
``torchrun --standalone``: each is what a user of plain FSDP2 + torch.distributed.checkpoint writes.

    torchrun --standalone --nproc-per-node=N tests/integration/dcp_scripts.py load CKPT_DIR OUT.pt
    torchrun --standalone --nproc-per-node=N tests/integration/dcp_scripts.py save CKPT_DIR OUT.pt

(or both in one job: ``load CKPT_DIR OUT.pt save CKPT_DIR2 OUT2.pt``, run in that order).

``load``: ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` of examples/fsdp_train.py's model and AdamW
(float64) from a checkpoint elastic_train wrote at another world size; rank 0 saves the full weights and one
parameter's Adam state to OUT.pt. ``save``: trains that model 3 steps and writes a DCP checkpoint in
torchtitan's layout (``model``, ``optimizer`` flattened as ``get_optimizer_state_dict(...,
flatten_optimizer_state_dict=True)``, ``train_state`` holding a pickled entry), and rank 0 saves what it
wrote, whole, to OUT.pt.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from fsdp_train import Sequences, TinyLM


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(7)
    model = TinyLM().double()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def whole(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.full_tensor() for k, v in model.state_dict().items()}
    first = next(iter(model.parameters()))
    for key, value in optimizer.state[first].items():
        out[f"adam.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value
    return out


def load(path: str, out: str) -> None:
    model, optimizer = model_and_optimizer()
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    result = whole(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(result, out)


def save(path: str, out: str) -> None:
    model, optimizer = model_and_optimizer()
    data = Sequences(64)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(3):
        x, y = data[step * world + rank]
        model(x[None], y[None]).backward()
        optimizer.step()
        optimizer.zero_grad()
    flat = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    losses = io.BytesIO()
    torch.save([1.0, 0.5], losses)
    state = {
        "model": model.state_dict(),
        "optimizer": flat,
        "train_state": {"step": torch.tensor(3), "losses": losses},
    }
    dcp.save(state, checkpoint_id=path)
    result = whole(model, optimizer)
    if rank == 0:
        torch.save(result, out)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    args = sys.argv[1:]
    for i in range(0, len(args), 3):
        {"load": load, "save": save}[args[i]](args[i + 1], args[i + 2])
    dist.barrier()  # nobody tears its gloo pairs down while a peer still uses them
    print(f"rank {dist.get_rank()}: finished", flush=True)  # the work is done and written
    dist.destroy_process_group()
