"""Training through real torchrun agents: world sizes 1, 2, 3 end with the same weights; worker crashes at a
fixed world size are redone from the memory tier and end bit-identical; the audit proves exactly-once."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from tests.helpers import made_once

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS = 24
JOB = f"""\
train:
  task: regression
  task_args: {{n_samples: 64}}
  steps: {STEPS}
  global_batch: 10
  micro_batch: 3
  seed: 5
  log_every: 100
checkpoint:
  every_steps: 10
  keep_last: 1
logging:
  level: warning
"""


def loopback_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env.update(extra)
    return env


def torchrun(
    reaper: Any, tmp: Path, name: str, nproc: int, *, max_restarts: int = 0, worker_args: tuple[str, ...] = ()
) -> Path:
    """Run the regression job with ``nproc`` workers under a standalone torchrun; returns its work dir."""
    work = tmp / name
    work.mkdir()
    (work / "job.yaml").write_text(JOB)
    cmd = [
        TORCHRUN,
        "--standalone",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        "--local-addr=127.0.0.1",
        "-m",
        "elastic_train.worker",
        "--config",
        str(work / "job.yaml"),
        "--checkpoint",
        str(work / "ck"),
        "--audit",
        str(work / "audit"),
        *worker_args,
    ]
    with open(work / "log.txt", "wb") as log:
        proc = reaper.popen(
            cmd,
            cwd=work,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=loopback_env(ELASTIC_TRAIN_EVENTS=str(work / "events.jsonl")),
        )
        try:
            code = proc.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"torchrun {name} did not finish; log tail:\n{(work / 'log.txt').read_text()[-3000:]}"
            )
    assert code == 0, f"torchrun {name} exited {code}; log tail:\n{(work / 'log.txt').read_text()[-3000:]}"
    return work


def final_weights(work: Path) -> dict[str, torch.Tensor]:
    """The model of the run's final durable checkpoint, read through the checkpoint manager."""
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager

    (run_dir,) = glob.glob(str(work / "ck" / "*"))
    mgr = CheckpointManager(
        CheckpointConfig(url=str(work / "ck"), memory=False),
        os.path.basename(run_dir),
        rank=0,
        world_size=1,
        local_rank=0,
    )
    restored = mgr.restore()
    mgr.close()
    assert restored is not None and restored.step == STEPS and restored.source == "durable"
    return restored.state["model"]


def assert_exactly_once(work: Path) -> Any:
    report = check_exactly_once(str(work / "audit"), steps=STEPS)
    assert report.ok, report.problems
    return report


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The fault-free runs at world sizes 1, 2 and 3 (shared by the tests below; run once a session)."""
    from tests.conftest import Reaper

    def run(tmp: Path) -> None:
        reaper = Reaper()
        try:  # three independent jobs (each torchrun --standalone picks its own port): side by side
            with ThreadPoolExecutor(3) as pool:
                for job in [pool.submit(torchrun, reaper, tmp, f"world{n}", n) for n in (1, 2, 3)]:
                    job.result()
        finally:
            reaper.reap()

    tmp = made_once(tmp_path_factory, "torchrun-fault-free", run)
    return {str(n): tmp / f"world{n}" for n in (1, 2, 3)}


def test_world_sizes_1_2_3_end_with_the_same_weights(runs: dict[str, Path]) -> None:
    reference = final_weights(runs["1"])
    for world in ("2", "3"):
        weights = final_weights(runs[world])
        for key, value in reference.items():
            rel = (weights[key] - value).norm() / value.norm()
            assert rel < 1e-5, f"world {world}: {key} differs by {rel:.2e} relative to world 1"
        report = assert_exactly_once(runs[world])
        assert set(report.world_sizes.values()) == {int(world)}


def test_events_of_a_fault_free_run(runs: dict[str, Path]) -> None:
    events = read_events(str(runs["2"] / "events.jsonl"))
    kinds = [e["event"] for e in events]
    assert kinds[0] == "started" and kinds[-1] == "done"
    steps = [e for e in events if e["event"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(e["world_size"] == 2 and e["samples_per_s"] > 0 for e in steps)
    losses = [e["loss"] for e in steps]
    assert sum(losses[-6:]) < sum(losses[:6])
    # a commit that completes while the final one is written is only visible as the final one
    committed = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert committed[-1] == STEPS and set(committed) <= {10, 20, STEPS}


@pytest.mark.long
def test_worker_crashes_at_fixed_world_size_are_bit_identical(
    runs: dict[str, Path], tmp_path: Path, reaper: Any
) -> None:
    # rank 1 dies before the optimizer step of step 7; after the restart rank 0 dies at step 15 (fault_task)
    crashes = ("--set", "train.task=tests.fault_task:build", "--set", "train.task_args.faults='1@7,0@15:1'")
    work = torchrun(reaper, tmp_path, "faults", 2, max_restarts=3, worker_args=crashes)
    reference = final_weights(runs["2"])
    weights = final_weights(work)
    for key, value in reference.items():
        assert torch.equal(weights[key], value), f"{key} differs after restarts"
    report = assert_exactly_once(work)
    # The surviving rank may or may not finish the crashing step's optimizer step (and snapshot it) before its
    # next collective fails: either way exactly one step is redone per crash, from the memory tier.
    resumed = [e for e in read_events(str(work / "events.jsonl")) if e["event"] == "resumed"]
    assert [(e["source"], e["round"]) for e in resumed] == [("memory", 1), ("memory", 2)]
    first, second = (e["from_step"] for e in resumed)
    assert first in (6, 7) and second in (14, 15)
    assert report.redone_steps == {first + 1: 2, second + 1: 2}
