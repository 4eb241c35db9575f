"""README's install path: the wheel of this checkout carries what a node needs, and a node installed from it
(no checkout) gets the example job.yaml and trains with the worker the README's torchrun line runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a copy of the checkout (a build writes build/ and *.egg-info by the source)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "elastic_train", src / "elastic_train", ignore=shutil.ignore_patterns("__pycache__")
    )
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (built,) = out.glob("elastic_train-*.whl")
    return built


def test_the_wheel_carries_the_example_config_and_the_entry_points(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert {"elastic_train/examples/job.yaml", "elastic_train/py.typed"} <= names
    assert "etcd3 = elastic_train.rendezvous.registry:etcd3" in entry_points
    assert "etcd3-dynamic = elastic_train.rendezvous.registry:etcd3_dynamic" in entry_points
    assert "elastic-train = elastic_train.cli.main:main" in entry_points


@pytest.mark.slow
def test_a_node_installed_from_the_wheel_trains_its_example_config(wheel: Path, tmp_path: Path) -> None:
    """What README's quickstart does on a node, from the installed wheel alone: write job.yaml with
    ``elastic-train example-config``, run ``elastic_train.worker --config job.yaml`` (a world of one here)."""
    target = tmp_path / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "-q",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    node = tmp_path / "node"
    node.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(target), ELASTIC_TRAIN_LOG_LEVEL="error", OMP_NUM_THREADS="1")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *args],
            cwd=node,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )

    where = run("-c", "import elastic_train; print(elastic_train.__file__)")
    assert where.stdout.startswith(str(target)), where  # the wheel's package, not the checkout's
    config = run("-m", "elastic_train.cli.main", "example-config")
    assert config.returncode == 0 and "task: charlm" in config.stdout, config
    (node / "job.yaml").write_text(config.stdout)
    trained = run("-m", "elastic_train.worker", "--config", "job.yaml", "--steps", "3")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (node / "checkpoints" / "demo").is_dir()
