"""Run a documented command as a reader would, in a sandbox of its own, and clean up all it started.

The test's steps run inside new network, mount and PID namespaces (``unshare``; unprivileged through a user
namespace where that is allowed):

- the network holds only loopback, so a port a doc names (``elastic-train etcd --port 2379``) never collides
  with another test, and ``/etc/hosts`` maps the host names a doc uses (``etcd``) to 127.0.0.1;
- the checkout is mounted read-only, so a command that would write into it fails instead;
- ``/dev/shm`` is a tmpfs of the sandbox and ``TMPDIR`` a directory of the test, so the snapshot files and
  scratch directories of the sandbox's processes (named by their PIDs, which only mean something inside)
  are never swept by a process outside, nor theirs by one inside;
- this module runs as the PID namespace's first process: when it returns, the kernel kills whatever the
  commands left running (a ``&`` etcd, a node still waiting), after it sent them SIGTERM and waited.

The working directory is a scratch directory with a link to each top-level entry of the checkout, so
``examples/job.yaml`` resolves as in a checkout and what a command writes (``checkpoints/``, ``runs/``)
stays in the test's directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.docs.doccmds import ROOT, DocTest

#: Top-level entries of the checkout that a scratch directory does not link: what commands write, caches.
NOT_LINKED = {".git", ".venv", "checkpoints", "runs", "build", "dist", "demo-summary.json",
              "demo-summary.png", ".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__"}  # fmt: skip

#: Seconds the commands still running at the end get between SIGTERM and the namespace's end (SIGKILL).
GRACE_S = 5.0


@dataclass
class StepResult:
    """What one step did on each of its nodes."""

    exits: list[int | None]
    outputs: list[str]
    seconds: float


@dataclass
class Result:
    """A sandboxed run: its steps (as far as they got), whether it ran out of time, and any set-up error."""

    steps: list[StepResult] = field(default_factory=list)
    timed_out: bool = False
    error: str = ""


def unshare_argv() -> list[str]:
    argv = ["unshare", "--net", "--mount", "--pid", "--fork", "--mount-proc", "--kill-child"]
    return argv + ([] if os.geteuid() == 0 else ["--map-root-user"])


@functools.cache
def refused() -> str | None:
    """Why this machine cannot make the sandbox (None: it can), for a skip."""
    for tool in ("unshare", "mount", "bash"):
        if shutil.which(tool) is None:
            return f"the {tool} command is not installed"
    up = "from tests.docs.sandbox import loopback_up; loopback_up()"
    probe = f"{sys.executable} -c '{up}' && mount -t tmpfs tmpfs /dev/shm"
    proc = subprocess.run(
        [*unshare_argv(), "bash", "-c", probe],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    if proc.returncode != 0:
        return f"cannot make a private network namespace here (unshare): {proc.stderr.strip()[:200]}"
    return None


def scratch_dir(path: Path, root: Path = ROOT) -> Path:
    """A working directory at ``path`` that links every top-level entry of the checkout but its outputs."""
    path.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name not in NOT_LINKED and not entry.name.endswith(".egg-info"):
            (path / entry.name).symlink_to(entry)
    return path


def hosts_file(path: Path, test: DocTest) -> Path:
    """/etc/hosts of the sandbox: this machine's name and the host of the marker's etcd on loopback."""
    names = ["localhost", socket.gethostname()]
    host = test.marker.etcd.rsplit(":", 1)[0] if test.marker.etcd else None
    if host and not re.match(r"^[\d.]+$", host):
        names.append(host)
    path.write_text(f"127.0.0.1 {' '.join(names)}\n::1 localhost ip6-localhost\n", encoding="utf-8")
    return path


def environment(tmpdir: Path) -> dict[str, str]:
    """The commands' environment: the test's, with this interpreter's scripts first on PATH, the checkout
    on PYTHONPATH, TMPDIR of the test, and no HTTP proxy (nothing outside loopback is reachable)."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["TMPDIR"] = str(tmpdir)
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def run(test: DocTest, workdir: Path) -> Result:
    """Run ``test``'s steps in a sandbox under ``workdir`` (see the module docstring)."""
    cwd = scratch_dir(workdir / "cwd")
    # short: agents and fork servers bind Unix sockets under TMPDIR (at most 107 bytes a path)
    tmpdir = Path(tempfile.mkdtemp(prefix="et-doc-"))
    try:
        return _run(test, workdir, cwd, tmpdir)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def _run(test: DocTest, workdir: Path, cwd: Path, tmpdir: Path) -> Result:
    spec = {
        "cwd": str(cwd),
        "root": str(ROOT),
        "hosts": str(hosts_file(workdir / "hosts", test)),
        "etcd_port": int(test.marker.etcd.rsplit(":", 1)[1]) if test.marker.etcd else None,
        "timeout": test.marker.timeout,
        "steps": [{"text": s.text, "nodes": s.nodes} for s in test.steps],
        "result": str(workdir / "result.json"),
        "logs": str(workdir),
    }
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    try:
        subprocess.run(
            [*unshare_argv(), sys.executable, "-m", "tests.docs.sandbox", str(spec_path)],
            env=environment(tmpdir),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            timeout=test.marker.timeout + GRACE_S + 30,
            check=False,
        )
    except subprocess.TimeoutExpired:  # unshare's --kill-child ended the namespace with it
        return Result(timed_out=True, error="the sandbox did not end by itself")
    try:
        data = json.loads((workdir / "result.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return Result(error=f"the sandbox wrote no result: {exc}")
    return Result(
        steps=[StepResult(**s) for s in data["steps"]], timed_out=data["timed_out"], error=data["error"]
    )


# -- inside the sandbox: the PID namespace's first process ----------------------------------------------


def loopback_up() -> None:
    """Bring the namespace's loopback interface up (``ip link set lo up`` without iproute2)."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, request))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def _prepare(spec: dict[str, Any]) -> Any:
    """Loopback up, the hosts file and a private /dev/shm mounted; the marker's etcd started."""
    loopback_up()
    for argv in (
        ["mount", "--bind", spec["hosts"], "/etc/hosts"],
        ["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/dev/shm"],
        # the checkout read-only: a command that writes through the scratch directory's links fails
        ["mount", "--bind", spec["root"], spec["root"]],
        ["mount", "-o", "remount,bind,ro", spec["root"]],
    ):
        subprocess.run(argv, check=True, capture_output=True, text=True)
    if spec["etcd_port"] is None:
        return None
    from elastic_train.etcd.server import EmbeddedEtcd

    return EmbeddedEtcd(host="127.0.0.1", client_port=spec["etcd_port"]).start()


def _run_steps(spec: dict[str, Any], result: Result) -> None:
    deadline = time.monotonic() + spec["timeout"]
    for k, step in enumerate(spec["steps"]):
        start = time.monotonic()
        logs = [Path(spec["logs"]) / f"step{k}-node{n}.log" for n in range(step["nodes"])]
        procs = []
        for log in logs:
            with open(log, "wb") as out:
                procs.append(
                    subprocess.Popen(
                        ["bash", "-e", "-o", "pipefail", "-c", step["text"]],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=spec["cwd"],
                        start_new_session=True,
                    )
                )
        exits: list[int | None] = []
        for proc in procs:
            try:
                exits.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                exits.append(None)
                result.timed_out = True
        outputs = [log.read_text(encoding="utf-8", errors="replace") for log in logs]
        result.steps.append(StepResult(exits, outputs, round(time.monotonic() - start, 2)))
        if result.timed_out or (k < len(spec["steps"]) - 1 and any(code != 0 for code in exits)):
            return


def _end_everything() -> None:
    """SIGTERM every other process of the namespace, reap them for up to :data:`GRACE_S`, then SIGKILL."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGTERM)
    end = time.monotonic() + GRACE_S
    while time.monotonic() < end:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(-1, signal.SIGKILL)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    result = Result()
    etcd = None
    try:
        etcd = _prepare(spec)
        _run_steps(spec, result)
    except Exception as exc:  # reported to the test, which prints it
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        if etcd is not None:
            with contextlib.suppress(Exception):
                etcd.stop()
        _end_everything()
        Path(spec["result"]).write_text(json.dumps(asdict(result)), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
