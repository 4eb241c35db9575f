"""The own-loop API on a GPU (skipped where no CUDA GPU is visible): NCCL by default, CUDA state committed
into the shared-memory tier through page-locked (pinned) host memory, and restored onto the GPU."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import elastic_train as et
from elastic_train.checkpoint import CheckpointConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def world() -> Iterator[et.World]:
    saved = {k: os.environ.pop(k) for k in TORCHRUN_VARS if k in os.environ}
    w = et.init()
    yield w
    et.shutdown()
    os.environ.update(saved)


def build(memdir: str, url: str) -> et.Checkpointer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(96, 64), torch.randn(96, 1))
    sampler = et.ElasticBatchSampler(data, 16, seed=0)
    state = et.TrainState(model=model, optimizer=opt, sampler=sampler, data=_Data(data))
    cfg = CheckpointConfig(memory_dir=memdir)
    return et.Checkpointer(state, url, every_steps=4, config=cfg, run_id="gpu")


class _Data:
    """Holds the dataset for the loop; its state is nothing (an extra object with an empty state)."""

    def __init__(self, data: TensorDataset) -> None:
        self.data = data

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def test_cuda_state_is_snapshotted_through_pinned_memory_and_restored(
    world: et.World, memdir: str, tmp_path: object
) -> None:
    assert world.backend == "nccl" and world.device == torch.device("cuda", 0)
    ckpt = build(memdir, str(tmp_path))
    assert ckpt.restore() == 0
    sampler = ckpt.state.sampler
    assert isinstance(sampler, et.ElasticBatchSampler)
    model, opt = ckpt.state.model, ckpt.state.optimizer
    assert isinstance(opt, torch.optim.Optimizer)
    data = ckpt.state.extra["data"].data  # type: ignore[attr-defined]
    for x, y in DataLoader(data, batch_sampler=sampler, num_workers=2, pin_memory=True):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        loss = torch.nn.functional.mse_loss(model(x), y) * sampler.loss_weight()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ckpt.commit(loss)
    assert ckpt.step == 6
    expected = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    moments = {k: v.cpu().clone() for k, v in opt.state[next(iter(opt.state))].items()}

    memory = ckpt.manager.memory  # type: ignore[attr-defined]
    held = memory.newest_valid()
    assert held is not None and held.step == 6
    assert memory.data(held.slot, held.nbytes).is_pinned(), "the snapshot slot is not page-locked"
    ckpt.close()  # a crash: no final checkpoint, the memory snapshot stays

    again = build(memdir, str(tmp_path))
    assert again.restore() == 6 and again.source == "memory"
    for key, value in again.state.model.state_dict().items():
        assert value.is_cuda and torch.equal(value.cpu(), expected[key]), key
    restored_opt = again.state.optimizer
    assert isinstance(restored_opt, torch.optim.Optimizer)
    for key, value in restored_opt.state[next(iter(restored_opt.state))].items():
        assert torch.equal(value.cpu(), moments[key]), key
    assert again.state.sampler is not None and again.state.sampler.epoch == 1
    again.finalize()
