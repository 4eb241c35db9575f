"""The benchmark report: documents read through their schema, targets evaluated from the table (no benchmark
is run, except tiny stand-in scripts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.unit.bench_scripts import BENCHMARKS, load

harness = load("harness")
report = load("report")
schema = report.schema  # the module report.py reads through (benchmarks/ is on its path)
targets = report.target_table
COMMITTED = BENCHMARKS.parent / "docs" / "benchmarks"

MACHINE = {
    "cpu": "test cpu", "cores": 2, "ram_gib": 8.0, "loadavg": [0.5, 0.4, 0.3], "torch": "2.13.0",
    "python": "3.11.7", "etcd": "3.5.1", "platform": "Linux",
}  # fmt: skip


def parse(name: str, doc: dict[str, Any]) -> Any:
    return schema.parse(name, json.dumps(doc), f"{name}.json")


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
    """A whole rendezvous.py document with these seconds per scenario and configuration."""
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
        "nnodes": "2:4", "nproc_per_node": 1, "cap": 90.0, "hang_cap": 90.0, "step_interval": 0.1,
        "monitor_interval": 0.1, "max_restarts": 100, "jobs": ["scale", "kill"],
        "baseline_jobs": ["scale", "kill"], "slow_repeats": 1, "slow_configs": [],
    }  # fmt: skip
    return {
        "benchmark": "rendezvous", "schema": 1, "quick": True, "repeats": 1, "command": "rendezvous.py",
        "machine": MACHINE, "started": 1.0, "planned_jobs": 2, "settings": settings, "ours": "etcd3",
        "configs": [{"name": n, "backend": n} for n in names], "not_run": {}, "seconds": 9.0,
        "complete": True, "loadavg_end": [0.1, 0.2, 0.3], "scenarios": scen, "ratios": ratios,
        "timelines": {}, "runs": [],
    }  # fmt: skip


def ops(writes: int) -> dict[str, int]:
    return {"reads": 3, "writes": writes, "txns": 1, "leases": 1, "watch_events": 5}


def scale_rec(n: int, first: float, fail: float, writes: int, watch: str = "shared") -> dict[str, Any]:
    return {
        "n": n, "processes": 8, "watch": watch, "first_round_s": first, "first_round_ops": ops(writes),
        "probe_first_round_s": first, "detect_s": 0.01, "failure_round_s": fail,
        "failure_round_ops": ops(writes - 1), "probe_failure_round_s": fail,
        "client_cpu_ms_per_participant": {"first_round": 2.0, "failure_round": 2.34},
    }  # fmt: skip


def scale_doc(scale: list[dict[str, Any]], own: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    doc = {"benchmark": "rdzv_scale", "settle_s": 1.0, "processes": 8, "per_client": 8, "watch": "both"}
    return doc | {"bootstrap": [], "scale": scale, "scale_own": own or []}


def ckpt_size(size: float, stall: float = 1.2, raw: float = 0.9, dcp: float = 1.6) -> dict[str, Any]:
    secs = dict.fromkeys(report.STALL_SERIES, 0.1) | {"raw_write_s": 0.5, "raw_overwrite_s": 0.3}
    ratios = {
        "stall_over_shm_copy": stall, "stall_over_shm_copy_unpaired": stall,
        "memory_step_stall_over_shm_copy": 1.0, "durable_over_raw_write": raw,
        "durable_over_raw_overwrite": 0.5, "durable_over_dcp": dcp, "durable_over_torch_save": 2.0,
    }  # fmt: skip
    return {
        "size_mb": size, **secs, "et_durable_s": 0.4, "samples": {"et_stall_s": [0.1, 0.12]},
        "throughput_mb_s": {"raw_write": 100.0, "dcp": 55.0, "elastic_train": 90.0}, "ratios": ratios,
    }  # fmt: skip


def ckpt_doc(*sizes: dict[str, Any]) -> dict[str, Any]:
    return {"benchmark": "checkpoint", "torch": "2.13.0", "cpus": 2, "repeats": 3, "results": list(sizes)}


def overhead_doc(status: str = "met", figure: str = "17ms (1 MB): +2.00%") -> dict[str, Any]:
    target = {"name": "per-step overhead over plain DDP", "threshold": "<= 3%", "figure": figure}
    return {
        "benchmark": "overhead", "description": "overhead of the loop", "runs": [],
        "figures": [{"config": "17ms", "loop %": 2.0, "blocks": "8x20"}],
        "targets": [target | {"status": status, "why": ""}], "target_ratio": 1.03,
    }  # fmt: skip


def by_name(ts: list[Any]) -> dict[str, Any]:
    return {t.name: t for t in ts}


# ----------------------------------------------------------------------------------------------- schema


@pytest.mark.parametrize("name", report.BENCHMARKS)
def test_committed_documents_fit_their_schema(name: str) -> None:
    path = COMMITTED / f"{name}.json"
    doc = schema.parse(name, path.read_bytes(), str(path))
    assert doc.benchmark == name


@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (lambda d: d["scenarios"]["kill"]["results"]["etcd3"]["summary"].update(median="3.0"), "median"),
        (lambda d: d.update(extra_key=1), "extra_key"),
        (lambda d: d.pop("settings"), "settings"),
        (lambda d: d.update(benchmark="rdzv_scale"), "benchmark"),
    ],
)
def test_a_document_that_does_not_fit_is_refused_with_the_place(edit: Any, where: str) -> None:
    doc = rdzv_doc(launch={"etcd3": [2.0]}, kill={"etcd3": [3.0]}, scale={"etcd3": [3.0]})
    parse("rendezvous", doc)
    edit(doc)
    with pytest.raises(schema.SchemaError) as err:
        parse("rendezvous", doc)
    assert str(err.value).startswith("rendezvous.json: does not fit the rendezvous schema: ")
    assert where in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(schema.SchemaError, match="rendezvous.json: does not fit"):
        schema.parse("rendezvous", b"{not json", "rendezvous.json")


def test_figure_paths_read_ratios_summaries_and_every_element() -> None:
    doc = parse("rendezvous", rdzv_doc(launch={"etcd3": [2.0], "c10d": [None]}, kill={}, scale={}))
    (r,) = schema.read(doc, "ratios.launch.c10d")
    assert (r.label, r.value, r.at_least) == ("c10d", 45.0, True)  # censored at 90 s: 45x is a lower bound
    assert schema.read(doc, "ratios.launch.etcd-v2") == [schema.Reading("etcd-v2", None)]
    assert schema.read(doc, "own.launch")[0].value == 2.0
    assert schema.read(doc, "ratios.kill.c10d")[0].value is None
    ck = parse("checkpoint", ckpt_doc(ckpt_size(200, stall=2.0), ckpt_size(50)))
    got = schema.read(ck, "results.*.ratios.stall_over_shm_copy")
    assert [(x.label, x.value) for x in got] == [("200 MB", 2.0), ("50 MB", 1.2)]


# ---------------------------------------------------------------------------------- target evaluation

SPEC = targets.TargetSpec(
    "t", "checkpoint", "words", (targets.Bar("results.*.ratios.durable_over_dcp", ">", 1.0, "x"),), why="w",
    met="fine",
)  # fmt: skip


@pytest.mark.parametrize(
    ("dcps", "status", "why"),
    [
        ([1.5, 2.0], "met", "fine"),
        ([1.5, 1.0], "missed", "outside the bar: 200 MB 1.00x (bar > 1x)"),  # ">" is strict
        ([], "not measured", ""),
    ],
)
def test_generic_evaluation(dcps: list[float], status: str, why: str) -> None:
    doc = parse("checkpoint", ckpt_doc(*(ckpt_size(50 * 4**i, dcp=d) for i, d in enumerate(dcps))))
    t = targets.evaluate(SPEC, doc)
    assert (t.status, t.why) == (status, why)
    assert targets.evaluate(SPEC, None).why == "checkpoint benchmark not run"


def test_generic_evaluation_of_bounds() -> None:
    spec = targets.TargetSpec(
        "t", "rendezvous", "b", (targets.Bar("ratios.kill.etcd-v2", ">=", 10.0, "x"),), "w"
    )
    doc = parse("rendezvous", rdzv_doc(launch={}, kill={"etcd3": [12.0], "etcd-v2": [None]}, scale={}))
    t = targets.evaluate(spec, doc)  # 90/12 = 7.5x, only a lower bound: more time could show 10x
    assert t.status == "inconclusive" and "lower bound" in t.why and "a longer cap" in t.why
    spec = targets.TargetSpec("t", "rendezvous", "b", (targets.Bar("own.kill", "<=", 5.0, " s"),), "w")
    doc = parse("rendezvous", rdzv_doc(launch={}, kill={"etcd3": [None]}, scale={}))
    assert targets.evaluate(spec, doc).status == "missed"  # censored at 90 s: above a 5 s bar


def test_every_bar_of_the_table_reads_a_figure_of_a_full_run() -> None:
    for spec in targets.TARGETS:
        assert spec.benchmark in report.BENCHMARKS and spec.why
        path = COMMITTED / f"{spec.benchmark}.json"
        doc = schema.parse(spec.benchmark, path.read_bytes(), str(path))
        for bar in spec.bars:
            got = schema.read(doc, bar.figure)
            assert got and all(r.value is not None for r in got), (spec.name, bar.figure)


def test_rendezvous_targets_met() -> None:
    doc = rdzv_doc(
        launch={"etcd3": [2.0, 2.2, 2.1], "c10d": [37.0, 38.0, 40.0], "etcd-v2": [39.0, 41.0, 40.0]},
        kill={"etcd3": [3.0], "etcd-v2": [45.0, None, None], "c10d-tuned": [7.4]},
        scale={"etcd3": [4.0]},
    )
    launch, kill, scale = targets.evaluate_all({"rendezvous": parse("rendezvous", doc)})[:3]
    assert launch.status == "met" and launch.why == "every ratio at or above its bar", launch
    assert launch.figure.startswith("etcd3 2.10 s [2.00, 2.20] (3/3); c10d 38.00 s")
    assert kill.status == "met", kill  # etcd-v2 censored at 90 s: >= 30x lower bound
    assert "etcd-v2 did not get there within the cap: ratio is a lower bound" in kill.why
    assert scale.status == "met" and scale.why == "median within 5 s"


def test_rendezvous_targets_missed_and_not_measured() -> None:
    doc = rdzv_doc(
        launch={"etcd3": [12.0], "c10d": [37.0], "etcd-v2": [40.0]},
        kill={"etcd3": [12.0], "etcd-v2": [None], "c10d-tuned": [7.4]},
        scale={"etcd3": [None]},
    )
    launch, kill, scale = targets.evaluate_all({"rendezvous": parse("rendezvous", doc)})[:3]
    assert launch.status == "missed" and "outside the bar: c10d 3.08x (bar >= 4x)" in launch.why
    # 90/12 = 7.5x is only a lower bound (inconclusive) but slower than c10d-tuned is a plain miss
    assert kill.status == "missed" and "c10d-tuned 0.62x" in kill.why
    assert scale.status == "missed"
    doc = rdzv_doc(
        launch={"etcd3": [2.0], "c10d-tuned": [9.0]}, kill={"etcd3": [3.0]}, scale={"etcd3": [3.0]}
    )
    launch, kill, _ = targets.evaluate_all({"rendezvous": parse("rendezvous", doc)})[:3]
    assert launch.status == "not measured" and "no figure for c10d, etcd-v2" in launch.why
    assert kill.status == "not measured"
    assert all(t.status == "not measured" for t in targets.evaluate_all({}))


def test_scale_targets() -> None:
    doc = scale_doc([scale_rec(8, 1.1, 1.2, 20), scale_rec(256, 1.5, 3.2, 600)])
    t = by_name(targets.evaluate_all({"rdzv_scale": parse("rdzv_scale", doc)}))
    n256, writes = t["rendezvous alone at N=256 participants"], t["etcd writes per rendezvous round"]
    assert n256.status == "missed" and "3.20 s" in n256.why  # the slower (failure) round counts
    assert writes.status == "met" and writes.figure == "2.5 writes/participant at N=8, 2.3 at N=256"
    doc = scale_doc([scale_rec(8, 0.1, 0.1, 9), scale_rec(256, 1.1, 1.4, 256 * 256)])
    doc["scale_own"] = [scale_rec(256, 11.0, 11.5, 600, watch="own")]
    t = by_name(targets.evaluate_all({"rdzv_scale": parse("rdzv_scale", doc)}))
    n256, writes = t["rendezvous alone at N=256 participants"], t["etcd writes per rendezvous round"]
    assert n256.status == "met" and "probe participant" in n256.why and "11.50 s" in n256.why
    assert writes.status == "missed"
    assert "| 256 | 11 | 600 | 0.01 | 11.5 | 599 | 2.34 |" in "\n".join(
        report.render_scale(parse("rdzv_scale", doc))
    )
    doc = scale_doc(
        [
            scale_rec(8, 1.1, 1.2, 20),
            scale_rec(128, 1.3, 1.4, 300),
            {"n": 256, "watch": "shared", "error": "x"},
        ]
    )
    t = by_name(targets.evaluate_all({"rdzv_scale": parse("rdzv_scale", doc)}))
    n256 = t["rendezvous alone at N=256 participants"]
    assert n256.status == "not measured" and "N=128" in n256.figure


def test_checkpoint_targets() -> None:
    doc = parse("checkpoint", ckpt_doc(ckpt_size(50), ckpt_size(200, stall=2.0)))
    t = by_name(targets.evaluate_all({"checkpoint": doc}))
    stall, thr = t["checkpoint stall of the training loop"], t["durable checkpoint throughput"]
    assert (
        stall.status == "missed" and "200 MB" in stall.why and stall.figure == "50 MB: 1.20x, 200 MB: 2.00x"
    )
    assert thr.status == "met" and thr.figure.startswith("50 MB: 90% of raw, 1.60x DCP")
    doc = parse("checkpoint", ckpt_doc(ckpt_size(50, raw=0.7)))
    assert (
        by_name(targets.evaluate_all({"checkpoint": doc}))["durable checkpoint throughput"].status == "missed"
    )


def test_self_reported_targets_stand_for_their_rows() -> None:
    t = by_name(targets.evaluate_all({"overhead": parse("overhead", overhead_doc("missed"))}))
    assert t["per-step overhead over plain DDP"].status == "missed"
    t = by_name(targets.evaluate_all({}))
    assert t["per-step overhead over plain DDP"].why == "overhead benchmark not run"
    assert t["restore/broadcast vs state size / loopback bandwidth"].status == "not measured"


# ------------------------------------------------------------------------------------------- the report


def test_render_from_json_end_to_end(tmp_path: Path) -> None:
    doc = rdzv_doc(
        launch={"etcd3": [2.0], "c10d": [37.0], "etcd-v2": [40.0]},
        kill={"etcd3": [3.0], "etcd-v2": [45.0], "c10d-tuned": [7.4]},
        scale={"etcd3": [4.0]},
    )
    doc["timelines"] = {"kill": {"etcd3": [[-1.0, 3], [3.0, 2]], "c10d": []}}
    (tmp_path / "rendezvous.json").write_text(json.dumps(doc))
    (tmp_path / "checkpoint.json").write_text(json.dumps(ckpt_doc(ckpt_size(50))))
    (tmp_path / "rdzv_scale.json").write_text(json.dumps(scale_doc([scale_rec(256, 1.0, 1.1, 600)])))
    (tmp_path / "overhead.json").write_text(json.dumps(overhead_doc()))
    out = tmp_path / "docs" / "benchmarks.md"
    args = ["--from-json", str(tmp_path), "--out", str(out), "--img-dir", str(tmp_path / "img")]
    assert report.main(args) == 0
    text = out.read_text()
    assert "test cpu" in text
    assert "| per-step overhead over plain DDP | <= 3% | 17ms (1 MB): +2.00% | **met** |" in text
    assert "| 256 | 1 | 600 | 0.01 | 1.1 | 599 | 2.34 |" in text
    assert "| 50 | 1.2 | 0.9 | 1.6 | 0.5 |" in text
    assert "| config | loop % | blocks |" in text and "| 17ms | 2 | 8x20 |" in text
    assert (tmp_path / "img" / "checkpoint-stall.png").stat().st_size > 1000
    assert (tmp_path / "img" / "recovery-kill.png").stat().st_size > 1000
    assert json.loads((tmp_path / "targets.json").read_text())[0]["status"] == "met"


def test_a_document_that_does_not_fit_shows_as_failed(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "checkpoint.json").write_text(json.dumps({"results": [{"size_mb": 50}]}))
    out = tmp_path / "b.md"
    args = ["--from-json", str(tmp_path), "--out", str(out), "--img-dir", str(tmp_path / "img")]
    assert report.main(args) == 0
    text = out.read_text()
    assert "| checkpoint | not run (failed) | - | " in text and "does not fit the checkpoint schema" in text
    assert "| checkpoint stall of the training loop | <= 1.5x a plain shared-memory copy, every size | " \
        "not measured | not measured | checkpoint benchmark not run |" in text  # fmt: skip
    assert "checkpoint.json: does not fit the checkpoint schema" in capsys.readouterr().err


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
    assert rec.status == "ok" and "--quick" in rec.command
    assert "figure 1" in (out / "good.log").read_text()
    rec = report.run_benchmark("bad", out / "bad.json", quick=False, timeout=60, extra=[])
    assert rec.status == "failed" and rec.detail == "exit 3: boom: it broke"
    assert (
        report.run_benchmark("nope", out / "nope.json", quick=False, timeout=60, extra=[]).status == "absent"
    )
    rec = report.run_benchmark("slow", out / "slow.json", quick=False, timeout=0.5, extra=[])
    assert rec.status == "timeout" and rec.seconds < 20


def test_partial_rendezvous_run_is_flagged() -> None:
    doc = rdzv_doc(launch={"etcd3": [2.0]}, kill={"etcd3": [3.0]}, scale={"etcd3": [3.0]})
    doc.update(complete=False, planned_jobs=9, runs=[{}, {}])
    text = "\n".join(report.render_rendezvous(parse("rendezvous", doc), [], Path("docs/benchmarks.md")))
    assert "**Partial run**: 2 of 9 jobs" in text


def test_only_with_keep_others_reruns_one_and_shows_the_others_as_earlier(
    tmp_path: Path, monkeypatch: Any
) -> None:
    scripts, data = tmp_path / "scripts", tmp_path / "json"
    scripts.mkdir()
    data.mkdir()
    (scripts / "overhead.py").write_text(
        "import json, sys\n"
        f"json.dump({overhead_doc(figure='+1.00%')!r}, open(sys.argv[sys.argv.index('--json') + 1], 'w'))\n"
    )
    monkeypatch.setattr(report, "HERE", scripts)
    (data / "checkpoint.json").write_text(json.dumps(ckpt_doc(ckpt_size(50))))
    (data / "overhead.json").write_text(json.dumps(overhead_doc(figure="+5.00%")))  # earlier, replaced
    out = tmp_path / "benchmarks.md"
    args = ["--only", "overhead", "--keep-others", "--json-dir", str(data), "--out", str(out)]
    assert report.main([*args, "--img-dir", str(tmp_path / "img")]) == 0
    text = out.read_text()
    assert "| per-step overhead over plain DDP | <= 3% | +1.00% | **met** |" in text
    assert "| checkpoint | earlier run | - | not re-run:" in text and "not re-run by this command" in text
    assert "| 50 | 1.2 | 0.9 | 1.6 | 0.5 |" in text  # the checkpoint figures of the earlier run are shown
    assert "| rendezvous | not run |" in text  # no JSON of an earlier run: absent
    with pytest.raises(SystemExit):
        report.parse_args(["--keep-others"])


def test_overhead_runs_with_and_without_the_copy_floor() -> None:
    run = {
        "config": "17ms", "task": "charlm", "task_args": {}, "global_batch": 48, "world_size": 2,
        "state_mb": 1.3, "memory_every_steps": 1, "blocks": 2, "block_steps": 2, "plain_step_s": 0.03,
        "loop_step_s": 0.031, "allin_step_s": 0.034, "loop_ratio": 1.03, "allin_ratio": 1.12,
        "pair_ratios": {"loop": [1.03], "allin": [1.12]}, "block_times": {"plain": [0.03]},
    }  # fmt: skip
    doc = parse("overhead", overhead_doc() | {"runs": [run]})
    assert doc.runs[0].copy_floor_s is None
    doc = parse(
        "overhead", overhead_doc() | {"runs": [run | {"copy_floor_s": 0.004, "copy_floor_ratio": 1.1}]}
    )
    assert doc.runs[0].copy_floor_ratio == 1.1
    with pytest.raises(schema.SchemaError, match=r"runs\.0\.plain_step_s"):
        parse("overhead", overhead_doc() | {"runs": [run | {"plain_step_s": "fast"}]})
