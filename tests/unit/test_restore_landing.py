"""Restored bytes land in the live tensors they are loaded into (where dtype and shape fit), or in a buffer
of their own; either way the state is the saved one, bit for bit."""

from __future__ import annotations

import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
from elastic_train.checkpoint.codec import flatten, tensor_at
from elastic_train.checkpoint.transfer import Landing
from elastic_train.train.state import TrainState


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "a": torch.rand(1000, generator=g),
        "b": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "c": torch.rand(5, 7, generator=g).double(),
        "empty": torch.zeros(0),
        "flag": torch.tensor(True),
    }


@pytest.mark.parametrize("chunk", [1, 63, 64, 1000, 1 << 20])
def test_landing_puts_every_byte_in_place_whatever_the_bucket_size(chunk: int) -> None:
    flat = flatten(state())
    buf = torch.zeros(flat.nbytes, dtype=torch.uint8)
    for s, t in zip(flat.specs, flat.tensors, strict=True):
        tensor_at(buf, s).copy_(t)
    live = {"/a": torch.zeros(1000), "/b": torch.zeros(4, 3, dtype=torch.int64), "/c": torch.zeros(5, 7)}
    landing = Landing(flat.specs, [live.get(s.path) for s in flat.specs])
    for start in range(0, flat.nbytes, chunk):
        landing.land(start, buf[start : start + chunk])
    got = dict(zip([s.path for s in flat.specs], landing.tensors, strict=True))
    assert got["/a"] is live["/a"]  # it fits: the live tensor holds the bytes
    assert got["/b"] is not live["/b"] and got["/c"] is not live["/c"]  # other shape, other dtype
    assert landing.live == 4000
    for s, t in zip(flat.specs, flat.tensors, strict=True):
        assert torch.equal(got[s.path], t), s.path
    assert torch.equal(live["/b"], torch.zeros(4, 3, dtype=torch.int64))


def test_restore_into_the_live_parameters_and_optimizer_buffers(memdir, tmp_path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ts = TrainState(model=model, optimizer=opt)
    cfg = CheckpointConfig(url=str(tmp_path / "c"), memory_dir=memdir, every_steps=0)
    saver = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    saver.save(1, ts.snapshot)
    saver.close()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = opt.state[model[0].weight]["exp_avg"].clone()
    with torch.no_grad():  # the live state moves on; the restore puts step 1 back into the same tensors
        for p in model.parameters():
            p.add_(1.0)
        opt.state[model[0].weight]["exp_avg"].zero_()
    params = [p.data_ptr() for p in model.parameters()]
    buffer = opt.state[model[0].weight]["exp_avg"]
    m = CheckpointManager(cfg, "run", rank=0, world_size=1, local_rank=0)
    restored = m.restore(model=model.state_dict(), into=ts.restore_targets)
    assert restored is not None and restored.source == "memory"
    assert restored.state["optimizer"]["state"][0]["exp_avg"] is buffer
    assert restored.state["model"]["0.weight"].data_ptr() == model[0].weight.data_ptr()
    assert torch.equal(buffer, exp_avg)
    ts.load_state_dict(restored.state)
    assert [p.data_ptr() for p in model.parameters()] == params
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    assert torch.equal(opt.state[model[0].weight]["exp_avg"], exp_avg)
    # What did not land in a live tensor is in a buffer of the holder's own, not in the slot it came from:
    # later snapshots into the slots leave it alone.
    rng_state = restored.state["rng"]["torch"]
    kept = rng_state.clone()
    for n in range(2, 6):
        torch.rand(100)  # moves the RNG whose state each snapshot takes
        m.save(n, ts.snapshot)
    m.memory.wait_idle()  # type: ignore[union-attr]
    assert torch.equal(rng_state, kept)
    m.close()
