"""Helpers several test files share: the CLI as a user runs it, its one-line errors, digests, certificates."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

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


def worker_lines(out: Path) -> list[dict[str, Any]]:
    """The JSON lines tests/integration/rdzv_worker.py appended to ``out`` (rank 0, one per step)."""
    import json

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
