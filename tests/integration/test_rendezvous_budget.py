"""The failure budget of a long job on a real etcd, with in-process participants: a clean leave is not a
failure, and failures older than the window are forgotten."""

from __future__ import annotations

import json
import time

import pytest

from elastic_train.rendezvous.errors import FailureBudgetExhausted, NodeLeft
from elastic_train.rendezvous.leave import announce
from elastic_train.rendezvous.status import read_status
from tests.integration.test_rendezvous_protocol import join_all, make, wait_for


def test_a_clean_leave_spends_no_budget_and_is_counted_apart(etcd_server):
    ps = make(etcd_server.endpoint, 3, failure_budget=0, min_nodes=1)
    try:
        first = join_all(ps)
        leaver = next(p for p in ps if p.node_id == first[0].members[1])
        survivors = [p for p in ps if p is not leaver]
        assert announce(leaver, "SIGTERM")
        # the survivors see a member gone at once (not after its lease TTL) and re-form without it; their
        # agents take it for a lost member ("lost"), the close knows better
        assert wait_for(lambda: all(p.lost_members() == {leaver.node_id} for p in survivors), timeout=5)
        again = join_all(survivors)
        assert {r.world_size for r in again} == {2} and {r.round for r in again} == {2}
        st = read_status(survivors[0].etcd, "proto")
        assert (st.state, st.failures_used, st.leaves, st.failures_left) == ("running", 0, 1, 0)
        rec = json.loads(survivors[0].etcd.get(survivors[0].prefix + "round").value)
        assert rec["kind"] == "leave" and rec["failure"] is False
        assert survivors[0].etcd.get(survivors[0].prefix + "left/" + leaver.node_id) is None  # used up
        with pytest.raises(NodeLeft):
            leaver.join()
        # the budget still stops a real failure: both survivors' workers fail
        for p in survivors:
            p._waiting_cause = "failure"
        with pytest.raises(FailureBudgetExhausted, match="1 failures in 1h, budget 0"):
            join_all(survivors)
    finally:
        for p in ps:
            p.leave()


def test_failures_older_than_the_window_are_forgotten(etcd_server):
    ps = make(etcd_server.endpoint, 2, failure_budget=1, failure_window=2.0)
    try:
        join_all(ps)
        join_all(ps)  # the workers of both nodes failed: failure 1 of 1 in the window
        time.sleep(2.2)
        join_all(ps)  # failure 2, but the first left the window
        st = read_status(ps[0].etcd, "proto")
        assert (st.failures_used, st.failures_in_window, st.failures_left) == (2, 1, 0)
        with pytest.raises(FailureBudgetExhausted, match="2 failures in 2s, budget 1"):
            join_all(ps)  # failure 3 right after failure 2
        assert read_status(ps[0].etcd, "proto").state == "failed"
    finally:
        for p in ps:
            p.leave()
