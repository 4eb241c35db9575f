"""3 → 2 → 3 nodes on real torchrun agents meeting through etcd3: a node killed mid-training, a node joining
later; the job ends with the weights of a world-1 run (within 1e-5) and the audit proves exactly-once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_train.config import load_job_config
from elastic_train.procs import kill_tree
from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from tests.helpers import assert_same_weights, final_weights, wait_for_step

pytestmark = pytest.mark.slow
pytest.importorskip("elastic_train.rendezvous.registry")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 60
JOB = """\
rendezvous:
  endpoint: "{endpoint}"
  run_id: train-elastic
  min_nodes: 2
  max_nodes: 3
  nproc_per_node: 1
  lease_ttl: 2.0
  settle: 1.0
train:
  task: tests.fault_task:build
  task_args: {{n_samples: 96, step_delay: 0.15, hold: "{hold}"}}
  steps: {steps}
  global_batch: 10
  micro_batch: 4
  seed: 2
  log_every: 1000
checkpoint:
  url: "{ckpt}"
  every_steps: 8
logging:
  level: warning
"""


def env(**extra: str) -> dict[str, str]:
    base = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"}
    base["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )  # fault_task
    return {**base, **extra}


class ElasticJob:
    def __init__(self, tmp: Path, endpoint: str, reaper: Any) -> None:
        self.tmp, self.reaper = tmp, reaper
        self.config = tmp / "job.yaml"
        self.hold = tmp / "hold"
        self.config.write_text(JOB.format(endpoint=endpoint, steps=STEPS, ckpt=tmp / "ck", hold=self.hold))
        self.events = tmp / "events.jsonl"
        self.agents: list[subprocess.Popen] = []

    def start_agent(self) -> subprocess.Popen:
        from elastic_train.launch.run import torchrun_argv

        cfg = load_job_config(str(self.config))
        argv = torchrun_argv(cfg, config_path=str(self.config), overrides={}, local_addr="127.0.0.1")
        argv += ["--audit", str(self.tmp / "audit")]
        log = open(self.tmp / f"agent{len(self.agents)}.log", "wb")  # noqa: SIM115 - lives with the process
        proc = self.reaper.popen(
            [sys.executable, "-m", "torch.distributed.run", *argv],
            cwd=self.tmp,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env(ELASTIC_TRAIN_EVENTS=str(self.events)),
        )
        self.agents.append(proc)
        return proc

    def wait_step(self, world: int, min_step: int, timeout: float = 120.0) -> dict[str, Any]:
        return wait_for_step(self.events, world, min_step, timeout, self.tmp)


@pytest.mark.long  # make test keeps the restart path's rendezvous (test_rendezvous_torchrun) and restore
def test_kill_and_join_keep_weights_and_exactly_once(tmp_path: Path, etcd_server: Any, reaper: Any) -> None:
    # world-1 reference: the same job in one plain process
    ref = tmp_path / "ref"
    ref.mkdir()
    job = ElasticJob(tmp_path, etcd_server.endpoint, reaper)
    # the restart path: its gate holds the world-2 workers inside a step until the joiner trains, which only
    # a restart (not a step boundary) gets past; the in-process path is test_hot_recovery.py's
    job.config.write_text(job.config.read_text().replace("  settle: 1.0\n", "  settle: 1.0\n  hot: false\n"))
    assert "hot: false" in job.config.read_text()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elastic_train.worker",
            "--config",
            str(job.config),
            "--checkpoint",
            str(ref),
            "--set",
            "train.task_args.step_delay=0",  # the reference need not be slow
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]

    for _ in range(3):
        job.start_agent()
    job.wait_step(3, 5)
    job.hold.write_text(f"2 {STEPS - 10}")  # at world 2 the job waits for the joiner before step 51
    kill_tree(job.agents[2].pid)  # the agent and its workers (in their own session)
    shrunk = job.wait_step(2, 1)
    job.start_agent()
    job.wait_step(3, shrunk["step"] + 1)
    job.hold.unlink()
    for agent in job.agents[:2] + job.agents[3:]:
        assert agent.wait(timeout=180) == 0, f"agent failed; logs in {tmp_path}"

    events = read_events(str(job.events))
    sizes = [e["world_size"] for e in events if e["event"] == "step"]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    assert events[-1]["event"] == "done" and events[-1]["step"] == STEPS
    report = check_exactly_once(str(tmp_path / "audit"), steps=STEPS)
    assert report.ok, report.problems
    assert {3, 2} <= set(report.world_sizes.values())

    reference = final_weights(ref, "train-elastic", STEPS)
    assert_same_weights(final_weights(tmp_path / "ck", "train-elastic", STEPS), reference)
    (tmp_path / "summary.json").write_text(json.dumps({"world_sizes": sizes}))
