"""Slow-node detection as a table of step figures: who is flagged, when, and with which numbers."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from elastic_train.straggler.config import StragglerConfig
from elastic_train.straggler.detect import DetectorState, Flag, median_without, observe

CFG = StragglerConfig(threshold=1.5, clear_below=1.2, window=5, slow_steps=3)


def run(
    steps: list[dict[str, float]], cfg: StragglerConfig = CFG, dt: float = 1.0
) -> tuple[DetectorState, list[Flag]]:
    """Feed ``steps`` (node -> busy seconds), one a ``dt`` apart; every flag and clear, in order."""
    state, flags = DetectorState(), []
    for i, busy in enumerate(steps, start=1):
        state, new = observe(state, i, busy, i * dt, cfg)
        flags += new
    return state, flags


def healthy(n: int, jitter: float = 0.0) -> dict[str, float]:
    return {f"n{i}": 1.0 + jitter * ((i % 3) - 1) for i in range(n)}


@pytest.mark.parametrize(
    ("values", "without", "expected"),
    [
        ([1.0, 2.0], 2.0, 1.0),
        ([1.0, 2.0], 1.0, 2.0),
        ([1.0, 1.0, 2.0], 2.0, 1.0),
        ([1.0, 1.0, 2.0], 1.0, 1.5),
        ([1.0, 2.0, 3.0, 4.0], 4.0, 2.0),
        ([1.0, 2.0, 3.0, 4.0], 1.0, 3.0),
        ([5.0, 5.0, 5.0], 5.0, 5.0),
    ],
)
def test_the_median_of_the_others(values: list[float], without: float, expected: float) -> None:
    assert median_without(sorted(values), without) == expected


def test_a_healthy_job_with_jitter_flags_nobody() -> None:
    _, flags = run([healthy(4, jitter=0.2) for _ in range(40)])
    assert flags == []


def test_a_node_twice_as_slow_is_flagged_after_slow_steps_of_a_slow_score() -> None:
    steps = [healthy(3) for _ in range(5)] + [healthy(3) | {"n1": 2.0} for _ in range(10)]
    state, flags = run(steps)
    assert [(f.event, f.node) for f in flags] == [("straggler_flagged", "n1")]
    f = flags[0]
    # ratios 2.0 from step 6: the median of the last 5 ratios reaches 2.0 at step 8, slow for 3 steps at 10
    assert (f.step, f.score, f.bar, f.busy_s, f.others_median_s, f.slow_steps, f.nodes) == (
        10, 2.0, 1.5, 2.0, 1.0, 3, 3,
    )  # fmt: skip
    assert state.flagged == ["n1"]


def test_every_node_slowing_down_alike_flags_nobody() -> None:
    steps = [healthy(3) for _ in range(5)] + [{n: 3.0 for n in healthy(3)} for _ in range(20)]
    _, flags = run(steps)
    assert flags == []


def test_one_slow_step_is_noise() -> None:
    steps = [healthy(3) for _ in range(5)] + [healthy(3) | {"n2": 10.0}] + [healthy(3) for _ in range(10)]
    _, flags = run(steps)
    assert flags == []


def test_hysteresis_keeps_a_flag_between_the_bars_and_clears_it_below() -> None:
    slow = [healthy(3) | {"n0": 2.0} for _ in range(10)]
    between = [healthy(3) | {"n0": 1.3} for _ in range(10)]
    fast = [healthy(3) for _ in range(10)]
    state, flags = run(slow + between)
    assert [f.event for f in flags] == ["straggler_flagged"] and state.flagged == ["n0"]
    state, flags = run(slow + between + fast)
    assert [f.event for f in flags] == ["straggler_flagged", "straggler_cleared"]
    assert flags[1].bar == 1.2 and flags[1].score < 1.2 and state.flagged == []


def test_slow_seconds_holds_a_flag_until_the_node_was_slow_that_long() -> None:
    cfg = StragglerConfig(
        threshold=1.5, clear_below=1.2, window=1, slow_steps=1, slow_seconds=5.0, warmup_reports=0
    )
    steps = [healthy(3) | {"n1": 2.0} for _ in range(10)]
    _, flags = run(steps, cfg, dt=1.0)
    assert [(f.node, f.step, f.slow_s) for f in flags] == [("n1", 6, 5.0)]


def test_a_slow_node_of_two_is_twice_the_other() -> None:
    _, flags = run([{"a": 1.0, "b": 2.0} for _ in range(10)])
    assert [(f.node, f.score) for f in flags] == [("b", 2.0)]


def test_a_node_alone_or_with_idle_peers_is_never_scored() -> None:
    assert run([{"a": 5.0} for _ in range(10)])[1] == []
    assert run([{"a": 5.0, "b": 0.0} for _ in range(10)])[0].score("a") is None


def test_a_node_that_left_is_forgotten_and_bad_figures_are_ignored() -> None:
    steps = [healthy(3) | {"n1": 2.0} for _ in range(10)]
    state, _ = run(steps)
    assert state.flagged == ["n1"]
    state, flags = observe(state, 11, {"n0": 1.0, "n2": 1.0, "n3": math.nan, "n4": -1.0}, 11.0, CFG)
    assert flags == [] and set(state.tracks) == {"n0", "n2"}


def test_detection_off_flags_nothing() -> None:
    steps = [healthy(3) | {"n1": 5.0} for _ in range(10)]
    assert run(steps, StragglerConfig(policy="off"))[1] == []


def test_the_worst_of_two_slow_nodes_comes_first() -> None:
    steps = [healthy(5) | {"n1": 2.0, "n3": 3.0} for _ in range(10)]
    state, flags = run(steps)
    assert [f.node for f in flags] == ["n3", "n1"] and state.flagged == ["n3", "n1"]


def test_a_node_slow_only_in_its_first_reports_is_not_flagged() -> None:
    # start-up: n1's first two reports are 4x the others' (its lazy initialisation, a neighbour's start probe)
    cfg = StragglerConfig(threshold=1.5, clear_below=1.2, window=3, slow_steps=1)
    steps = [healthy(3) | {"n1": 4.0} for _ in range(2)] + [healthy(3) for _ in range(20)]
    state, flags = run(steps, cfg)
    assert flags == [] and state.score("n1") == 1.0
    # without the warm-up the same reports flag it at its first full window
    _, flags = run([*steps[:2], healthy(3) | {"n1": 4.0}, *steps[2:]], replace(cfg, warmup_reports=0))
    assert [(f.event, f.node, f.step) for f in flags][:1] == [("straggler_flagged", "n1", 3)]


def test_a_node_warming_up_is_neither_scored_nor_part_of_the_others_median() -> None:
    cfg = StragglerConfig(threshold=1.5, clear_below=1.2, window=1, slow_steps=1, warmup_reports=2)
    state, _ = run([healthy(2) for _ in range(5)], cfg)
    # a third node joins with slow first steps: n0 and n1 keep comparing with each other alone
    state, flags = observe(state, 6, healthy(2) | {"n2": 10.0}, 6.0, cfg)
    assert flags == [] and state.score("n2") is None and state.tracks["n2"].seen == 1
    assert state.score("n0") == 1.0 and state.score("n1") == 1.0
    state, flags = observe(state, 7, healthy(2) | {"n2": 10.0}, 7.0, cfg)
    assert flags == [] and state.score("n2") is None
    # its third report is scored
    state, flags = observe(state, 8, healthy(2) | {"n2": 10.0}, 8.0, cfg)
    assert [(f.node, f.score) for f in flags] == [("n2", 10.0)]


def test_a_score_of_fewer_reports_than_the_window_does_not_count_towards_a_flag() -> None:
    cfg = StragglerConfig(threshold=1.5, clear_below=1.2, window=4, slow_steps=1, warmup_reports=0)
    state, flags = run([healthy(3) | {"n1": 3.0} for _ in range(3)], cfg)
    assert flags == [] and state.score("n1") == 3.0 and state.tracks["n1"].slow_since is None
    state, flags = observe(state, 4, healthy(3) | {"n1": 3.0}, 4.0, cfg)
    assert [(f.node, f.step) for f in flags] == [("n1", 4)]


def test_warmup_reports_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="warmup_reports"):
        StragglerConfig(warmup_reports=-1)
