"""A run's records read back from etcd: each decodes with its fields checked, and one that does not is no
record (a join) or an error of the run (the round record)."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

from elastic_train.rendezvous.probe import probe, probe_node
from elastic_train.rendezvous.records import RoundRecord, decode_join, finished_line


def kv(value: object, revision: int = 7) -> SimpleNamespace:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return SimpleNamespace(value=raw, create_revision=revision, mod_revision=revision)


def test_a_round_record_survives_etcd() -> None:
    rec = RoundRecord(3, ["a", "b"], {"a": {"addr": "h", "store_port": 5}}, failure=True)
    assert RoundRecord.decode(rec.encode()) == rec


@pytest.mark.parametrize(
    "raw",
    [b"[1, 2", b"[]", b'{"round": "3", "members": []}', b'{"round": -1, "members": []}',
     b'{"round": 3, "members": "ab"}', b'{"round": 3, "members": [1]}',
     b'{"round": 3, "members": ["a"], "nodes": {"a": 5}}'],
)  # fmt: skip
def test_a_malformed_round_record_is_refused(raw: bytes) -> None:
    with pytest.raises(ValueError):
        RoundRecord.decode(raw)


def test_a_join_key_decodes_with_its_failure_report_checked() -> None:
    j = decode_join("n1", kv({"target": 4, "reason": "failure", "exit_code": 2, "error": "x", "trained": True,
                             "ran_s": 1.5}))  # fmt: skip
    assert (j.node_id, j.target, j.reason, j.revision, j.exit_code, j.error, j.trained, j.ran_s) == (
        "n1", 4, "failure", 7, 2, "x", True, 1.5
    )  # fmt: skip
    odd = decode_join("n1", kv({"target": 4, "exit_code": True, "trained": "yes", "ran_s": float("inf")}))
    assert odd is not None and (odd.exit_code, odd.trained, odd.ran_s, odd.reason) == (
        None,
        False,
        0.0,
        "start",
    )
    for bad in ({"target": "4"}, {"target": -1}, [4], b"\xff"):
        assert decode_join("n1", kv(bad)) is None


def test_a_finished_runs_line_says_where_and_when_it_ended() -> None:
    line = finished_line("job-42", {"step": 4000, "time": 1796107200})
    assert (
        line == "run job-42 finished at step 4000 on 2026-12-01 06:40 UTC; this node has nothing left to do"
    )
    assert (
        finished_line("r", {"step": True, "time": "soon"})
        == "run r finished; this node has nothing left to do"
    )


def test_a_probe_tells_a_refused_port_from_an_open_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert probe("127.0.0.1", port) == "refused"  # bound, not listening
        s.listen(1)
        assert probe("127.0.0.1", port) == "accepted"
    assert probe("127.0.0.1", 0) == "unknown"
    assert probe_node({"addr": None, "store_port": 5}) == "unknown"
    assert probe_node({"addr": "127.0.0.1", "store_port": "5"}) == "unknown"
    assert probe_node(None) == "unknown"
