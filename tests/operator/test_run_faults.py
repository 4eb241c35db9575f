"""Operator mistakes with run ids, through real etcd and real ``elastic-train run``/``status``/torchrun.

Each case checks what matters to the job already running: it finishes, none of its checkpoints becomes
invalid, and the mistaken command fails with one clear line (no traceback) and the documented exit code.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.storage import open_storage
from elastic_train.etcd.client import Etcd
from elastic_train.procs import signal_tree
from elastic_train.rendezvous.status import read_status
from tests.helpers import log_records

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
RDZV_WORKER = str(ROOT / "tests" / "integration" / "rdzv_worker.py")
#: How long a node with other settings waits for the live run to go away before it is refused.
IDENTITY_WAIT = 4.0
JOB = """\
rendezvous:
  lease_ttl: 2.0
  settle: 0.5
  identity_wait: {wait}
train:
  task: regression
  task_args: {{n_samples: 64}}
  steps: {steps}
  global_batch: 8
  seed: 3
  log_every: 1000
checkpoint:
  every_steps: 5
  memory: false
"""


def base_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # fault_task
    env.pop("ELASTIC_TRAIN_JOB_IDENTITY", None)
    return {**env, **extra}


def error_lines(stderr: str) -> list[str]:
    """Lines that are not structured log records (what a person reads)."""
    out = []
    for line in stderr.splitlines():
        if not line.strip():
            continue
        try:
            if isinstance(json.loads(line), dict):
                continue
        except ValueError:
            pass
        out.append(line)
    return out


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    return lines[0]


class Runs:
    """``elastic-train run`` nodes of one etcd, each with its own config and checkpoint root."""

    def __init__(self, tmp: Path, endpoint: str, reaper: Any) -> None:
        self.tmp, self.endpoint, self.reaper = tmp, endpoint, reaper
        self.n = 0

    def config(self, steps: int, wait: float = IDENTITY_WAIT) -> Path:
        path = self.tmp / f"job-{steps}-{wait:g}.yaml"
        path.write_text(JOB.format(steps=steps, wait=wait))
        return path

    def start(
        self,
        run_id: str,
        ckpt: Path,
        *,
        steps: int = 40,
        nodes: str = "1:1",
        delay: float = 0.0,
        log_level: str = "warning",
        extra: tuple[str, ...] = (),
    ) -> subprocess.Popen:
        self.n += 1
        # a delay slows every step (tests/fault_task.py); it is part of the job's settings, like the task
        slow = (
            ("--task", "tests.fault_task:build", "--set", f"train.task_args.step_delay={delay}")
            if delay
            else ()
        )
        cmd = [
            sys.executable, "-m", "elastic_train", "--log-level", log_level, "--log-format", "json",
            "run", str(self.config(steps)), "--endpoint", self.endpoint, "--run-id", run_id,
            "--checkpoint", str(ckpt), "--nodes", nodes, "--local-addr", "127.0.0.1", *slow, *extra,
        ]  # fmt: skip
        return self.reaper.popen(
            cmd, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=self.tmp
        )

    def status(self, run_id: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_train",
                "status",
                "--endpoint",
                self.endpoint,
                "--run-id",
                run_id,
            ],
            env=base_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )


def wait_for(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def training(etcd: Etcd, run_id: str, ckpt: Path, at_least_step: int = 0) -> bool:
    if read_status(etcd, run_id).state != "running":
        return False
    if at_least_step == 0:
        return True
    # committed ones only: a step directory without its manifest (written last) is a save under way, and
    # one the node is killed in is not a checkpoint
    storage = open_storage(str(ckpt))
    newest = durable.newest_valid(storage, storage.join(storage.root, run_id))
    return newest is not None and newest.step >= at_least_step


def verify(ckpt: Path, run_id: str) -> str:
    """``ckpt verify`` of every checkpoint of the run: all must be valid."""
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train", "ckpt", "verify", str(ckpt / run_id)],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize(
    ("other", "theirs", "ours"),
    [
        pytest.param({"ckpt": "b"}, "checkpoint.url={a}", "checkpoint.url={b}", id="other-checkpoint-url"),
        pytest.param(
            {"nodes": "1:2"},
            "rendezvous.max_nodes=1",
            "rendezvous.max_nodes=2",
            id="other-node-range",
            marks=pytest.mark.long,
        ),
    ],
)
def test_a_node_with_other_settings_waits_then_is_refused_and_the_job_never_notices(
    runs: Runs, etcd: Etcd, tmp_path: Path, other: dict[str, str], theirs: str, ours: str
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    job = runs.start("job-42", a, steps=300, delay=0.1)
    wait_for(lambda: training(etcd, "job-42", a, at_least_step=5), 120, "the job to train and checkpoint")
    t = time.monotonic()
    intruder = runs.start(
        "job-42", b if "ckpt" in other else a, nodes=other.get("nodes", "1:1"), steps=300, delay=0.1
    )
    _, err = intruder.communicate(timeout=120)
    waited = time.monotonic() - t
    assert intruder.returncode == 2, err
    line = one_line(err)
    expected = f"run job-42 is training with {theirs}; this node has {ours}".format(a=a, b=b)
    assert line == f"elastic-train: error: {expected}", line
    assert waited >= IDENTITY_WAIT
    assert any(e.get("event") == "run_identity_differs" for e in log_records(err)), err
    assert read_status(etcd, "job-42").state == "running"  # nothing of the intruder reached the run

    _, err = job.communicate(timeout=240)
    assert job.returncode == 0, err
    assert "Traceback" not in err
    st = read_status(etcd, "job-42")
    assert (st.state, st.finished_step, st.failures_used, st.round) == ("finished", 300, 0, 1)
    assert "step-00000300" in verify(a, "job-42")
    assert not (b / "job-42").exists()


def test_a_finished_run_is_not_reopened(runs: Runs, etcd: Etcd, tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    first = runs.start("done-1", ckpt, steps=6)
    _, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    status = runs.status("done-1")
    assert status.returncode == 0 and "run done-1: finished at step 6" in status.stdout, status
    before = verify(ckpt, "done-1")

    time.sleep(max(0.0, IDENTITY_WAIT - 1.0))  # past the window in which a late node of the job exits 0
    again = runs.start("done-1", ckpt, steps=6)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2, err
    line = one_line(err)
    assert line.startswith("elastic-train: error: run done-1 finished at step 6 on "), line
    assert f"--run-id NEW_ID --resume-from {ckpt}/done-1" in line, line
    assert verify(ckpt, "done-1") == before


def test_status_of_an_unknown_run(runs: Runs) -> None:
    proc = runs.status("does-not-exist")
    assert proc.returncode == 1 and proc.stdout == ""
    assert one_line(proc.stderr) == "elastic-train: error: no such run: does-not-exist (no key of it in etcd)"


def test_a_yaml_alias_bomb_is_refused_within_a_second(tmp_path: Path) -> None:
    bomb = tmp_path / "job.yaml"
    rows = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    rows += [f"{c}: &{c} [{','.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi", strict=True)]
    bomb.write_text("\n".join(rows) + "\n")
    assert bomb.stat().st_size < 400
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train", "run", str(bomb), "--dry-run"],
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert time.monotonic() - t < 10.0  # the interpreter's start-up included; the refusal itself is ~ms
    assert proc.returncode == 2
    assert "aliases expand to more than 100000 values" in one_line(proc.stderr)


@pytest.mark.long
def test_after_all_members_are_gone_a_new_node_range_takes_the_run_over(
    runs: Runs, etcd: Etcd, tmp_path: Path
) -> None:
    """docs/kubernetes.md's resize: delete the Job (its nodes die), apply it again with another node range."""
    ckpt = tmp_path / "ck"
    old = runs.start("resize-1", ckpt, steps=60, delay=0.15)
    wait_for(lambda: training(etcd, "resize-1", ckpt, at_least_step=10), 120, "a checkpoint at step 10")
    signal_tree(old.pid, signal.SIGKILL)  # the old Job's pods are gone without a word
    old.wait(timeout=30)
    wait_for(lambda: read_status(etcd, "resize-1").state == "stopped", 30, "the run to show no live node")
    assert "start it again to resume" in runs.status("resize-1").stdout
    new = runs.start("resize-1", ckpt, steps=60, nodes="1:2", delay=0.15, log_level="info")
    _, err = new.communicate(timeout=300)
    assert new.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    events = log_records(err)
    takeover = [e for e in events if e.get("event") == "run_taken_over"]
    assert takeover and "rendezvous.max_nodes=1" in takeover[0]["previous"], err[-3000:]
    resumed = [e for e in events if e.get("event") == "training_resumed"]
    assert resumed and resumed[0]["source"] == "durable" and resumed[0]["step"] >= 10, err[-3000:]
    st = read_status(etcd, "resize-1")
    assert (st.state, st.finished_step) == ("finished", 60)
    assert st.identity["rendezvous.max_nodes"] == 2
    assert "step-00000060" in verify(ckpt, "resize-1")


def test_a_non_retryable_worker_error_ends_the_job_without_spending_the_budget(
    runs: Runs, etcd: Etcd, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ck"
    proc = runs.start("bad-args", ckpt, steps=6, extra=("--set", "train.task_args={no_such_arg: 1}"))
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    lines = [ln for ln in error_lines(err) if ln.startswith("elastic-train")]
    assert len(lines) == 1, err
    assert lines[0].startswith("elastic-train: error: run bad-args failed: train.task_args: regression"), err
    st = read_status(etcd, "bad-args")
    assert (st.state, st.failures_used) == ("failed", 0), st
    assert "no_such_arg" in st.message
    status = runs.status("bad-args")
    assert "to continue: start a new run with --run-id NEW_ID --resume-from" in status.stdout

    again = runs.start("bad-args", ckpt, steps=6)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2
    line = one_line(err)
    assert line.startswith("elastic-train: error: run bad-args failed: train.task_args"), line
    assert f"--run-id NEW_ID --resume-from {ckpt}/bad-args" in line


def torchrun(endpoint: str, run_id: str, nnodes: str, nproc: int, out: Path, reaper: Any) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=etcd3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf=lease_ttl=2,settle=0.5,identity_wait={IDENTITY_WAIT:g}", "--local-addr=127.0.0.1",
        "--monitor-interval=0.1", "--max-restarts=3", RDZV_WORKER,
    ]  # fmt: skip
    env = base_env(MASTER_ADDR="127.0.0.1", RDZV_WORKER_OUT=str(out), RDZV_WORKER_STEPS="400")
    return reaper.popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


@pytest.mark.parametrize(
    ("nnodes", "nproc", "diff"),
    [("1:3", 1, "rendezvous.max_nodes=2; this node has rendezvous.max_nodes=3"),
     ("1:2", 2, "rendezvous.nproc_per_node=1; this node has rendezvous.nproc_per_node=2")],
    ids=["nnodes", "nproc-per-node"],
)  # fmt: skip
def test_plain_torchrun_nodes_are_protected_too(
    etcd_server: Any, etcd: Etcd, reaper: Any, tmp_path: Path, nnodes: str, nproc: int, diff: str
) -> None:
    out = tmp_path / "steps.jsonl"
    job = torchrun(etcd_server.endpoint, "tr-42", "1:2", 1, out, reaper)
    wait_for(lambda: read_status(etcd, "tr-42").state == "running", 120, "the torchrun job to train")
    intruder = torchrun(etcd_server.endpoint, "tr-42", nnodes, nproc, tmp_path / "other.jsonl", reaper)
    _, err = intruder.communicate(timeout=120)
    assert intruder.returncode == 2, err
    assert "Traceback" not in err
    assert f"elastic-train: error: run tr-42 is training with {diff}" in err, err
    st = read_status(etcd, "tr-42")
    assert (st.state, st.round, st.failures_used) == ("running", 1, 0)
    assert job.poll() is None
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=60)


def local(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "elastic_train", "local", "--nodes", "1", "--task", "regression",
        "--set", "train.task_args={n_samples: 64}", "--set", "train.global_batch=8", "--timeout", "240",
        *args,
    ]  # fmt: skip
    return subprocess.run(cmd, env=base_env(), capture_output=True, text=True, timeout=300, cwd=tmp)


def test_local_names_why_the_job_failed(tmp_path: Path) -> None:
    proc = local(tmp_path, "--steps", "6", "--set", "train.task_args={no_such_arg: 1}", "--run-id", "loc-bad")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith(
        "elastic-train: error: run loc-bad failed: train.task_args: regression rejected"
    ), line


def test_local_resume_from_another_run_checks_exactly_once_for_its_own_steps(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    first = local(tmp_path, "--steps", "10", "--checkpoint", str(ckpt), "--checkpoint-every", "5",
                  "--run-id", "first")  # fmt: skip
    assert first.returncode == 0, first.stdout + first.stderr
    second = local(tmp_path, "--steps", "20", "--checkpoint", str(ckpt), "--run-id", "second",
                   "--resume-from", str(ckpt / "first"))  # fmt: skip
    assert second.returncode == 0, second.stdout + second.stderr
    assert "exactly-once: OK (steps 11..20," in second.stdout, second.stdout
