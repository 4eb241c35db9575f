"""Elastic sampler: contiguous shares, epoch boundaries, and exactly-once under any resize sequence."""

from __future__ import annotations

import itertools
import random

import pytest

from elastic_train.train.balance import share_bounds
from elastic_train.train.sampler import ElasticSampler, epoch_permutation


@pytest.mark.parametrize("size", [0, 1, 5, 7, 48])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 9])
def test_shares_are_contiguous_disjoint_and_cover(size: int, world: int) -> None:
    bounds = [share_bounds(size, world, r) for r in range(world)]
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    for (_, hi), (lo, _) in itertools.pairwise(bounds):
        assert hi == lo
    lengths = [hi - lo for lo, hi in bounds]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the extra samples go to the first ranks


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    a = epoch_permutation(3, 0, 100)
    assert sorted(a.tolist()) == list(range(100))
    assert a.tolist() == epoch_permutation(3, 0, 100).tolist()
    assert a.tolist() != epoch_permutation(3, 1, 100).tolist()
    assert a.tolist() != epoch_permutation(4, 0, 100).tolist()


def run_steps(sampler: ElasticSampler, world: int) -> list[int]:
    """One step at ``world`` ranks; returns the union of the ranks' indices in rank order."""
    plans = [sampler.plan(world, r) for r in range(world)]
    assert len({(p.epoch, p.start, p.size) for p in plans}) == 1
    sampler.advance(plans[0])
    return [i for p in plans for i in p.indices]


def test_step_union_is_independent_of_world_size() -> None:
    orders = []
    for world in (1, 2, 3, 5):
        s = ElasticSampler(50, 7, seed=11)
        orders.append([run_steps(s, world) for _ in range(20)])
    assert all(o == orders[0] for o in orders)


def test_last_step_of_epoch_is_short_and_never_straddles() -> None:
    s = ElasticSampler(10, 4, seed=0)
    sizes = []
    for _ in range(6):
        p = s.plan(1, 0)
        sizes.append((p.epoch, p.size))
        s.advance(p)
    assert sizes == [(0, 4), (0, 4), (0, 2), (1, 4), (1, 4), (1, 2)]
    assert s.state_dict() == {"epoch": 2, "cursor": 0, "seed": 0, "dataset_len": 10, "global_batch": 4}


def test_random_resizes_with_restores_train_every_sample_once_per_epoch() -> None:
    rnd = random.Random(5)
    n, g = 101, 8
    s = ElasticSampler(n, g, seed=2)
    seen: dict[int, list[int]] = {}
    for _ in range(60):
        if rnd.random() < 0.3:  # a failure: a new sampler continues from the saved cursor
            saved = s.state_dict()
            s = ElasticSampler(n, g, seed=2)
            s.load_state_dict(saved)
        epoch = s.epoch
        seen.setdefault(epoch, []).extend(run_steps(s, rnd.randint(1, 10)))
    for epoch, indices in seen.items():
        assert len(indices) == len(set(indices)), f"epoch {epoch} repeats samples"
        if epoch < s.epoch:
            assert sorted(indices) == list(range(n))


def test_empty_share_when_world_exceeds_step() -> None:
    s = ElasticSampler(10, 2, seed=0)
    assert [len(s.plan(3, r).indices) for r in range(3)] == [1, 1, 0]


def test_load_state_rejects_other_seed_and_bad_cursor() -> None:
    s = ElasticSampler(10, 2, seed=0)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({"epoch": 0, "cursor": 0, "seed": 1})
    with pytest.raises(ValueError, match="cursor 10"):
        s.load_state_dict({"epoch": 0, "cursor": 10, "seed": 0})


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="dataset_len"):
        ElasticSampler(0, 1, seed=0)
    with pytest.raises(ValueError, match="global_batch"):
        ElasticSampler(1, 0, seed=0)
