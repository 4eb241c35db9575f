"""examples/own_loop.py, a plain DDP script using the elastic_train API, under real faults.

- ``elastic-train local --entry``: a kill -9 of a node and a join; exactly-once, at most one step redone per
  fault, recovery from a surviving rank's memory, and final weights equal to a fault-free world-1 run.
- plain ``torchrun --rdzv-backend=etcd3`` agents (no fork server, the script as torchrun's entry): a kill and
  a join, the same checks.
- every node killed, then started again: the job resumes from its durable checkpoint.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint.policy import parse_step_dir
from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from tests.helpers import (
    TorchrunAgents,
    assert_local_kill_and_join,
    assert_resumed_once_each,
    assert_same_weights,
    final_weights,
    made_once,
    script_env,
)

pytestmark = pytest.mark.slow
pytest.importorskip("elastic_train.rendezvous.registry")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "own_loop.py"
#: The same script with every step slowed down by a hook (so that faults land while it trains).
SLOW_SCRIPT = ROOT / "tests" / "integration" / "slow_own_loop.py"
EPOCHS = 6
STEPS = EPOCHS * 15  # 240 samples, 16 per step
ARGS = ["--float64", "--epochs", str(EPOCHS), "--workers", "1", "--checkpoint-every", "10"]


env = script_env


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same script, fault-free, as one plain process (no torchrun: a world of one); run once a session."""

    def run(ck: Path) -> None:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *ARGS, "--checkpoint", str(ck)],
            cwd=ck,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    return final_weights(made_once(tmp_path_factory, "own-loop-reference", run), "default", STEPS)


def test_local_entry_kill_and_join(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    summary_path = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--kill-node", "1@step=15", "--add-node", "@step=40", "--workdir", str(tmp_path / "work"),
        "--audit", str(tmp_path / "audit"), "--summary", str(summary_path), "--timeout", "400",
        "--entry", str(SLOW_SCRIPT), "0.3", *ARGS, "--checkpoint", str(tmp_path / "ck"),
    ]  # fmt: skip
    hold = tmp_path / "hold"  # at world 2 the job waits for the joiner before its last steps, however slow
    hold.write_text(f"2 {STEPS - 10}")  # the joiner's start-up on a loaded machine
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env(HOLD=str(hold)), capture_output=True, text=True, timeout=500
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    summary = json.loads(summary_path.read_text())
    assert_local_kill_and_join(summary, STEPS)
    sizes = [point["world_size"] for point in summary["world_size_timeline"]]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    assert "exactly-once: OK" in proc.stdout
    assert_same_weights(final_weights(tmp_path / "ck", summary["run_id"], STEPS), reference, torch.float64)


def agents(tmp: Path, endpoint: str, reaper: Any, run_id: str) -> TorchrunAgents:
    """Plain torchrun agents running the slowed script; ``tmp/hold`` is its file gate (slow_own_loop.py)."""
    script = [str(SLOW_SCRIPT), "0.2", *ARGS, "--checkpoint", str(tmp / "ck")]
    return TorchrunAgents(tmp, endpoint, reaper, run_id, script, env(HOLD=str(tmp / "hold")))


def test_plain_torchrun_agents_kill_and_join(
    tmp_path: Path, etcd_server: Any, reaper: Any, reference: dict[str, torch.Tensor]
) -> None:
    job = agents(tmp_path, etcd_server.endpoint, reaper, "own-loop")
    hold = tmp_path / "hold"
    for _ in range(3):
        job.start()
    job.wait_step(3, 5)
    hold.write_text(f"2 {STEPS - 10}")  # at world 2 the job waits for the joiner before its last steps
    job.kill(job.procs[2])
    shrunk = job.wait_step(2, 1)
    job.start()
    job.wait_step(3, shrunk["step"] + 1)
    hold.unlink()
    job.wait_all(job.procs[:2] + job.procs[3:], timeout=300)

    assert_resumed_once_each(read_events(str(job.events)), STEPS, tmp_path / "audit")
    assert_same_weights(final_weights(tmp_path / "ck", "own-loop", STEPS), reference, torch.float64)


def test_every_node_killed_then_restarted_resumes_from_durable(
    tmp_path: Path, etcd_server: Any, reaper: Any
) -> None:
    job = agents(tmp_path, etcd_server.endpoint, reaper, "own-loop-restart")
    for _ in range(2):
        job.start("2:2")
    job.wait_step(2, 14)
    for proc in list(job.procs):
        job.kill(proc)
    before = read_events(str(job.events))
    reached = max(e["step"] for e in before if e["event"] == "step")
    run = tmp_path / "ck" / "own-loop-restart"
    durable = sorted(p.name for p in run.glob("step-*") if (p / "manifest.json").exists())
    assert durable, "no durable checkpoint before the kill"
    newest = max(parse_step_dir(name) or 0 for name in durable)
    for _ in range(2):
        job.start("2:2")
    job.wait_all(job.procs[2:], timeout=300)

    after = read_events(str(job.events))[len(before) :]
    resumed = [e for e in after if e["event"] == "resumed"]
    assert resumed[0]["source"] == "durable" and newest <= resumed[0]["from_step"] <= reached, resumed
    assert after[-1]["event"] == "done" and after[-1]["step"] == STEPS
    report = check_exactly_once(str(tmp_path / "audit"), steps=STEPS)
    assert report.ok, report.problems


BAD_SCRIPT = """
import torch, elastic_train as et
et.init()
et.TrainState(model=torch.nn.Linear(2, 1), lookup={"a": 1})
"""


@pytest.mark.parametrize("with_server", [True, False])
def test_api_error_in_a_script_under_the_standin_is_one_line(
    tmp_path: Path, reaper: Any, with_server: bool
) -> None:
    """``run/local --entry`` start the script via a stand-in and (usually) a fork server: same one line."""
    from elastic_train.worker.forkserver import ENV_PID, ENV_SOCKET

    script = tmp_path / "train.py"
    script.write_text(BAD_SCRIPT)
    variables = env()
    if with_server:
        sock = str(tmp_path / "fs.sock")
        server = reaper.popen([sys.executable, "-m", "elastic_train.worker.forkserver", "--socket", sock])
        variables.update({ENV_SOCKET: sock, ENV_PID: str(server.pid)})
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train.worker.standin", str(script)],
        env=variables,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1
    assert "fork server unavailable" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "train.py: error: rank 0: lookup: a dict has no state_dict()/load_state_dict(), so it cannot be "
        "checkpointed (wrap it in an object that has both)"
    ), proc.stderr
