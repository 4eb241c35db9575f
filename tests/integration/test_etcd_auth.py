"""``elastic-train etcd auth ensure|wait`` against a real etcd: users, role, permission and auth enabled,
idempotently; a rotated password applied; a readiness file that follows etcd; one line for every mistake."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_train.etcd.auth import ensure_once
from elastic_train.etcd.client import connect
from elastic_train.etcd.errors import EtcdError
from elastic_train.etcd.server import EmbeddedEtcd, find_etcd_binary
from elastic_train.net import free_port

ROOT_PW = "r00t-Secret-pw"
TRAINING_PW = "tr4ining-Secret-pw"
PREFIX = "/elastic_train/"


def auth_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    full_env = {
        **os.environ,
        "ETCD_ROOT_PASSWORD": ROOT_PW,
        "ETCD_TRAINING_PASSWORD": TRAINING_PW,
        "ELASTIC_TRAIN_LOG_FORMAT": "json",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "elastic_train", "etcd", "auth", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def error_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if "error:" in line and not line.startswith("{")]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def no_secrets(proc: subprocess.CompletedProcess) -> None:
    out = proc.stdout + proc.stderr
    assert ROOT_PW not in out and TRAINING_PW not in out


def test_ensure_sets_up_auth_once_and_changes_nothing_the_second_time(etcd_server: EmbeddedEtcd) -> None:
    ep = etcd_server.endpoint
    first = auth_cli("ensure", f"--endpoint={ep}", "--user=trainer", f"--prefix={PREFIX}", "--interval=0")
    assert first.returncode == 0, first.stderr
    assert '"enabled_now": true' in first.stderr
    no_secrets(first)

    # Auth is on: nothing works without a login, root may do anything, the training user only its prefix.
    with pytest.raises(EtcdError, match="requires authentication"), connect(ep) as anonymous:
        anonymous.get(PREFIX + "x")
    with connect(ep, user="trainer", password=TRAINING_PW) as trainer:
        trainer.put(PREFIX + "run/config", b"{}")
        assert trainer.get(PREFIX + "run/config") is not None
        with pytest.raises(EtcdError, match="not permitted"):
            trainer.put("/elsewhere", b"x")
    with connect(ep, user="root", password=ROOT_PW) as root:
        root.put("/elsewhere", b"root may")
    revision = auth_revision(ep)

    again = auth_cli("ensure", f"--endpoint={ep}", "--user=trainer", f"--prefix={PREFIX}", "--interval=0")
    assert again.returncode == 0, again.stderr
    assert '"enabled_now": false' in again.stderr and "password_set" not in again.stderr
    assert auth_revision(ep) == revision, "a second run changed users, roles or permissions"

    ready = auth_cli("wait", f"--endpoint={ep}", "--user=trainer", f"--prefix={PREFIX}", "--timeout=10")
    assert ready.returncode == 0, ready.stderr
    assert '"event": "etcd_ready"' in ready.stderr


def auth_revision(endpoint: str) -> int:
    """etcd's auth revision: every change to users, roles or permissions raises it."""
    ctl = find_etcd_binary("etcdctl")
    out = subprocess.run(
        [ctl, f"--endpoints={endpoint}", f"--user=root:{ROOT_PW}", "auth", "status"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout  # fmt: skip
    return int(next(line.split(":")[1] for line in out.splitlines() if line.startswith("AuthRevision")))


def test_a_rotated_training_password_is_applied_and_the_old_one_refused(etcd_server: EmbeddedEtcd) -> None:
    ep = etcd_server.endpoint
    assert ensure_once(ep, "trainer", "", ROOT_PW, TRAINING_PW) is True
    assert ensure_once(ep, "trainer", "", ROOT_PW, "rotated-pw") is False
    with connect(ep, user="trainer", password="rotated-pw") as trainer:
        trainer.put("/anywhere", b"the empty prefix is the whole keyspace")
        assert "rotated-pw" not in repr(trainer) and trainer.user == "trainer"
    with pytest.raises(EtcdError, match="authentication failed"):
        connect(ep, user="trainer", password=TRAINING_PW)


def test_mistakes_are_one_line_and_exit_codes_say_which(etcd_server: EmbeddedEtcd) -> None:
    ep = etcd_server.endpoint
    unset = auth_cli("ensure", f"--endpoint={ep}", "--interval=0", env={"ETCD_ROOT_PASSWORD": ""})
    assert unset.returncode == 2 and "ETCD_ROOT_PASSWORD is empty or unset" in error_line(unset)
    root_user = auth_cli("ensure", f"--endpoint={ep}", "--user=root", "--interval=0")
    assert root_user.returncode == 2 and "must not be root" in error_line(root_user)
    bad_endpoint = auth_cli("wait", "--endpoint=a:x", "--timeout=0")
    assert bad_endpoint.returncode == 1 and "port 'x'" in error_line(bad_endpoint)

    # Before auth is set up the training user cannot log in: wait gives up with the reason.
    early = auth_cli("wait", f"--endpoint={ep}", "--user=trainer", "--timeout=1")
    assert early.returncode == 1
    assert "could not log in to etcd" in error_line(early) and "authentication" in error_line(early)

    assert auth_cli("ensure", f"--endpoint={ep}", "--interval=0").returncode == 0
    wrong_root = auth_cli("ensure", f"--endpoint={ep}", "--interval=0", env={"ETCD_ROOT_PASSWORD": "nope"})
    assert wrong_root.returncode == 2 and "root password from the Secret is rejected" in error_line(
        wrong_root
    )
    wrong = auth_cli("wait", f"--endpoint={ep}", "--timeout=1", env={"ETCD_TRAINING_PASSWORD": "nope-pw"})
    assert wrong.returncode == 1 and "authentication failed" in error_line(wrong)
    for proc in (unset, root_user, early, wrong_root, wrong):
        no_secrets(proc)


def _wait_for(predicate: Any, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"ensure exited with {proc.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.1)


def test_the_sidecar_waits_for_etcd_and_its_ready_file_follows_it(reaper: Any, tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    ready = tmp_path / "ready"
    env = {**os.environ, "ETCD_ROOT_PASSWORD": ROOT_PW, "ETCD_TRAINING_PASSWORD": TRAINING_PW}
    log = open(tmp_path / "ensure.log", "ab")  # noqa: SIM115 - closed with the process
    proc = reaper.popen(
        [sys.executable, "-m", "elastic_train", "etcd", "auth", "ensure", f"--endpoint=127.0.0.1:{port}",
         f"--ready-file={ready}", "--interval=1"],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    time.sleep(2.0)  # etcd is not there yet: the sidecar keeps trying, and is not ready
    assert proc.poll() is None and not ready.exists()
    with EmbeddedEtcd(client_port=port) as server:
        _wait_for(ready.exists, 60, "the ready file", proc)
        with connect(server.endpoint, user="elastic-train", password=TRAINING_PW) as trainer:
            trainer.put("/elastic_train/r/config", b"{}")
        server.kill()
        _wait_for(lambda: not ready.exists(), 30, "the ready file to go with etcd", proc)
        server.start()
        _wait_for(ready.exists, 60, "the ready file to come back", proc)
    text = (tmp_path / "ensure.log").read_text()
    assert "auth_not_ensured" in text and TRAINING_PW not in text and ROOT_PW not in text
