"""examples/own_loop.py, a plain DDP script using the elastic_train API, run as its docs show it.

- ``python examples/own_loop.py``, as shipped, at a world of one; with ``--float64``, the fault-free reference
  of the runs below;
- ``elastic-train local ... --entry examples/own_loop.py`` (the docs' command, ``--epochs`` shrunk): a kill -9
  of a node and a join, each resumed from a surviving rank's memory with at most one step redone,
  exactly-once;
- plain ``torchrun --rdzv-backend=etcd3`` agents running ``examples/own_loop.py --float64``: a kill and a join
  resumed from memory, then every node killed and the job started again, resumed from its durable
  checkpoint; exactly-once over it all, and final weights equal to the reference within 1e-5.

The runs with faults keep the script and its command line as documented; the test environment adds the hold
gate of tests/instrument/sitecustomize.py, which keeps a group at a step until a fault has landed or a joining
node is in, however loaded the machine.
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
    assert_same_weights,
    final_weights,
    gated,
    made_once,
    script_env,
)

pytestmark = pytest.mark.slow
pytest.importorskip("elastic_train.rendezvous.registry")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "own_loop.py")
#: The same script with every step slowed down by a hook (tests/integration/test_standby_join.py).
SLOW_SCRIPT = ROOT / "tests" / "integration" / "slow_own_loop.py"
#: The reference's arguments, and its length: 4 epochs of 240 samples, 16 per step.
ARGS = ["--float64"]
STEPS = 60
#: ``--epochs`` of the local run (the docs' command trains 300, so that a node joining unaided is in before
#: the end; here the gate holds the shrunk group for it).
LOCAL_EPOCHS = 8


env = script_env


def run_example(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python examples/own_loop.py ARGS`` in ``cwd`` (a world of one)."""
    cmd = [sys.executable, SCRIPT, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """``python examples/own_loop.py --float64``, fault-free, at a world of one; run once a session."""
    made = made_once(tmp_path_factory, "own-loop-reference", lambda d: run_example(d, *ARGS))
    return final_weights(made / "checkpoints", "default", STEPS)


def test_a_world_of_one_as_shipped(tmp_path: Path) -> None:
    proc = run_example(tmp_path)  # python examples/own_loop.py
    assert f"step {STEPS} loss" in proc.stdout, proc.stdout
    weights = final_weights(tmp_path / "checkpoints", "default", STEPS)
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_local_entry_kill_and_join(tmp_path: Path) -> None:
    """The docs' ``elastic-train local`` command, as written but for ``--epochs``."""
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "4",
        "--kill-node", "1@step=30", "--add-node", "@step=60", "--summary", "run.json",
        "--entry", SCRIPT, "--epochs", str(LOCAL_EPOCHS),
    ]  # fmt: skip
    gate = tmp_path / "gate"
    gate.write_text("3 40\n2 76")  # the kill lands before step 40; at world 2 the job waits for the joiner
    variables = gated(env(), gate)
    proc = subprocess.run(cmd, cwd=tmp_path, env=variables, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    steps = LOCAL_EPOCHS * 15
    summary = json.loads((tmp_path / "run.json").read_text())
    assert_local_kill_and_join(summary, steps)
    sizes = [point["world_size"] for point in summary["world_size_timeline"]]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    assert "exactly-once: OK" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    final = final_weights(tmp_path / "checkpoints", summary["run_id"], steps)
    assert {t.dtype for t in final.values()} == {torch.float32}
    # torch imported once per node: each node's fork server is a fork of its agent, not a fresh interpreter
    # that imports torch again (a joiner's worker waits for the server's imports)
    logs = sorted((tmp_path / "runs" / summary["run_id"]).glob("node-*.log"))
    ready = [
        json.loads(line)
        for log in logs
        for line in log.read_text(errors="replace").splitlines()
        if line.startswith("{") and '"forkserver_ready"' in line
    ]
    assert len(logs) == 4 and len(ready) == 4 and all(r["torch_inherited"] for r in ready), ready


@pytest.mark.long
def test_plain_torchrun_agents_kill_join_then_every_node_lost(
    tmp_path: Path, etcd_server: Any, reaper: Any, reference: dict[str, torch.Tensor]
) -> None:
    """Each node: the docs' ``torchrun --nnodes=2:4 ... examples/own_loop.py --float64``."""
    gate = tmp_path / "gate"
    variables = gated(env(), gate)
    job = TorchrunAgents(
        tmp_path, etcd_server.endpoint, reaper, "job-42", [SCRIPT, *ARGS], variables, rdzv_conf=None
    )
    # the kill lands by step 31, world 2 waits for the joiner at 46, and world 3 at 51 for every node's loss
    gate.write_text("3 31\n2 46\n3 51")
    for _ in range(3):
        job.start("2:4")
    job.wait_step(3, 5)
    job.kill(job.procs[2])
    job.wait_step(2, 1)
    job.start("2:4")
    job.wait_step(3, 50)
    job.kill_all()  # every node lost: the memory tier is gone with them
    before = read_events(str(job.events))
    run = tmp_path / "checkpoints" / "job-42"
    newest = max(parse_step_dir(p.name) or 0 for p in run.glob("step-*") if (p / "manifest.json").exists())
    assert newest >= 40, f"no durable checkpoint of step 40 or 50 (every 10 steps) in {run}"
    gate.unlink()
    restarted = [job.start("2:4") for _ in range(2)]
    job.wait_all(restarted, timeout=180)

    events = read_events(str(job.events))
    resumed = [e for e in before if e["event"] == "resumed"]
    assert len(resumed) == 2 and all(e["source"] == "memory" for e in resumed), resumed
    assert [e["world_size"] for e in resumed] == [2, 3], resumed
    for e in resumed:  # at most one step redone: the group resumes from the newest step any rank reached
        last = max(s["step"] for s in before if s["event"] == "step" and s["round"] < e["round"])
        assert e["from_step"] >= last - 1, (e, last)
    after = [e for e in events[len(before) :] if e["event"] == "resumed"]
    assert [(e["source"], e["from_step"]) for e in after] == [("durable", newest)], after
    assert events[-1]["event"] == "done" and events[-1]["step"] == STEPS
    report = check_exactly_once(str(tmp_path / "audit"), steps=STEPS)
    assert report.ok, report.problems
    assert {3, 2} <= set(report.world_sizes.values())
    assert_same_weights(final_weights(tmp_path / "checkpoints", "job-42", STEPS), reference, torch.float64)


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
