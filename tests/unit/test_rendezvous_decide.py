"""Pure decisions of the etcd3 rendezvous: closing rule, rank order, failure accounting, waiting count."""

from __future__ import annotations

import pytest

from elastic_train.rendezvous.decide import (
    Joiner,
    assign_ranks,
    count_waiting,
    decide_close,
    ranks_before,
)


def j(node: str, target: int = 1, reason: str = "start", rev: int = 0) -> Joiner:
    return Joiner(node, target, reason, rev)


def close(joined, live, *, quiet=0.0, prev=True, lo=2, hi=4, settle=1.0):
    return decide_close(
        joined=joined,
        live=live,
        min_nodes=lo,
        max_nodes=hi,
        settle=settle,
        quiet_for=quiet,
        has_previous_round=prev,
    )


def test_closes_at_once_at_max_nodes():
    assert close(["a", "b", "c", "d"], ["a", "b", "c", "d", "e"]).close


def test_waits_below_min_nodes_however_quiet():
    d = close(["a"], ["a"], quiet=100.0)
    assert not d.close and d.why == "below_min_nodes"


def test_waits_for_settle_window_while_a_live_node_has_not_joined():
    assert not close(["a", "b"], ["a", "b", "c"], quiet=0.5).close
    assert close(["a", "b"], ["a", "b", "c"], quiet=1.0).close


def test_all_live_joined_closes_at_once_only_after_a_first_round():
    d = close(["a", "b"], ["a", "b"], quiet=0.0)
    assert d.close and d.why == "all_joined"
    # the first round of a job waits for the settle window: agents start with a spread
    first = close(["a", "b"], ["a", "b"], quiet=0.3, prev=False)
    assert not first.close and first.wait == pytest.approx(0.7)


def test_a_member_known_gone_is_not_waited_for():
    # c's lease is still alive but its agent refuses connections: the survivors close at once
    assert not close(["a", "b"], ["a", "b", "c"], quiet=0.0).close
    d = decide_close(
        joined=["a", "b"], live=["a", "b", "c"], min_nodes=2, max_nodes=4, settle=1.0,
        quiet_for=0.0, has_previous_round=True, gone=["c"],
    )  # fmt: skip
    assert d.close and d.why == "all_joined"


def test_join_window_counts_from_the_first_join_not_from_the_last_change():
    def window(since: float, quiet: float = 0.0, prev: bool = True):
        return decide_close(
            joined=["a", "b"], live=["a", "b", "c"], min_nodes=2, max_nodes=4, settle=1.0,
            quiet_for=quiet, has_previous_round=prev, join_window=0.3, since_first_join=since,
        )  # fmt: skip

    waiting = window(0.1)
    assert not waiting.close and waiting.wait == pytest.approx(0.2)
    assert window(0.3).close and window(0.3).why == "join_window"
    # the first round of a job waits for the settle window: agents start with a spread
    assert not window(5.0, quiet=0.5, prev=False).close


def test_survivors_keep_order_and_newcomers_follow_by_arrival():
    joiners = [j("new2", rev=9), j("c"), j("a"), j("new1", rev=5)]
    assert assign_ranks(["a", "b", "c"], joiners, 8) == ["a", "c", "new1", "new2"]


def test_rank_zero_stays_while_alive_and_max_nodes_prefers_survivors():
    joiners = [j("x", rev=1), j("b"), j("a")]
    assert assign_ranks(["a", "b"], joiners, 2) == ["a", "b"]
    assert assign_ranks(["a", "b"], [j("b"), j("x", rev=1)], 4) == ["b", "x"]


def test_ranks_before_agrees_with_the_order_assign_ranks_gives():
    previous = ["a", "b", "c"]
    joiners = [j("new2", rev=9), j("c"), j("a", rev=12), j("new1", rev=5), j("new0", rev=5)]
    order = assign_ranks(previous, joiners, 8)
    rank = {n: i for i, n in enumerate(previous)}
    by_id = {x.node_id: x for x in joiners}
    for x in order:
        for y in order:
            if x != y:
                assert ranks_before(rank, by_id[x], by_id[y]) == (order.index(x) < order.index(y))


def waiting(**kw):
    args = dict(my_round=3, latest_round=3, members=["a", "b"], live=["a", "b"], joins={}, max_nodes=4)
    args.update(kw)
    return count_waiting(**args)


def test_nothing_waiting_in_a_steady_round():
    assert waiting(joins={"a": j("a", target=3), "b": j("b", target=3)}) == 0


def test_lost_member_newcomer_and_rejoining_member_are_waiting():
    assert waiting(live=["a"]) == 1
    assert waiting(live=["a", "b", "n"], joins={"n": j("n", target=4)}) == 1
    assert waiting(joins={"b": j("b", target=4, reason="failure")}) == 1


def test_newcomer_ignored_at_max_nodes_and_before_first_round():
    assert waiting(max_nodes=2, live=["a", "b", "n"], joins={"n": j("n", target=4)}) == 0
    assert waiting(my_round=None, live=["a"]) == 0


def test_a_newer_round_without_us_means_restart():
    assert waiting(latest_round=4) == 1
