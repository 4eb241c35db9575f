"""benchmarks/new_mesh.py runs end to end: one row per mesh, each with its first and steady step times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.unit.bench_scripts import BENCHMARKS


def test_new_mesh_reports_each_mesh_and_the_dropped_caches(tmp_path: Path) -> None:
    out = tmp_path / "new_mesh.json"
    command = [
        sys.executable,
        str(BENCHMARKS / "new_mesh.py"),
        "--meshes",
        "2",
        "--steps",
        "2",
        "--json",
        str(out),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert [r["mesh"] for r in doc["rows"]] == ["new mesh 0", "new mesh 1", "last mesh, caches dropped"]
    for r in doc["rows"]:
        assert r["first_s"] > 0 and r["steady_s"] > 0
        assert abs(r["extra_s"] - (r["first_s"] - r["steady_s"])) < 1e-9
    assert "costs" in run.stdout


def test_new_mesh_refuses_a_run_with_nothing_to_compare(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCHMARKS / "new_mesh.py"), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--steps >= 2" in run.stderr
