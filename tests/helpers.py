"""Helpers several test files share: the CLI as a user runs it, its one-line errors, digests, certificates,
and the torchrun agents, environment and weight checks of the end-to-end training tests."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest

from elastic_train.procs import kill_tree, tree
from elastic_train.train.jsonl import parse_json_lines

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]

#: Environment of a CLI run: only errors logged, gloo on loopback, one thread per process.
QUIET = {"ELASTIC_TRAIN_LOG_LEVEL": "error", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}


def cli(
    *args: str, env: dict[str, str] | None = None, module: str = "elastic_train", cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` in a subprocess, as a user runs it (text output captured, no stdin)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=dict(os.environ, **QUIET, **(env or {})),
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
        cwd=cwd,
    )


def one_line(proc: subprocess.CompletedProcess) -> str:
    """The single line a failing command printed on stderr (and nothing else: no traceback, no log noise)."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0, proc
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path (to show that nothing changed)."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


needs_openssl = pytest.mark.skipif(
    not any(os.access(os.path.join(p, "openssl"), os.X_OK) for p in os.get_exec_path()),
    reason="openssl is needed to make test certificates",
)


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (key, certificate)."""
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", f"/CN={name}")  # fmt: skip
    return key, cert


def make_server_cert(d: Path, ca_key: Path, ca: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by ``ca``: (certificate, key)."""
    key, csr, cert, ext = (d / n for n in ("server.key", "server.csr", "server.pem", "san.ext"))
    ext.write_text("subjectAltName=IP:127.0.0.1\n")
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
            "-out", str(cert), "-days", "2", "-extfile", str(ext))  # fmt: skip
    return cert, key


def wait_for_step(events: Path, world: int, min_step: int, timeout: float, logs: Path) -> dict[str, Any]:
    """The newest ``step`` event in the events file at world size ``world`` and step >= ``min_step``."""
    from elastic_train.train.events import read_events

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if events.exists():
            for e in reversed(read_events(str(events))):
                if e["event"] == "step" and e["world_size"] == world and e["step"] >= min_step:
                    return e
        time.sleep(0.2)
    raise AssertionError(f"no step >= {min_step} at world {world}; logs in {logs}")


def log_records(source: Path | str | Iterable[Path], event: str | None = None) -> list[dict[str, Any]]:
    """The structured log records in ``source`` (a log file, several, or a log's text), in order: a JSON
    object on a line of its own, or after the prefix a launcher puts before a worker's line (torchrun's
    ``[rank0]:``). With ``event``: only the records of that event, or of the events it begins when it ends
    with ``*``. A line that is not a whole record (a torn one, a person's message) is skipped."""
    if isinstance(source, str):
        texts = [source]
    else:
        paths = [source] if isinstance(source, Path) else list(source)
        texts = [p.read_bytes().decode(errors="replace") for p in paths]
    prefix = event[:-1] if event is not None and event.endswith("*") else None
    needle = f'"{prefix if prefix is not None else event}' if event is not None else ""
    lines = [
        line[line.find("{") :]
        for text in texts
        for line in text.splitlines()
        if "{" in line and needle in line
    ]
    return [
        r
        for r in parse_json_lines(lines)
        if event is None
        or r.get("event") == event
        or (prefix is not None and str(r.get("event")).startswith(prefix))
    ]


def worker_lines(out: Path) -> list[dict[str, Any]]:
    """The JSON lines tests/integration/rdzv_worker.py appended to ``out`` (rank 0, one per step)."""
    if not out.exists():
        return []
    return [json.loads(x) for x in out.read_text().splitlines() if x.strip()]


def wait_world(out: Path, world: int, after_round: int, timeout: float) -> dict[str, Any]:
    """The newest rdzv_worker line (step >= 2) at world size ``world`` in a round after ``after_round``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in reversed(worker_lines(out)[-50:]):
            if line["world_size"] == world and line["round"] > after_round and line["step"] >= 2:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no training at world {world} after round {after_round}: {worker_lines(out)[-3:]}")


def made_once(factory: pytest.TempPathFactory, name: str, make: Callable[[Path], None]) -> Path:
    """A directory ``name`` that ``make`` fills once per test session, however many xdist workers ask.

    A fault-free reference run takes as long as a test: made once, it is shared by every worker instead of
    being run again by each worker that gets a test of the module. The first worker to ask runs ``make``
    under a file lock; the others wait for it and read the result. If ``make`` fails, its test fails and the
    next worker that asks tries again from an empty directory.
    """
    base = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's directory, above each worker's own
    target = base / name
    with open(base / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".made").exists():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
            make(target)
            (target / ".made").touch()
    return target


# -- end-to-end training runs (tests/integration/test_own_loop.py, test_lightning.py, …) --------------------


def script_env(extra: dict[str, str] | None = None, **more: str) -> dict[str, str]:
    """Environment for a training script or agent a test starts: gloo on loopback, one thread, unbuffered
    output, the repository importable (``tests.*`` stand-ins and tasks), and none of the per-run variables
    (events, audit, rank, preload) the test process may carry; ``extra`` and ``more`` go on top."""
    base = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("ELASTIC_TRAIN_EVENTS", "ELASTIC_TRAIN_AUDIT_DIR", "RANK", "ELASTIC_TRAIN_PRELOAD"):
        base.pop(key, None)
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**base, **(extra or {}), **more}


#: Environment variable of the hold gate in tests/instrument/sitecustomize.py.
HOLD_GATE = "ELASTIC_TRAIN_TEST_HOLD"


def gated(env: dict[str, str], gate: Path) -> dict[str, str]:
    """``env`` with the hold gate of tests/instrument/sitecustomize.py at ``gate`` (a file the test writes
    ``WORLD STEP`` to) in every Python process started with it: a documented command runs unchanged, and a
    group of ``WORLD`` waits before any step past ``STEP`` until it re-forms."""
    path = os.pathsep.join([str(ROOT / "tests" / "instrument"), env.get("PYTHONPATH", "")])
    return {**env, "PYTHONPATH": path, HOLD_GATE: str(gate)}


def final_weights(root: Path, run_id: str, step: int) -> dict[str, torch.Tensor]:
    """The model's tensors in the newest durable checkpoint of ``run_id`` under ``root``, which must be
    ``step``."""
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager

    mgr = CheckpointManager(
        CheckpointConfig(url=str(root), memory=False), run_id, rank=0, world_size=1, local_rank=0
    )
    restored = mgr.restore()
    mgr.close()
    assert restored is not None and restored.step == step, f"no step {step} in {root}/{run_id}"
    return dict(restored.state["model"])


def sharded_weights(root: Path, run_id: str, step: int) -> dict[str, torch.Tensor]:
    """The model in the newest durable (DCP) checkpoint of ``run_id`` under ``root`` (a sharded model's),
    which must be ``step``."""
    from elastic_train.checkpoint import durable
    from elastic_train.checkpoint.sharded.export import model_tensors
    from elastic_train.checkpoint.storage import open_storage

    storage = open_storage(str(root))
    newest = durable.newest_valid(storage, storage.join(storage.root, run_id))
    assert newest is not None and newest.step == step and newest.manifest is not None, newest
    return model_tensors(storage, newest.path, newest.manifest)


def assert_same_weights(
    weights: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], dtype: torch.dtype | None = None
) -> None:
    """Every tensor within 1e-5 (relative norm) of the fault-free world-1 run's, and of ``dtype`` if given."""
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        assert dtype is None or weights[key].dtype == dtype, (key, weights[key].dtype)
        rel = float((weights[key] - value).norm() / value.norm())
        assert rel < 1e-5, f"{key} differs by {rel:.2e} relative to the fault-free world-1 run"


def assert_resumed_once_each(
    events: list[dict[str, Any]], steps: int, audit: Path, min_faults: int = 1
) -> None:
    """The run recovered only from memory, redid at most one step per fault, finished ``steps`` and trained
    every sample exactly once at world sizes 3 and 2."""
    from elastic_train.train.audit import check_exactly_once

    resumed = [e for e in events if e["event"] == "resumed"]
    assert len(resumed) >= min_faults and all(e["source"] == "memory" for e in resumed), resumed
    for e in resumed:  # at most one step redone: the group resumes from the newest step any rank reached
        last = max(s["step"] for s in events if s["event"] == "step" and s["round"] < e["round"])
        assert e["from_step"] >= last - 1, (e, last)
    assert events[-1]["event"] == "done" and events[-1]["step"] == steps
    report = check_exactly_once(str(audit), steps=steps)
    assert report.ok, report.problems
    assert {3, 2} <= set(report.world_sizes.values())


def assert_local_kill_and_join(summary: dict[str, Any], steps: int) -> None:
    """``elastic-train local``'s summary of a run with one node killed and one added: it finished ``steps``
    exactly once, and each fault resumed from memory (at world 2, then 3) with at most one step redone."""
    assert summary["succeeded"] and summary["completed_steps"] == steps
    assert summary["exactly_once"]["ok"], summary["exactly_once"]["problems"]
    kill, join = summary["faults"]
    assert kill["kind"] == "kill-node" and kill["source"] == "memory" and kill["resumed_world_size"] == 2
    assert join["kind"] == "add-node" and join["source"] == "memory" and join["resumed_world_size"] == 3
    for fault in (kill, join):
        assert fault["steps_redone"] is not None and fault["steps_redone"] <= 1, fault


class TorchrunAgents:
    """Plain ``torchrun --rdzv-backend=etcd3`` agents running ``script`` (no fork server, no stand-in), one
    node each, logging events to ``tmp/events.jsonl`` and the sampler's audit to ``tmp/audit``.

    Args:
        tmp: the test's directory (agent logs, events, audit).
        endpoint: the etcd endpoint.
        reaper: the test's process reaper (every agent is killed at teardown).
        run_id: the rendezvous id.
        script: the training script and its arguments.
        env: the agents' environment (:func:`script_env`); events and audit are added.
        step_timeout: how long :meth:`wait_step` waits by default.
        rdzv_conf: torchrun's ``--rdzv-conf`` (``None``: the backend's defaults, as in a user's command).
    """

    def __init__(
        self,
        tmp: Path,
        endpoint: str,
        reaper: Any,
        run_id: str,
        script: list[str],
        env: dict[str, str],
        step_timeout: float = 240.0,
        rdzv_conf: str | None = "lease_ttl=2,settle=1",
    ) -> None:
        self.tmp, self.endpoint, self.reaper, self.run_id = tmp, endpoint, reaper, run_id
        self.script, self.step_timeout, self.rdzv_conf = script, step_timeout, rdzv_conf
        self.events = tmp / "events.jsonl"
        self.env = {
            **env,
            "ELASTIC_TRAIN_EVENTS": str(self.events),
            "ELASTIC_TRAIN_AUDIT_DIR": str(tmp / "audit"),
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, nodes: str = "2:3", **env: str) -> subprocess.Popen[bytes]:
        """One more node (``env``: variables for this one only)."""
        cmd = [
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc-per-node=1",
            "--rdzv-backend=etcd3", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}",
            *([f"--rdzv-conf={self.rdzv_conf}"] if self.rdzv_conf is not None else []),
            "--max-restarts=100", "--monitor-interval=0.1", "--local-addr=127.0.0.1", *self.script,
        ]  # fmt: skip
        log = open(self.tmp / f"agent{len(self.procs)}.log", "ab")  # noqa: SIM115 - lives with the process
        variables = {**self.env, **env}
        proc = self.reaper.popen(cmd, cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT, env=variables)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """kill -9 of a node: the agent and its workers (in their own sessions)."""
        kill_tree(proc.pid)
        proc.wait(timeout=30)

    def kill_all(self) -> None:
        """kill -9 of every node still running at once (a whole job's machines lost): each process of each
        node is signalled before any is waited for, so that no survivors re-form in between, as they do
        within a second of one node's kill."""
        running = [proc for proc in self.procs if proc.poll() is None]
        doomed = [p for proc in running for p in tree(proc.pid)]
        for p in doomed:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                p.kill()
        psutil.wait_procs(doomed, timeout=10)
        for proc in running:
            proc.wait(timeout=30)

    def wait_step(self, world: int, min_step: int, timeout: float | None = None) -> dict[str, Any]:
        return wait_for_step(self.events, world, min_step, timeout or self.step_timeout, self.tmp)

    def wait_all(self, procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
        """Each of ``procs`` exits 0 within ``timeout`` seconds."""
        for agent in procs:
            assert agent.wait(timeout=timeout) == 0, f"agent failed; logs in {self.tmp}"
