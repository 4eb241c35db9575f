"""The one JSON-lines reader and writer behind progress events and the data audit."""

from __future__ import annotations

from pathlib import Path

from elastic_train.train.jsonl import JsonLinesTail, JsonLinesWriter, parse_json_lines, read_json_lines


def test_tail_reads_only_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = JsonLinesTail(str(path))
    assert tail.poll() == []
    with open(path, "ab") as f:
        f.write(b'{"event": "step", "step": 1}\n{"event": "st')
    assert tail.poll() == [{"event": "step", "step": 1}]
    with open(path, "ab") as f:
        f.write(b'ep", "step": 2}\nnot json\n')
    assert tail.poll() == [{"event": "step", "step": 2}]
    assert tail.poll() == []


def test_read_leaves_out_a_torn_last_line_and_what_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "audit.jsonl"
    path.write_bytes(b'{"a": 1}\n[1, 2]\n\n{broken\n{"a": 2}\n{"a": 3, "torn')
    assert read_json_lines(str(path)) == [{"a": 1}, {"a": 2}]
    assert read_json_lines(str(tmp_path / "missing.jsonl")) == []


def test_writers_append_whole_lines(tmp_path: Path) -> None:
    path = str(tmp_path / "x.jsonl")
    first, second = JsonLinesWriter(path), JsonLinesWriter(path)
    for i in range(3):
        first.append({"w": 1, "i": i})
        second.append({"w": 2, "i": i, "text": "x" * 10_000})
    first.close()
    second.close()
    second.close()  # idempotent
    records = read_json_lines(path)
    assert [(r["w"], r["i"]) for r in records] == [(w, i) for i in range(3) for w in (1, 2)]


def test_parse_skips_blank_and_malformed_lines_and_non_objects() -> None:
    data = b'{"a": 1}\n\nnot json\n[1, 2]\n{"b": 2}\n'
    assert parse_json_lines(data.splitlines()) == [{"a": 1}, {"b": 2}]
    assert parse_json_lines(['{"a": 1}', "2026-12-01 [info] plain log line", '{"b": 2}']) == [
        {"a": 1},
        {"b": 2},
    ]
