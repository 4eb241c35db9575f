"""Speed-weighted shares (``train.shares: speed``): the split, the balancer's decisions, the sampler's shares.

The balancer is driven here as the loop drives it: step ``k``'s shares are drawn before step ``k - 1``'s
busy times are known, and each step's busy times come from a cost model ``overhead + per_sample · n`` per
rank (times a slowdown factor), with noise where a test says so.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from elastic_train.train.balance import ShareBalancer, ShareChange, share_range, weighted_counts
from elastic_train.train.config import TrainConfig
from elastic_train.train.sampler import ElasticBatchSampler, ElasticSampler, share_bounds

G = 24


def test_even_weights_split_as_the_even_shares_do() -> None:
    for size in (1, 7, 24, 25):
        for world in (1, 2, 3, 5, 30):
            counts = weighted_counts(size, None, world)
            assert [share_range(counts, r) for r in range(world)] == [
                share_bounds(size, world, r) for r in range(world)
            ]
            assert weighted_counts(size, (1.0,) * world, world) == counts  # ties go to the lower rank


def test_weighted_counts_follow_the_weights_and_cover_the_step() -> None:
    assert weighted_counts(24, (2.0, 2.0, 1.0), 3) == [10, 9, 5]
    assert weighted_counts(24, (0.4, 0.4, 0.2), 3) == [10, 9, 5]  # only the ratios count
    rng = random.Random(7)
    for _ in range(200):
        world = rng.randint(1, 8)
        weights = tuple(rng.uniform(0.1, 3.0) for _ in range(world))
        size = rng.randint(1, 100)
        counts = weighted_counts(size, weights, world)
        assert sum(counts) == size and min(counts) >= 0
        exact = [size * w / sum(weights) for w in weights]
        assert all(abs(c - x) < 1 for c, x in zip(counts, exact, strict=True))
        spans = [share_range(counts, r) for r in range(world)]
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))


Model = Callable[[int, int, int], float]


def drive(
    bal: ShareBalancer, steps: int, busy: Model, noise: float = 0.0, seed: int = 0
) -> list[ShareChange]:
    """Run ``steps`` steps as the loop does; ``busy(step, rank, n)`` is a rank's busy seconds."""
    rng = random.Random(seed)
    changes = []
    drawn = bal.counts(G)  # step 1's shares
    for step in range(1, steps + 1):
        counts = drawn
        times = [busy(step, r, n) * (1 + noise * rng.uniform(-1, 1)) for r, n in enumerate(counts)]
        drawn = bal.counts(G)  # the next step's shares are drawn before this step's times are known
        change = bal.observe(step, G, times)
        if change is not None:
            changes.append(change)
    return changes


def costs(slow: dict[int, float], overhead: float = 0.005, per_sample: float = 0.032) -> Model:
    return lambda step, rank, n: slow.get(rank, 1.0) * (overhead + per_sample * n)


def test_a_rank_slowed_twice_trains_a_fifth_of_the_step_and_the_step_shortens() -> None:
    bal = ShareBalancer(3, G)
    model = costs({2: 2.0})
    changes = drive(bal, 60, model)
    assert changes and changes[0].old == [8, 8, 8] and changes[0].why == "faster"
    counts = bal.counts(G)
    assert counts[2] == 5 and sum(counts) == G, changes
    before = max(model(0, r, 8) for r in range(3))
    after = max(model(0, r, n) for r, n in enumerate(counts))
    assert before / after > 1.5  # 2 · 8 = 16 sample times a step before, 10 after
    assert len(changes) <= 2, [c.fields() for c in changes]  # settles instead of hunting
    fields = changes[0].fields()
    assert fields["new"] == changes[0].new and fields["predicted_gain"] > 1.05
    assert fields["cost_ms_per_sample"][2] > 1.8 * fields["cost_ms_per_sample"][0]


def test_noise_on_a_healthy_job_moves_nothing() -> None:
    bal = ShareBalancer(3, G)
    assert drive(bal, 1000, costs({}), noise=0.04, seed=3) == []
    assert bal.weights is None


def test_a_node_that_is_fast_again_earns_its_share_back() -> None:
    bal = ShareBalancer(3, G)
    slow_until = 100
    changes = drive(bal, 200, lambda s, r, n: costs({2: 2.0} if s <= slow_until else {})(s, r, n))
    assert bal.counts(G) == [8, 8, 8], [c.fields() for c in changes]
    back = [c for c in changes if c.step > slow_until]
    assert back and back[0].step <= slow_until + 2 * bal.window + 2  # within two windows of its recovery


def test_a_cost_that_does_not_shrink_with_the_share_is_undone_and_held_off() -> None:
    """A node slow in a per-step cost that does not scale with its samples: taking samples away from it
    does not shorten the step. The change is undone after one window, and the next try waits ``hold``
    steps, then twice as long."""
    bal = ShareBalancer(3, G, hold=20)
    model: Model = lambda s, r, n: 0.6 if r == 2 else 0.3 + 0.001 * n  # noqa: E731
    changes = drive(bal, 200, model)
    whys = [c.why for c in changes]
    assert whys[:4] == ["faster", "undone", "faster", "undone"], [c.fields() for c in changes]
    assert changes[1].new == [8, 8, 8]
    assert changes[2].step - changes[1].step >= 20 + bal.window
    assert changes[4].step - changes[3].step >= 40 + bal.window if len(changes) > 4 else True
    assert changes[3].step - changes[2].step == bal.window + 1  # judged on the first full window


def test_a_very_slow_rank_keeps_the_floor_and_a_fast_one_the_cap() -> None:
    bal = ShareBalancer(3, G, floor=0.25, cap=2.0)
    drive(bal, 100, costs({2: 20.0}, overhead=0.0))
    assert bal.counts(G)[2] == 2  # a quarter of the even 8
    bal = ShareBalancer(2, G, cap=1.25)
    drive(bal, 100, costs({1: 20.0}, overhead=0.0))
    assert bal.counts(G) == [15, 9]  # 1.25 · 12 for the fast one


def test_unknown_times_and_steps_before_begin_are_not_judged() -> None:
    bal = ShareBalancer(2, G, window=2)
    bal.begin(5)
    for step in range(1, 5):  # start-up steps: slow, but not judged
        assert bal.observe(step, G, [0.1, 10.0]) is None
    for step in range(5, 20):
        assert bal.observe(step, G, [0.1, 0.0]) is None  # rank 1's time unknown: no decision
    assert bal.observe(20, G, [0.1, 0.2]) is None  # one window entry of two
    assert bal.observe(21, G, [0.1, 0.2]) is not None
    assert bal.observe(22, G, [0.1, 0.3]) is None  # step 22 was drawn under the old shares


def test_balancer_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="floor"):
        ShareBalancer(2, G, floor=0.0)
    with pytest.raises(ValueError, match="cap"):
        ShareBalancer(2, G, cap=0.5)
    with pytest.raises(ValueError, match="window"):
        ShareBalancer(2, G, window=0)


def test_weighted_shares_of_every_rank_cover_each_step_once() -> None:
    weights = (2.0, 2.0, 1.0)
    taken: list[int] = []
    samplers = [ElasticSampler(100, G, seed=1) for _ in range(3)]
    for s in samplers:
        s.weights = weights
    for _ in range(6):  # across the epoch's end (100 = 4 · 24 + 4) into the next
        plans = [s.plan(3, r) for r, s in enumerate(samplers)]
        assert [len(p.indices) for p in plans] == weighted_counts(plans[0].size, weights, 3)
        taken += [i for p in plans for i in p.indices]
        for s, p in zip(samplers, plans, strict=True):
            s.advance(p)
    assert sorted(taken[:100]) == list(range(100))  # the epoch, each sample once
    assert len(set(taken[100:])) == G


def test_batch_sampler_draws_each_step_with_the_weights_of_its_time() -> None:
    s = ElasticBatchSampler(240, G, seed=0, world_size=3, rank=2)
    batches = iter(s)
    assert len(next(batches)) == 8 and len(s.current().indices) == 8
    s.advance()
    s.weights = (2.0, 2.0, 1.0)  # changed between two steps: the next one is drawn with them
    share = next(batches)
    assert len(share) == 5 and share == s.current().indices
    assert s.loss_weight() == pytest.approx(5 * 3 / G)


def test_speed_shares_setting() -> None:
    assert TrainConfig().shares == "even"
    assert TrainConfig(shares="speed").shares == "speed"
    with pytest.raises(ValueError, match="shares: 'fast' is not one of even, speed"):
        TrainConfig(shares="fast")
    with pytest.raises(ValueError, match="needs DDP"):
        TrainConfig(shares="speed", fsdp=True)
