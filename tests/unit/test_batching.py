"""Constant global batch: the sample-count weighting gives exactly the mean-loss gradient at any split."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from elastic_train.train import rng
from elastic_train.train.api import load_task
from elastic_train.train.balance import share_bounds
from elastic_train.train.batching import loss_scale, micro_batches
from elastic_train.train.config import TrainConfig
from elastic_train.train.events import EventWriter
from elastic_train.train.loop import Trainer


def test_micro_batches() -> None:
    assert micro_batches([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert micro_batches([1, 2, 3], 0) == [[1, 2, 3]]
    assert micro_batches([1, 2, 3], 3) == [[1, 2, 3]]
    assert micro_batches([], 4) == [[]]


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])  # type: ignore[union-attr]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("micro", [0, 1, 2])
def test_weighted_rank_gradients_average_to_the_mean_loss_gradient(world: int, micro: int) -> None:
    """Emulates DDP: each rank accumulates its scaled micro-batch gradients, then the ranks are averaged."""
    rng.seed_all(0)
    task = load_task("regression", {"n_samples": 64})
    model, data = task.model, task.dataset
    indices = list(range(3, 10))  # a step of 7 samples: uneven over most world sizes
    n = len(indices)
    model.zero_grad()
    task.loss_fn(model, data.batch(indices)).mean().backward()  # type: ignore[attr-defined]
    expected = _grads(model).clone()

    per_rank = []
    for r in range(world):
        lo, hi = share_bounds(n, world, r)
        model.zero_grad()
        for chunk in micro_batches(indices[lo:hi], micro):
            (task.loss_fn(model, data.batch(chunk)).sum() * loss_scale(n, world)).backward()  # type: ignore[attr-defined]
        per_rank.append(_grads(model).clone())
    averaged = torch.stack(per_rank).sum(0) / world
    torch.testing.assert_close(averaged, expected, rtol=1e-12, atol=1e-14)


class NullCheckpointer:
    last_committed = None

    def restore(self, model: object = None) -> None:
        return None

    def save(self, step: int, state: object) -> None:
        pass

    def finalize(self, step: int, state: object) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def world_one() -> object:
    from elastic_train.net import free_port

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def train(micro: int, steps: int = 6) -> dict[str, torch.Tensor]:
    cfg = TrainConfig(task="regression", steps=steps, global_batch=10, micro_batch=micro, seed=3)
    rng.seed_all(cfg.seed)
    task = load_task("regression", {"n_samples": 64})
    trainer = Trainer(
        cfg,
        task,
        rank=0,
        world_size=1,
        round=0,
        device=torch.device("cpu"),
        checkpointer=NullCheckpointer(),
        events=EventWriter(None, round=0, world_size=1),
    )
    trainer.run()
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def test_gradient_accumulation_matches_one_big_batch_in_ddp(world_one: object) -> None:
    whole = train(micro=0)
    for micro in (1, 3, 4):
        accumulated = train(micro=micro)
        for key, value in whole.items():
            torch.testing.assert_close(accumulated[key], value, rtol=1e-12, atol=1e-13)


def test_trainer_state_round_trip_continues_identically(world_one: object) -> None:
    cfg = TrainConfig(task="regression", steps=8, global_batch=10, seed=3)
    straight = train(micro=0, steps=8)
    rng.seed_all(cfg.seed)

    def make(steps: int) -> Trainer:
        rng.seed_all(cfg.seed)
        return Trainer(
            TrainConfig(task="regression", steps=steps, global_batch=10, seed=3),
            load_task("regression", {"n_samples": 64}),
            rank=0,
            world_size=1,
            round=0,
            device=torch.device("cpu"),
            checkpointer=NullCheckpointer(),
            events=EventWriter(None, round=0, world_size=1),
        )

    first = make(5)
    first.run()
    import copy

    state = copy.deepcopy(first.state())
    second = make(8)
    second.load_state(state)
    assert second.step == 5 and second.sampler.state_dict() == first.sampler.state_dict()
    second.run()
    for key, value in straight.items():
        assert torch.equal(second.model.state_dict()[key], value), key


def test_rng_restore_from_views_into_one_buffer() -> None:
    """Restored states are views into one flat buffer; restoring them must work (and reproduce draws)."""
    import random

    rng.seed_all(9)
    saved = rng.capture()
    expected = (torch.rand(3), random.random())
    buf = torch.zeros(saved["torch"].numel() + 64, dtype=torch.uint8)
    buf[64:] = saved["torch"]
    rng.restore({**saved, "torch": buf[64:]})
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
