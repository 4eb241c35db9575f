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
import torch

from elastic_train.train.balance import (
    ShareBalancer,
    ShareChange,
    SpeedShares,
    share_bounds,
    share_range,
    weighted_counts,
)
from elastic_train.train.config import TrainConfig
from elastic_train.train.errors import TrainingError
from elastic_train.train.sampler import ElasticBatchSampler, ElasticSampler

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


def test_a_change_decided_on_a_slowdown_caught_in_part_is_not_undone() -> None:
    """Rank 2 slows 1.4x for a few steps, then 2x: the first change is decided on a window that caught the
    slowdown only in part, and under the new shares rank 2 is busier than before with fewer samples. That
    is a rank that slowed, not a cost the split cannot move: the shares are decided afresh, not undone."""
    bal = ShareBalancer(3, G)
    model: Model = lambda s, r, n: costs({2: 1.0 if s < 10 else 1.4 if s < 14 else 2.0})(s, r, n)  # noqa: E731
    changes = drive(bal, 80, model)
    assert [c.why for c in changes] == ["faster", "faster"], [c.fields() for c in changes]
    assert changes[0].new == [9, 9, 6] and changes[1].new[2] == 5, [c.fields() for c in changes]
    assert changes[1].step - changes[0].step <= bal.window + 2  # one window, no hold


def test_a_very_slow_rank_keeps_the_floor_and_a_fast_one_the_cap() -> None:
    bal = ShareBalancer(3, G, floor=0.25, cap=2.0)
    drive(bal, 100, costs({2: 20.0}, overhead=0.0))
    assert bal.counts(G)[2] == 2  # a quarter of the even 8
    bal = ShareBalancer(2, G, cap=1.25)
    drive(bal, 100, costs({1: 20.0}, overhead=0.0))
    assert bal.counts(G) == [15, 9]  # 1.25 · 12 for the fast one


def test_unknown_times_and_steps_before_the_change_applies_are_not_judged() -> None:
    bal = ShareBalancer(2, G, window=2)
    for step in range(1, 20):
        assert bal.observe(step, G, [0.1, 0.0]) is None  # rank 1's time unknown: no decision
    assert bal.observe(20, G, [0.1, 0.2]) is None  # one window entry of two
    assert bal.observe(21, G, [0.1, 0.2], applies_from=25) is not None
    for step in range(22, 25):  # drawn under the old shares: even absurd times decide nothing
        assert bal.observe(step, G, [0.1, 100.0], applies_from=step + 4) is None
    assert bal.observe(25, G, [0.1, 0.2]) is None  # the first of the window under the new shares
    with pytest.raises(AssertionError):
        bal.observe(26, G, [0.1, 0.2], applies_from=26)  # a change cannot apply to a step already trained


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
    for _ in range(6):  # across the epoch's end (100 = 4 · 24 + 4) into the next
        plans = [s.plan(3, r, weights) for r, s in enumerate(samplers)]
        assert [len(p.indices) for p in plans] == weighted_counts(plans[0].size, weights, 3)
        taken += [i for p in plans for i in p.indices]
        for s, p in zip(samplers, plans, strict=True):
            s.advance(p)
    assert sorted(taken[:100]) == list(range(100))  # the epoch, each sample once
    assert len(set(taken[100:])) == G


def test_batch_sampler_draws_each_step_with_the_shares_agreed_for_it() -> None:
    s = ElasticBatchSampler(240, G, seed=0, world_size=3, rank=2, shares="speed")
    batches = iter(s)
    assert len(next(batches)) == 8 and s.ahead() == 1  # step 1 drawn
    s.set_weights((2.0, 2.0, 1.0), 3)  # agreed while step 1 trains: from step 3 on
    assert len(next(batches)) == 8 and s.ahead() == 2  # step 2: drawn with the even shares
    s.advance()
    assert len(s.current().indices) == 8 and s.loss_weight() == pytest.approx(8 * 3 / G)
    share = next(batches)  # step 3
    s.advance()
    assert len(share) == 5 and share == s.current().indices
    assert s.loss_weight() == pytest.approx(5 * 3 / G)
    assert s.weights_at(2) is None and s.weights_at(99) == (2.0, 2.0, 1.0)
    with pytest.raises(TrainingError, match="already drew step 3"):
        s.set_weights(None, 3)  # a split of a step drawn already would differ from the other ranks'
    s.set_weights(None, 5)
    assert [len(next(batches)) for _ in range(2)] == [5, 8]  # steps 4 and 5
    s.reset_weights()  # a new group: even shares, nothing drawn
    assert s.weights_at(4) is None and s.ahead() == 0


def test_speed_shares_apply_after_every_rank_s_prefetch() -> None:
    """The decision at a step's commit applies from the first step no rank can have drawn."""
    world, per_sample = 3, [0.01, 0.01, 0.02]
    s = ElasticBatchSampler(100_000, G, seed=0, world_size=world, rank=0, shares="speed")
    shares = SpeedShares(s, rank=0, world_size=world)
    batches = iter(s)
    next(batches)
    assert shares.slots(0.5).tolist() == [0.0] * 3 + [1.0, 0.0, 0.0]  # nothing committed yet: busy unknown
    assert shares.decide(1, G, None) is None  # nothing carried: nothing decided
    for step in range(2, 40):
        next(batches)  # this rank draws one step ahead; rank 1's DataLoader draws 4 ahead
        counts = weighted_counts(G, s.weights_at(step - 1), world)
        carried = torch.tensor([c * n for c, n in zip(per_sample, counts, strict=True)] + [1.0, 4.0, 1.0])
        change = shares.decide(step, G, carried)
        s.advance()
        if change is not None:
            break
    else:
        raise AssertionError("no change")
    assert change.new[2] < change.new[0] and s.weights_at(step + 4) is None
    assert s.weights_at(step + 5) == shares.balancer.weights  # 4 ahead of step - 1, one draw of margin
    for bad in (torch.zeros(5), None):  # a vector of another world, nothing carried: no decision
        assert shares.decide(step + 1, G, bad) is None


def test_speed_shares_setting_of_the_sampler() -> None:
    with pytest.raises(ValueError, match="shares: 'fast' is not one of even, speed"):
        ElasticBatchSampler(240, G, shares="fast")


def test_speed_shares_setting() -> None:
    assert TrainConfig().shares == "even"
    assert TrainConfig(shares="speed").shares == "speed"
    with pytest.raises(ValueError, match="shares: 'fast' is not one of even, speed"):
        TrainConfig(shares="fast")
    assert TrainConfig(shares="speed", fsdp=True).fsdp  # the built-in loop's loss sum carries the times
