"""The benchmark report and the figures and targets each benchmark derives from its raw results (no benchmark
is run, except tiny stand-in scripts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.bench_scripts import BENCHMARKS, load

harness = load("harness")
report = load("report")
COMMITTED = BENCHMARKS.parent / "docs" / "benchmarks"

#: Per benchmark, what its section of the page must show: the columns (and cells) that carry its comparison
#: with the baselines measured in the same run.
MUST_SHOW = {
    "rendezvous": ["| scenario | `etcd3` |", "`c10d` |", "`etcd-v2` |", "`c10d-tuned` |", "etcd3 5.5x fast"],
    "rdzv_scale": ["| N | first round s |", "| writes/N |", "| etcd / TCPStore |"],
    "checkpoint": ["| stall / shm copy (<= 1.5) |", "| durable / raw write (>= 0.8) |", "| durable / DCP"],
    "overhead": ["| plain ms |", "| loop % |", "| all-in % |", "| snapshot Python ms |"],
    "recovery": ["| path |", "| restore / ideal |"],
    "rdzv_latency": ["| backend | 0 ms |", "| c10d-tuned |", "etcd3 8.0x faster", "| workers restarted |"],
    "lightning": ["| variant |", "| plain / elastic |"],
    "hot": ["| restart / hot |", "| torchft (probe) |"],
}  # fmt: skip


def block(samples: dict[str, list[float | None]], cap: float = 90.0) -> dict[str, Any]:
    """A rendezvous.py scenario block from seconds per config (None = timed out)."""
    results = {}
    for name, secs in samples.items():
        ss = [
            {"status": "ok", "seconds": s, "cap": cap, "detail": ""}
            if s is not None
            else {"status": "timeout", "seconds": None, "cap": cap, "detail": "node 2 stopped"}
            for s in secs
        ]
        results[name] = {"samples": ss, "summary": harness.summarize(ss), "phases": []}
    return {"title": "t", "results": results}


def rdzv_doc(launch: dict, kill: dict, scale: dict) -> dict[str, Any]:
    """A rendezvous.py document of raw results with these seconds per scenario and configuration."""
    scen = {"launch": block(launch), "kill": block(kill), "scale_up": block(scale)}
    ratios = {
        name: {
            c: harness.speedup(r["summary"], b["results"]["etcd3"]["summary"])
            for c, r in b["results"].items()
            if c != "etcd3"
        }
        for name, b in scen.items()
        if "etcd3" in b["results"]
    }
    names = sorted({c for b in scen.values() for c in b["results"]})
    settings = {
        "nnodes": "2:4", "cap": 90.0, "hang_cap": 90.0, "step_interval": 0.1, "monitor_interval": 0.1,
        "max_restarts": 100, "jobs": ["scale", "kill"], "baseline_jobs": ["scale", "kill"],
    }  # fmt: skip
    return {
        "benchmark": "rendezvous", "repeats": 1, "machine": {"cpu": "test cpu", "loadavg": [0.5]},
        "planned_jobs": 2, "settings": settings, "configs": [{"name": n, "description": n} for n in names],
        "not_run": {}, "complete": True, "loadavg_end": [0.1], "scenarios": scen, "ratios": ratios,
        "runs": [],
    }  # fmt: skip


def rdzv_targets(launch: dict, kill: dict, scale: dict) -> list[dict[str, Any]]:
    return load("rendezvous").summary(rdzv_doc(launch, kill, scale))["targets"]


def scale_rec(n: int, first: float, fail: float, writes: int, watch: str = "shared") -> dict[str, Any]:
    ops = {"reads": 3, "writes": writes, "txns": 1, "leases": 1, "watch_events": 5}
    return {
        "n": n, "processes": 8, "watch": watch, "first_round_s": first, "first_round_ops": ops,
        "probe_first_round_s": first, "detect_s": 0.01, "failure_round_s": fail,
        "failure_round_ops": ops | {"writes": writes - 1}, "probe_failure_round_s": fail,
        "client_cpu_ms_per_participant": {"first_round": 2.0, "failure_round": 2.34},
    }  # fmt: skip


def scale_targets(scale: list[dict[str, Any]], own: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    doc = {"benchmark": "rdzv_scale", "settle_s": 1.0, "processes": 8, "watch": "both", "bootstrap": []}
    done = load("rdzv_scale").summary(doc | {"scale": scale, "scale_own": own or []})
    return {t["name"]: t for t in done["targets"]}


def ckpt_size(size: float, stall: float = 1.2, raw: float = 0.9, dcp: float = 1.6) -> dict[str, Any]:
    secs = dict.fromkeys(load("checkpoint").SECONDS, 0.1)
    ratios = {"stall_over_shm_copy": stall, "durable_over_raw_write": raw, "durable_over_dcp": dcp}
    return {"size_mb": size, **secs, "ratios": ratios | {"durable_over_raw_overwrite": 0.5}}


def ckpt_targets(*sizes: dict[str, Any]) -> dict[str, Any]:
    doc = {"benchmark": "checkpoint", "torch": "2.13.0", "cpus": 2, "repeats": 3, "results": list(sizes)}
    return {t["name"]: t for t in load("checkpoint").summary(doc)["targets"]}


def doc_of(name: str, figure: str = "+2.00%", status: str = "met") -> dict[str, Any]:
    """The smallest document a benchmark may write: one figure row and one target."""
    return {
        "benchmark": name, "description": f"what {name} does", "figures": [{"config": "17ms", "loop %": 2.0}],
        "targets": [{"name": f"{name} target", "threshold": "<= 3%", "figure": figure, "status": status}],
    }  # fmt: skip


# ----------------------------------------------------------------------------------- the committed page


def test_every_committed_document_renders_its_comparison_with_the_baselines(tmp_path: Path) -> None:
    """The page made from the committed JSON has a section per benchmark with the columns that carry its
    ratios, and a target row for each target a benchmark reports."""
    out = tmp_path / "benchmarks.md"
    assert report.main(["--from-json", str(COMMITTED), "--out", str(out)]) == 0
    text = out.read_text()
    for name in report.BENCHMARKS:
        section = text.split(f"(`benchmarks/{name}.py`)", 1)[1].split("\n## ", 1)[0]
        for shown in MUST_SHOW[name]:
            assert shown in section, (name, shown)
        doc = json.loads((COMMITTED / f"{name}.json").read_text())
        for t in doc["targets"]:
            assert f"| {t['name']} | {t['threshold']} |" in text, t
    assert (
        "| checkpoint stall of the training loop | <= 1.5x a plain shared-memory copy, every size |" in text
    )
    assert "not run" not in text.split("## Benchmarks run", 1)[1].split("\n## ", 1)[0]


def test_the_raw_results_of_the_committed_runs_give_the_documents_they_hold() -> None:
    """A benchmark's summary of its own raw results is what its committed document shows (the documents were
    written by those very functions)."""
    for name in ("rendezvous", "rdzv_scale", "checkpoint", "rdzv_latency"):
        doc = json.loads((COMMITTED / f"{name}.json").read_text())
        again = load(name).summary(doc)
        assert (again["figures"], again.get("tables"), again["targets"]) == (
            doc["figures"],
            doc.get("tables"),
            doc["targets"],
        ), name


# ----------------------------------------------------------------------------------- documents refused


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda d: d.update(figures=[]), "no figures: the benchmark measured nothing"),
        (lambda d: d.pop("figures"), "no figures: the benchmark measured nothing"),
        (lambda d: d.update(benchmark="hot"), "not a document of the overhead benchmark"),
        (lambda d: d.update(targets=[{"figure": 1}]), "targets are not a list of named targets"),
        (lambda d: d.update(tables=[{"caption": "c", "rows": [1]}]), "tables[0]: rows are not a list"),
    ],
)
def test_a_document_that_measured_nothing_or_does_not_fit_shows_as_failed(
    tmp_path: Path, capsys: Any, edit: Any, why: str
) -> None:
    doc = doc_of("overhead")
    edit(doc)
    (tmp_path / "overhead.json").write_text(json.dumps(doc))
    out = tmp_path / "b.md"
    assert report.main(["--from-json", str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text()
    assert "| overhead | not run (failed) | - | " in text and why in text
    assert "(`benchmarks/overhead.py`)" not in text and "overhead target" not in text
    assert why in capsys.readouterr().err
    (tmp_path / "overhead.json").write_text("{not json")
    report.main(["--from-json", str(tmp_path), "--out", str(out)])
    assert "| overhead | not run (failed) |" in out.read_text()


# ------------------------------------------------------------------------------- targets of each benchmark


def test_rendezvous_targets_met() -> None:
    launch, kill, scale = rdzv_targets(
        launch={"etcd3": [2.0, 2.2, 2.1], "c10d": [37.0, 38.0, 40.0], "etcd-v2": [39.0, 41.0, 40.0]},
        kill={"etcd3": [3.0], "etcd-v2": [45.0, None, None], "c10d-tuned": [7.4]},
        scale={"etcd3": [4.0]},
    )
    assert launch["status"] == "met", launch
    assert launch["figure"].startswith("etcd3 2.10 s [2.00, 2.20] (3/3); c10d 38.00 s")
    assert kill["status"] == "met", kill  # etcd-v2 censored at 90 s: >= 30x lower bound
    assert "etcd-v2 did not get there within the cap: ratio is a lower bound" in kill["why"]
    assert scale["status"] == "met"


def test_rendezvous_targets_missed_inconclusive_and_not_measured() -> None:
    launch, kill, scale = rdzv_targets(
        launch={"etcd3": [12.0], "c10d": [37.0], "etcd-v2": [40.0]},
        kill={"etcd3": [12.0], "etcd-v2": [None], "c10d-tuned": [13.0]},
        scale={"etcd3": [None]},
    )
    assert launch["status"] == "missed" and "c10d 3.1x (bar 4x)" in launch["why"]
    assert kill["status"] == "inconclusive", kill  # 90/12 = 7.5x is only a lower bound; c10d-tuned slower
    assert scale["status"] == "missed"  # censored at 90 s: above a 5 s bar
    launch, kill, _ = rdzv_targets(launch={"etcd3": [2.0]}, kill={"etcd3": [3.0]}, scale={"etcd3": [3.0]})
    assert launch["status"] == "not measured" and "no figure for c10d" in launch["why"]
    _, kill, _ = rdzv_targets(launch={}, kill={}, scale={"etcd3": [3.0]})
    assert kill.get("status") is None and kill["why"] == "etcd3 kill not measured"


def test_scale_targets() -> None:
    t = scale_targets([scale_rec(8, 1.1, 1.2, 20), scale_rec(256, 1.5, 3.2, 600)])
    n256, writes = t["rendezvous alone at N=256 participants"], t["etcd writes per rendezvous round"]
    assert n256["status"] == "missed" and n256["figure"].startswith("3.20 s")  # the slower round counts
    assert writes["status"] == "met" and writes["figure"] == "2.5 writes/participant at N=8, 2.3 at N=256"
    own = [scale_rec(256, 11.0, 11.5, 600, watch="own")]
    t = scale_targets([scale_rec(8, 0.1, 0.1, 9), scale_rec(256, 1.1, 1.4, 256 * 256)], own)
    n256, writes = t["rendezvous alone at N=256 participants"], t["etcd writes per rendezvous round"]
    assert n256["status"] == "met" and "probe participant" in n256["why"] and "11.50 s" in n256["why"]
    assert writes["status"] == "missed"
    t = scale_targets([scale_rec(8, 1.1, 1.2, 20), {"n": 256, "watch": "shared", "error": "x"}])
    n256 = t["rendezvous alone at N=256 participants"]
    assert "status" not in n256 and n256["why"] == "no N=256 round in this run (quick mode?)"


def test_scale_targets_beyond_256_appear_for_the_sizes_a_run_tried() -> None:
    assert set(scale_targets([scale_rec(8, 0.1, 0.1, 9)])) == {
        "rendezvous alone at N=256 participants", "etcd writes per rendezvous round"
    }  # fmt: skip
    big = scale_rec(1024, 2.1, 3.4, 1030)
    projection = {"watch_mb_per_agent": 0.3, "agent_cpu_ms": 12.0, "machine_cpu_s": 5.25}
    for ops in (big["first_round_ops"], big["failure_round_ops"]):
        ops["requests"] = 1040
    big["projection"] = projection
    doc = {"benchmark": "rdzv_scale", "settle_s": 1.0, "processes": 8, "watch": "shared", "bootstrap": []}
    rounds = [scale_rec(8, 0.1, 0.1, 9), big, {"n": 4096, "watch": "shared", "error": "no answer"}]
    done = load("rdzv_scale").summary(doc | {"scale": rounds})
    row = done["figures"][1]
    assert (row["requests/N"], row["KB watched / agent"], row["machine CPU s"]) == (1040 / 1024, 300.0, 5.25)
    t = {x["name"]: x for x in done["targets"]}
    n1024, n4096 = t["rendezvous alone at N=1024 participants"], t["rendezvous alone at N=4096 participants"]
    assert (
        n1024["status"] == "missed" and n1024["figure"].startswith("3.40 s") and "5.25 CPU-s" in n1024["why"]
    )
    assert n4096["threshold"] == "<= 10 s per round (first and failure)"
    assert (n4096["status"], n4096["figure"], n4096["why"]) == ("missed", "did not finish", "no answer")


def test_checkpoint_targets() -> None:
    t = ckpt_targets(ckpt_size(50), ckpt_size(200, stall=2.0))
    stall, thr = t["checkpoint stall of the training loop"], t["durable checkpoint throughput"]
    assert stall["status"] == "missed" and stall["figure"] == "50 MB: 1.20x, 200 MB: 2.00x"
    assert thr["status"] == "met" and thr["figure"].startswith("50 MB: 90% of raw, 1.60x DCP")
    assert ckpt_targets(ckpt_size(50, raw=0.7))["durable checkpoint throughput"]["status"] == "missed"
    assert ckpt_targets(ckpt_size(50, dcp=0.9))["durable checkpoint throughput"]["status"] == "missed"


def test_partial_rendezvous_run_is_flagged() -> None:
    doc = rdzv_doc(launch={"etcd3": [2.0]}, kill={"etcd3": [3.0]}, scale={"etcd3": [3.0]})
    doc.update(complete=False, planned_jobs=9, runs=[{}, {}])
    assert "**Partial run**: 2 of 9 jobs" in load("rendezvous").summary(doc)["description"]


# ------------------------------------------------------------------------------------------- the report


def test_run_benchmark_ok_failed_absent_timeout(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(report, "HERE", tmp_path)
    (tmp_path / "good.py").write_text(
        "import json, sys\nprint('figure 1')\n"
        "json.dump({'x': 1}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    )
    (tmp_path / "bad.py").write_text("import sys\nprint('boom: it broke')\nsys.exit(3)\n")
    (tmp_path / "slow.py").write_text("import time\ntime.sleep(30)\n")
    out = tmp_path / "out"
    out.mkdir()
    rec = report.run_benchmark("good", out / "good.json", quick=True, timeout=60, extra=[])
    assert rec.status == "ok" and "--quick" in rec.command and rec.command.startswith("python ")
    assert "figure 1" in (out / "good.log").read_text()
    rec = report.run_benchmark("bad", out / "bad.json", quick=False, timeout=60, extra=[])
    assert rec.status == "failed" and rec.detail == "exit 3: boom: it broke"
    assert (
        report.run_benchmark("nope", out / "nope.json", quick=False, timeout=60, extra=[]).status == "absent"
    )
    rec = report.run_benchmark("slow", out / "slow.json", quick=False, timeout=0.5, extra=[])
    assert rec.status == "timeout" and rec.seconds < 20


def test_only_with_keep_others_reruns_one_keeps_the_others_and_the_hand_written_section(
    tmp_path: Path, monkeypatch: Any
) -> None:
    scripts, data = tmp_path / "scripts", tmp_path / "json"
    scripts.mkdir()
    data.mkdir()
    (scripts / "overhead.py").write_text(
        "import json, sys\n"
        f"json.dump({doc_of('overhead', '+1.00%')!r}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    )
    monkeypatch.setattr(report, "HERE", scripts)
    (data / "lightning.json").write_text(json.dumps(doc_of("lightning", "0.5 s")))
    (data / "overhead.json").write_text(json.dumps(doc_of("overhead", "+5.00%")))  # earlier, replaced
    out = tmp_path / "benchmarks.md"
    kept = f"\n{report.KEPT}\n\nwritten by hand | kept\n"
    out.write_text("# an older page\n" + kept)
    args = ["--only", "overhead", "--keep-others", "--json-dir", str(data), "--out", str(out)]
    assert report.main(args) == 0
    text = out.read_text()
    assert "| overhead target | <= 3% | +1.00% | **met** |" in text and "+5.00%" not in text
    assert "| lightning | earlier run | - | from " in text and "| lightning target | <= 3% | 0.5 s |" in text
    assert "| rendezvous | absent | - | " in text  # no JSON of an earlier run
    assert "an older page" not in text and text.endswith(kept) and text.count(report.KEPT) == 1
    with pytest.raises(SystemExit):
        report.parse_args(["--keep-others"])
