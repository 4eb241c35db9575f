"""The etcd3 rendezvous protocol with in-process participants on a real etcd (3.5 and 3.4)."""

from __future__ import annotations

import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from elastic_train.etcd.client import connect
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import find_etcd_binary
from elastic_train.rendezvous.errors import FailureBudgetExhausted, RendezvousClosed
from elastic_train.rendezvous.protocol import Participant, ProtocolSettings, run_view
from elastic_train.rendezvous.status import read_status


def settings(**kw) -> ProtocolSettings:
    base = dict(run_id="proto", min_nodes=2, max_nodes=4, lease_ttl=2.0, settle=0.3, join_timeout=60.0)
    base.update(kw)
    return ProtocolSettings(**base)


def make(endpoint: str, n: int, **kw) -> list[Participant]:
    return [
        Participant(connect(endpoint), settings(**kw), addr="127.0.0.1", node_id=f"n{i}") for i in range(n)
    ]


def join_all(ps: list[Participant]):
    with ThreadPoolExecutor(len(ps)) as pool:
        return list(pool.map(lambda p: p.join(), ps))


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_round_forms_ranks_stay_and_a_lost_node_counts_one_failure(any_etcd):
    ps = make(any_etcd.endpoint, 3)
    try:
        results = join_all(ps)
        assert {r.round for r in results} == {1} and {r.world_size for r in results} == {3}
        order = results[0].members
        assert sorted(r.rank for r in results) == [0, 1, 2]
        assert all(p.num_waiting() == 0 for p in ps)

        # the middle-ranked node dies without a word: its lease is revoked as by expiry
        victim = next(p for p in ps if p.node_id == order[1])
        victim.leave()
        survivors = [p for p in ps if p is not victim]
        assert wait_for(lambda: all(p.num_waiting() > 0 for p in survivors))
        again = join_all(survivors)
        assert {r.round for r in again} == {2} and {r.world_size for r in again} == {2}
        assert again[0].members == [order[0], order[2]]  # survivors keep their relative order

        st = read_status(survivors[0].etcd, "proto")
        assert (st.round, st.world_size, st.failures_used, st.state) == (2, 2, 1, "running")
        assert [m.node for m in st.members] == [order[0], order[2]]

        # a newcomer makes the members restart; scale-up is not a failure, the newcomer is appended
        newcomer = make(any_etcd.endpoint, 1)[0]
        object.__setattr__(newcomer, "node_id", "late")
        ps.append(newcomer)
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(newcomer.join)
            assert wait_for(lambda: all(p.num_waiting() > 0 for p in survivors))
            third = join_all(survivors)
            assert fut.result(timeout=30).members == [order[0], order[2], "late"]
        assert {r.round for r in third} == {3}
        assert read_status(survivors[0].etcd, "proto").failures_used == 1
    finally:
        for p in ps:
            p.leave()


def test_a_member_whose_agent_is_gone_is_not_waited_for(etcd_server):
    """A member killed with its agent (store port closed) while its lease lives on: the survivors' round
    closes without it long before the settle window or the join window would let it."""
    import socket

    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]
    ps = [
        Participant(
            connect(etcd_server.endpoint),
            settings(settle=30.0, lease_ttl=30.0, join_window=30.0),
            addr="127.0.0.1",
            store_port=srv.getsockname()[1],
            node_id=f"n{i}",
        )
        for i, srv in enumerate(servers)
    ]
    try:
        ps[0].s.settle = ps[1].s.settle = ps[2].s.settle = 0.3  # the first round forms quickly
        first = join_all(ps)
        assert {r.world_size for r in first} == {3}
        for p in ps:
            p.s.settle = 30.0
        servers[2].close()  # n2's agent is gone; its lease (30 s) is not
        started = time.monotonic()
        again = join_all(ps[:2])
        assert {r.world_size for r in again} == {2}
        assert again[0].members == [m for m in first[0].members if m != "n2"]
        assert time.monotonic() - started < 15.0  # the settle and join windows are 30 s
    finally:
        for p in ps:
            p.leave()
        for srv in servers:
            srv.close()


def test_failure_budget_spent_stops_every_node(etcd_server):
    ps = make(etcd_server.endpoint, 2, failure_budget=0, min_nodes=2)
    try:
        join_all(ps)
        # both agents' workers failed: they re-join with reason "failure"
        with ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(p.join) for p in ps]
            for f in futs:
                with pytest.raises(FailureBudgetExhausted, match="failure budget exhausted"):
                    f.result(timeout=30)
        st = read_status(ps[0].etcd, "proto")
        assert st.state == "failed" and st.failures_used == 1 and "budget 0" in st.message
    finally:
        for p in ps:
            p.leave()


def test_closed_run_turns_late_nodes_away(etcd_server):
    ps = make(etcd_server.endpoint, 2)
    try:
        join_all(ps)
        ps[0].close("finished")
        late = make(etcd_server.endpoint, 1)[0]
        ps.append(late)
        with pytest.raises(RendezvousClosed):
            late.join()
        assert ps[1].num_waiting() == 0
        assert read_status(ps[1].etcd, "proto").state == "finished"
    finally:
        for p in ps:
            p.leave()


def test_close_outlasts_an_etcd_restart(etcd_server):
    """A job that finishes while etcd restarts still closes the run, so late nodes are turned away."""
    import threading

    ps = make(etcd_server.endpoint, 2)
    try:
        join_all(ps)
        etcd_server.kill()
        closer = threading.Thread(target=ps[0].close, kwargs={"reason": "finished", "patience": 30.0})
        closer.start()
        time.sleep(1.0)
        etcd_server.start()
        closer.join(timeout=40)
        assert not closer.is_alive()
        late = make(etcd_server.endpoint, 1)[0]
        ps.append(late)
        with pytest.raises(RendezvousClosed):
            late.join()
    finally:
        for p in ps:
            p.leave()


def test_unreachable_endpoint_fails_fast_with_one_line():
    t0 = time.monotonic()
    with pytest.raises(EtcdError, match="cannot reach etcd at 127.0.0.1:9") as info:
        connect("127.0.0.1:9", timeout=2.0)
    assert "\n" not in str(info.value)
    assert time.monotonic() - t0 < 10


def test_missing_ca_file_is_one_line(etcd_server, tmp_path):
    from elastic_train.etcd.config import TLSConfig

    with pytest.raises(EtcdError, match="ca_file .* cannot be read"):
        connect(etcd_server.endpoint, tls=TLSConfig(ca_file=str(tmp_path / "nope.pem")))


def test_auth_wrong_password_and_user_limited_to_run_prefix(etcd_server):
    ctl = find_etcd_binary("etcdctl")
    ep = etcd_server.endpoint

    def etcdctl(*args: str, user: str | None = None) -> None:
        cmd = [ctl, f"--endpoints={ep}", *([f"--user={user}"] if user else []), *args]
        subprocess.run(cmd, check=True, capture_output=True, timeout=30, env={"ETCDCTL_API": "3"})

    etcdctl("user", "add", "root", "--new-user-password=rootpw")
    etcdctl("role", "add", "job")
    etcdctl("role", "grant-permission", "job", "readwrite", "/elastic_train/secure/", "--prefix=true")
    etcdctl("user", "add", "trainer", "--new-user-password=s3cret-pw")
    etcdctl("user", "grant-role", "trainer", "job")
    etcdctl("auth", "enable", user="root:rootpw")

    t0 = time.monotonic()
    with pytest.raises(EtcdError, match="authentication failed") as info:
        connect(ep, user="trainer", password="Xq9-bad-pw")
    assert "Xq9-bad-pw" not in str(info.value) and time.monotonic() - t0 < 10
    with pytest.raises(EtcdError, match="requires authentication|not permitted|authentication"):
        connect(ep, probe_key="/elastic_train/secure/config")

    ps = [
        Participant(
            connect(ep, user="trainer", password="s3cret-pw", probe_key="/elastic_train/secure/config"),
            settings(run_id="secure"),
            addr="127.0.0.1",
        )
        for _ in range(2)
    ]
    try:
        assert {r.world_size for r in join_all(ps)} == {2}
        with pytest.raises(EtcdError, match="not permitted"):
            ps[0].etcd.put("/elastic_train/other/x", b"1")
    finally:
        for p in ps:
            p.leave()


def test_participants_sharing_one_view_form_rounds_and_see_a_loss(etcd_server):
    """Co-hosted participants (the scale benchmark's set-up) read one watch; the view stays up on leave."""
    etcd = connect(etcd_server.endpoint)
    view = run_view(etcd, "shared")
    view.start()
    ps = [
        Participant(etcd, settings(run_id="shared"), addr="127.0.0.1", node_id=f"s{i}", view=view)
        for i in range(3)
    ]
    try:
        first = join_all(ps)
        assert {r.world_size for r in first} == {3}
        with view.cond:
            assert set(view.under("nodes/")) == {"s0", "s1", "s2"}
            assert set(view.under("join/")) == {"s0", "s1", "s2"}
        ps[2].leave()
        assert wait_for(lambda: all(p.num_waiting() > 0 for p in ps[:2]))
        with view.cond:
            assert set(view.under("nodes/")) == {"s0", "s1"}
        again = join_all(ps[:2])
        assert {r.world_size for r in again} == {2} and {r.round for r in again} == {2}
    finally:
        for p in ps:
            p.leave()
        view.stop()
        etcd.close()


def _ident(**settings):
    from elastic_train.rendezvous.identity import JobIdentity

    return JobIdentity({"rendezvous.min_nodes": 1, "rendezvous.max_nodes": 2, **settings})


def test_identity_binds_live_runs_and_an_abandoned_run_is_taken_over(etcd_server, monkeypatch):
    from elastic_train.rendezvous import claim
    from elastic_train.rendezvous.errors import RunRefused

    monkeypatch.setattr(claim, "IDENTITY_FRESH", 0.0)
    a = make(etcd_server.endpoint, 1, min_nodes=1, identity=_ident(), identity_wait=1.0)[0]
    b = make(etcd_server.endpoint, 1, min_nodes=1, identity=_ident(**{"rendezvous.max_nodes": 3}),
             identity_wait=1.0)[0]  # fmt: skip
    object.__setattr__(b, "node_id", "intruder")
    try:
        assert a.join().world_size == 1
        t = time.monotonic()
        with pytest.raises(RunRefused, match="max_nodes=2; this node has rendezvous.max_nodes=3") as exc:
            b.join()
        assert exc.value.code == 2 and time.monotonic() - t >= 1.0 and b.refused
        kvs, _ = a.etcd.get_prefix("/elastic_train/proto/")
        assert not [kv.key for kv in kvs if "intruder" in kv.key]  # refused before writing anything
        assert a.num_waiting() == 0

        a.lease.stop(revoke=True)  # a stops past its lease: every member gone, the run did not finish
        c = make(etcd_server.endpoint, 1, min_nodes=1, identity=_ident(**{"rendezvous.max_nodes": 3}))[0]
        try:
            assert c.join().round == 2  # the new settings took the run over
            st = read_status(c.etcd, "proto")
            assert st.identity["rendezvous.max_nodes"] == 3 and st.state == "running"
            with pytest.raises(
                RunRefused, match=r"this node has rendezvous.max_nodes=2 \(the run was taken over\)"
            ):
                a.join()  # a comes back: it must not join the job that took over
            assert a.refused and c.num_waiting() == 0
        finally:
            c.leave()
    finally:
        a.leave()
        b.leave()


def test_a_run_whose_nodes_formed_a_round_and_are_gone_is_taken_over_at_once(etcd_server):
    """An identity recorded moments ago binds the run while its writer may still be starting (no lease yet);
    once a round closed after it, its nodes were past their start, and with none live the run is abandoned:
    a node with other settings takes it over without waiting for the identity to age."""
    from elastic_train.rendezvous import claim

    assert claim.IDENTITY_FRESH >= 10.0  # the default: the take-over below is well inside it
    a = make(etcd_server.endpoint, 1, min_nodes=1, identity=_ident(), identity_wait=1.0)[0]
    try:
        assert a.join().world_size == 1
        a.lease.stop(revoke=True)  # every member gone seconds after the identity was written
        c = make(etcd_server.endpoint, 1, min_nodes=1, identity=_ident(**{"rendezvous.max_nodes": 3}),
                 identity_wait=1.0)[0]  # fmt: skip
        try:
            t = time.monotonic()
            assert c.join().round == 2  # taken over, not refused after identity_wait
            assert time.monotonic() - t < 5.0
            assert read_status(c.etcd, "proto").identity["rendezvous.max_nodes"] == 3
        finally:
            c.leave()
    finally:
        a.leave()


def test_a_closed_runs_record_expires_so_the_name_can_be_used_again(etcd_server, monkeypatch):
    from elastic_train.rendezvous import closing

    monkeypatch.setattr(closing, "RUN_RECORD_TTL", 2)
    ps = make(etcd_server.endpoint, 1, min_nodes=1, identity=_ident())
    try:
        join_all(ps)
        ps[0].close("finished", step=12)
        st = read_status(ps[0].etcd, "proto")
        assert (st.state, st.finished_step) == ("finished", 12)
        ps[0].leave()
        assert wait_for(lambda: not read_status(ps[0].etcd, "proto").exists, timeout=15)
        again = make(etcd_server.endpoint, 1, min_nodes=1, identity=_ident(**{"train.steps": 5}))[0]
        ps.append(again)
        assert again.join().round == 1
    finally:
        for p in ps:
            p.leave()


def test_a_lease_lost_and_recreated_while_joining_is_the_one_the_round_holds(etcd_server):
    """A node whose lease etcd dropped while it waited for its round re-writes its join on the new lease;
    the round that closes after that holds the new lease, and the loss is behind it (its fence must not
    stop the workers it starts in that round). A loss after the round closed is not."""
    ps = make(etcd_server.endpoint, 2, lease_ttl=1.0)
    first, second = ps
    try:
        first.start()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(first.join)
            assert wait_for(lambda: first._join_value is not None)
            first.etcd.lease_revoke(first.lease.lease_id)  # as by expiry while cut off
            assert wait_for(lambda: first.lease.losses == 1 and first._keys_written[0] == 1)
            second.join()
            result = fut.result(timeout=30)
        assert result.world_size == 2
        assert first.losses_at_round == first.lease.losses == 1

        first.etcd.lease_revoke(first.lease.lease_id)  # lost after the round closed: ahead of it
        assert wait_for(lambda: first.lease.losses == 2)
        assert first.losses_at_round == 1
    finally:
        for p in ps:
            p.leave()
