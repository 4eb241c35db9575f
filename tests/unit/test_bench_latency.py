"""The recovery-vs-latency report: table, plot and leader-kill lines from rdzv_latency.py's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.unit.bench_scripts import load

MACHINE = {
    "cpu": "c", "cores": 2, "ram_gib": 8.0, "loadavg": [1.0, 1.0, 1.0], "torch": "2", "python": "3.11",
    "etcd": "3.5", "platform": "Linux",
}  # fmt: skip


def latency_doc(**over: Any) -> Any:
    """rdzv_latency.py's document, read through the report's schema."""
    base = {
        "benchmark": "rdzv_latency", "schema": 1, "command": "python benchmarks/rdzv_latency.py",
        "machine": MACHINE, "started": "2026-12-01 06:22:39 UTC", "complete": True,
        "settings": {"delays_ms": [0, 100], "repeats": 2, "leader_repeats": 2, "cap": 60.0, "nnodes": "2:4",
                     "step_interval": 0.1},
        "configs": [], "recovery": {}, "leader_kill": {"samples": []}, "seconds": 1.0, "loadavg_end": [1.0],
    }  # fmt: skip
    return load("report").schema.parse("rdzv_latency", json.dumps(base | over))


def doc() -> Any:
    def cell(*secs: float | None) -> dict:
        samples = [
            {"status": "ok", "seconds": s, "cap": 60.0} if s is not None else {"status": "timeout", "cap": 60}
            for s in secs
        ]
        return {"samples": samples}

    summarize = load("harness").summarize
    out = {
        "recovery": {
            "etcd3": {"0": cell(1.5, 2.5), "100": cell(3.0, 4.0)},
            "c10d-tuned": {"0": cell(10.0, None), "100": cell(None, None)},
        },
        "leader_kill": {
            "samples": [
                {"status": "ok", "seconds": 0.1, "cap": 60.0, "restarted": False, "worlds_after": [3]},
                {"status": "ok", "seconds": 2.0, "cap": 60.0, "restarted": True, "worlds_after": [3]},
            ]
        },
    }
    for per in out["recovery"].values():
        for c in per.values():
            c["summary"] = summarize(c["samples"])
    out["leader_kill"]["summary"] = summarize(out["leader_kill"]["samples"])
    d = latency_doc(**out)
    assert d.series()
    return d


def test_latency_table_plot_and_leader_kill(tmp_path: Path) -> None:
    report = load("report")
    d = doc()
    series = d.series()
    assert [x for x, _ in series["etcd3"]] == [0.0, 100.0]
    img = report.plot_latency(d, tmp_path)
    assert img is not None and img.stat().st_size > 1000
    text = "\n".join(report.render_latency(d, [img], tmp_path / "benchmarks.md"))
    assert "| backend | 0 ms | 100 ms |" in text
    assert "| etcd3 | 2 (1.5-2.5), 2/2 ok | 3.5 (3-4), 2/2 ok |" in text
    assert "| c10d-tuned | > 60 (10-> 60), 1/2 ok | > 60 (60-> 60), 0/2 ok |" in text
    assert "![recovery vs latency](latency-recovery.png)" in text
    assert "workers restarted in 1 of them" in text and "| 2 | ok | 2 | yes | [3] |" in text


def test_no_latency_results_no_section(tmp_path: Path) -> None:
    report = load("report")
    d = latency_doc(recovery={"etcd3": {"0": {"samples": []}}})
    assert d.series() == {}
    assert report.plot_latency(d, tmp_path) is None
