"""examples/fsdp_train.py, an FSDP2 script using the elastic_train API, under real faults.

- ``elastic-train local --entry``: a kill -9 of a node and a join with ``--replicas 1``: both resharded from
  memory in-process, at most one step redone, exactly-once, each rank received exactly the bytes it lacked,
  final weights equal to a fault-free world-1 run (float64, 1e-5).
- plain ``torchrun --rdzv-backend=etcd3`` agents: a kill and a join, and a worker that dies in the middle of
  the join's reshard (its agent restarts it): the job converges, the same checks.
- a dead node whose shards had no other copy (no replica): one ``sharded_state_lost`` event, the lost
  shards from the durable checkpoint, exactly-once, the same final weights.
- DCP both ways at another world size: plain ``dcp.load`` of the fault-free run's checkpoint at world 2,
  and a checkpoint in torchtitan's layout written at world 2 resumed by the script at world 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.sharded.dcp import DcpReader
from elastic_train.checkpoint.sharded.export import model_tensors
from elastic_train.checkpoint.storage import open_storage
from elastic_train.train.events import read_events
from tests.helpers import (
    TorchrunAgents,
    assert_local_kill_and_join,
    assert_resumed_once_each,
    assert_same_weights,
    made_once,
    script_env,
)

pytestmark = pytest.mark.slow
pytest.importorskip("elastic_train.rendezvous.registry")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "fsdp_train.py"
SLOW_SCRIPT = ROOT / "tests" / "integration" / "slow_fsdp_train.py"
DCP_SCRIPTS = ROOT / "tests" / "integration" / "dcp_scripts.py"
EPOCHS = 4
STEPS = EPOCHS * 12  # 192 windows, 16 per step
ARGS = ["--float64", "--epochs", str(EPOCHS), "--checkpoint-every", "10"]

env = script_env


def sharded_weights(root: Path, run_id: str, step: int) -> dict[str, torch.Tensor]:
    """The model in the newest durable (DCP) checkpoint of ``run_id``, which must be ``step``."""
    storage = open_storage(str(root))
    newest = durable.newest_valid(storage, storage.join(storage.root, run_id))
    assert newest is not None and newest.step == step and newest.manifest is not None, newest
    return model_tensors(storage, newest.path, newest.manifest)


def log_events(logs: list[Path], name: str) -> list[dict[str, Any]]:
    """Every structured log line ``name`` in the given worker/agent logs."""
    out = []
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            i = line.find("{")
            if i >= 0 and f'"{name}"' in line:
                try:
                    record = json.loads(line[i:])
                except ValueError:
                    continue
                if record.get("event") == name:
                    out.append(record)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script, fault-free, as one plain process (a world of one); run once a session."""

    def run(ck: Path) -> None:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *ARGS, "--checkpoint", str(ck / "ck")],
            cwd=ck, env=env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]

    return made_once(tmp_path_factory, "fsdp-reference", run) / "ck"


def test_local_entry_kill_and_join_reshard_from_memory(tmp_path: Path, reference: Path) -> None:
    summary_path = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--kill-node", "1@step=15", "--add-node", "@step=30", "--workdir", str(tmp_path / "work"),
        "--audit", str(tmp_path / "audit"), "--summary", str(summary_path), "--timeout", "400",
        "--entry", str(SLOW_SCRIPT), "0.3", *ARGS, "--replicas", "1", "--checkpoint", str(tmp_path / "ck"),
    ]  # fmt: skip
    hold = tmp_path / "hold"  # at world 2 the job waits for the joiner before its last steps
    hold.write_text(f"2 {STEPS - 10}")
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env(HOLD=str(hold)), capture_output=True, text=True, timeout=500
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    summary = json.loads(summary_path.read_text())
    assert_local_kill_and_join(summary, STEPS)
    assert "exactly-once: OK" in proc.stdout
    # Each rank of each reshard received exactly the rows it lacked, and the joiner's world moved some.
    resharded = log_events(sorted((tmp_path / "work").glob("node-*.log")), "resharded")
    assert {(r["from_world"], r["to_world"]) for r in resharded} >= {(3, 2), (2, 3)}, resharded
    assert all(r["received"] == r["minimum"] and r["from_storage"] == 0 for r in resharded), resharded
    assert any(r["received"] > 0 for r in resharded if r["to_world"] == 3)
    weights = sharded_weights(tmp_path / "ck", summary["run_id"], STEPS)
    assert_same_weights(weights, sharded_weights(reference, "default", STEPS), torch.float64)


def test_plain_torchrun_kill_join_and_a_worker_dying_in_the_reshard(
    tmp_path: Path, etcd_server: Any, reaper: Any, reference: Path
) -> None:
    script = [str(SLOW_SCRIPT), "0.2", *ARGS, "--replicas", "1", "--checkpoint", str(tmp_path / "ck")]
    # Every worker of the first generation would die as rank 0 of the first reshard into a world of 3:
    # that is the join's, after the kill.
    variables = env(HOLD=str(tmp_path / "hold"), RESHARD_FAULT="3")
    job = TorchrunAgents(tmp_path, etcd_server.endpoint, reaper, "fsdp-train", script, variables)
    for _ in range(3):
        job.start()
    job.wait_step(3, 5)
    (tmp_path / "hold").write_text(f"2 {STEPS - 10}")
    job.kill(job.procs[2])
    shrunk = job.wait_step(2, 1)
    job.start()
    job.wait_step(3, shrunk["step"] + 1)
    (tmp_path / "hold").unlink()
    job.wait_all(job.procs[:2] + job.procs[3:], timeout=300)

    logs = sorted(tmp_path.glob("agent*.log"))
    assert any("reshard fault: rank 0 exits" in p.read_text(errors="replace") for p in logs), "no fault fired"
    assert_resumed_once_each(read_events(str(job.events)), STEPS, tmp_path / "audit")
    weights = sharded_weights(tmp_path / "ck", "fsdp-train", STEPS)
    assert_same_weights(weights, sharded_weights(reference, "default", STEPS), torch.float64)


def test_a_dead_node_whose_shards_had_no_copy_falls_back_to_durable(tmp_path: Path, reference: Path) -> None:
    summary_path = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "2", "--min-nodes", "1", "--max-nodes", "2",
        "--kill-node", "1@step=13", "--workdir", str(tmp_path / "work"),
        "--audit", str(tmp_path / "audit"), "--summary", str(summary_path), "--timeout", "300",
        "--entry", str(SLOW_SCRIPT), "0.1", *ARGS, "--checkpoint", str(tmp_path / "ck"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    summary = json.loads(summary_path.read_text())
    assert summary["succeeded"] and summary["exactly_once"]["ok"], summary["exactly_once"]
    (kill,) = summary["faults"]
    assert kill["source"] == "durable" and kill["resumed_world_size"] == 1, kill
    assert kill["resumed_from"] == 10 and kill["steps_redone"] is not None, kill
    lost = log_events(sorted((tmp_path / "work").glob("node-*.log")), "sharded_state_lost")
    assert len(lost) == 1 and lost[0]["restored_step"] == 10 and lost[0]["world_size"] == 2, lost
    weights = sharded_weights(tmp_path / "ck", summary["run_id"], STEPS)
    assert_same_weights(weights, sharded_weights(reference, "default", STEPS), torch.float64)


def torchrun_standalone(nproc: int, *args: str, cwd: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_dcp_both_ways_at_another_world_size(tmp_path: Path, reference: Path) -> None:
    # Ours (world 1) read by plain dcp.load at world 2: model, Adam moments and step counts.
    storage = open_storage(str(reference))
    newest = durable.newest_valid(storage, storage.join(storage.root, "default"))
    assert newest is not None
    torchrun_standalone(2, str(DCP_SCRIPTS), "load", newest.path, str(tmp_path / "loaded.pt"), cwd=tmp_path)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    ours = sharded_weights(reference, "default", STEPS)
    for name, value in ours.items():
        assert torch.equal(loaded[f"model.{name}"], value), name
    assert float(loaded["adam.step"]) == STEPS

    # torchtitan's layout written at world 2, resumed by the script at world 1: model and Adam state.
    torchrun_standalone(
        2, str(DCP_SCRIPTS), "save", str(tmp_path / "titan"), str(tmp_path / "titan.pt"), cwd=tmp_path
    )
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--float64", "--epochs", "0", "--resume-from", str(tmp_path / "titan"),
         "--checkpoint", str(tmp_path / "ck")],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = torch.load(tmp_path / "titan.pt", weights_only=True)
    resumed = sharded_weights(tmp_path / "ck", "default", 0)
    for name, value in resumed.items():
        assert torch.equal(value, theirs[f"model.{name}"]), name
    storage = open_storage(str(tmp_path / "ck"))
    final = durable.newest_valid(storage, storage.join(storage.root, "default"))
    assert final is not None and final.manifest is not None
    reader = DcpReader(storage, final.path)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        stored = reader.layout.tensors[f"optim.state.pos.{key}"]
        got = torch.empty(stored.shape, dtype=stored.dtype)
        reader.read(f"optim.state.pos.{key}", got)
        assert torch.equal(got, theirs[f"adam.{key}"]), key
    assert "resumed_from_foreign_dcp" in proc.stdout + proc.stderr
