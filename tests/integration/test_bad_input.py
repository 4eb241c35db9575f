"""Bad input, end to end through the real commands: one clear line, a non-zero exit, nothing overwritten.

Covers malformed YAML, unknown keys, wrong types, bad checkpoint URLs, an unreachable etcd, a wrong etcd
password, TLS with the wrong CA, a checkpoint of a different model and ``--resume-from`` a missing step.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elastic_train.etcd.client import connect
from elastic_train.etcd.server import EmbeddedEtcd, find_etcd_binary
from tests.helpers import cli, make_ca, make_server_cert, needs_openssl, one_line, tree_digest

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("yaml_text", "expected", "code"),
    [
        ("train: {steps: [1, 2\n", "malformed YAML at line", 2),
        ("checkpoint: {keep_lastt: 3}\n", "checkpoint.keep_lastt: unknown key (did you mean keep_last?)", 2),
        ("train: {global_batch: many}\n", "train.global_batch: expected an integer, got 'many' (str)", 2),
        ("rendezvous: {min_nodes: 4, max_nodes: 2}\n", "rendezvous.max_nodes: 2 must be >= min_nodes (4)", 2),
    ],
)
def test_bad_config_file(tmp_path: Path, yaml_text: str, expected: str, code: int) -> None:
    job = tmp_path / "job.yaml"
    job.write_text(yaml_text)
    for proc in (cli("run", str(job)), cli("--config", str(job), module="elastic_train.worker")):
        assert expected in one_line(proc)
        assert proc.returncode == code


def test_bad_checkpoint_url_fails_before_anything_starts(tmp_path: Path) -> None:
    proc = cli("run", "--endpoint", "127.0.0.1:1", "--checkpoint", "nosuch://bucket/x")
    assert "unknown storage protocol 'nosuch'" in one_line(proc)


def test_unreachable_etcd_is_one_line_and_fast() -> None:
    proc = cli(
        "run", "--endpoint", "127.0.0.1:1", "--run-id", "job-1", "--set", "rendezvous.connect_timeout=2"
    )
    line = one_line(proc)
    assert "127.0.0.1:1" in line and "etcd" in line


def test_wrong_password_changes_nothing_in_etcd(etcd_server: EmbeddedEtcd) -> None:
    ctl = find_etcd_binary("etcdctl")

    def etcdctl(*args: str, user: str | None = None) -> None:
        base = [ctl, f"--endpoints={etcd_server.endpoint}"] + ([f"--user={user}"] if user else [])
        subprocess.run([*base, *args], check=True, capture_output=True, timeout=30)

    etcdctl("user", "add", "root", "--new-user-password=rootpw")
    etcdctl("user", "add", "trainer", "--new-user-password=right-pw")
    etcdctl("role", "add", "job")
    etcdctl("role", "grant-permission", "job", "readwrite", "/elastic_train/", "--prefix=true")
    etcdctl("user", "grant-role", "trainer", "job")
    etcdctl("auth", "enable", user="root:rootpw")
    args = (
        "run",
        "--endpoint",
        etcd_server.endpoint,
        "--run-id",
        "secure",
        "--set",
        "rendezvous.user=trainer",
    )
    proc = cli(*args, env={"ELASTIC_TRAIN_ETCD_PASSWORD": "wrong-pw"})
    line = one_line(proc)
    assert "authentication failed" in line and "wrong-pw" not in proc.stderr + proc.stdout
    no_password = cli(*args, env={"ELASTIC_TRAIN_ETCD_PASSWORD": ""})
    assert "no password" in one_line(no_password)
    root = connect(etcd_server.endpoint, user="root", password="rootpw")
    try:
        keys, _ = root.get_prefix("/elastic_train/")
        assert keys == [], "a refused node wrote nothing"
    finally:
        root.close()


@needs_openssl
def test_tls_with_the_wrong_ca_is_one_line(tmp_path: Path) -> None:
    ca_key, ca = make_ca(tmp_path, "ca")
    _, other_ca = make_ca(tmp_path, "other-ca")
    cert, key = make_server_cert(tmp_path, ca_key, ca)
    with EmbeddedEtcd(tls=(str(cert), str(key), str(ca))) as server:
        base = ("run", "--endpoint", server.endpoint, "--run-id", "tls-job", "--dry-run")
        ok = cli(*base, "--set", f"rendezvous.tls.ca_file={ca}")
        assert ok.returncode == 0, ok.stderr
        from elastic_train.etcd.config import TLSConfig

        connect(server.endpoint, tls=TLSConfig(ca_file=str(ca))).close()  # the right CA works
        proc = cli("run", "--endpoint", server.endpoint, "--run-id", "tls-job",
                   "--set", f"rendezvous.tls.ca_file={other_ca}")  # fmt: skip
        line = one_line(proc)
        assert "TLS" in line or "certificate" in line or "handshake" in line, line
        missing = cli(
            "run", "--endpoint", server.endpoint, "--set", f"rendezvous.tls.ca_file={tmp_path}/none"
        )
        assert "ca_file" in one_line(missing)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished single-process run of the regression task with hidden size 16."""
    root = tmp_path_factory.mktemp("ckpt")
    proc = cli(
        "--set", "train.task=regression", "--set", "train.task_args={hidden: 16}", "--set",
        "rendezvous.run_id=saved", "--steps", "4", "--checkpoint", str(root), "--checkpoint-every", "2",
        module="elastic_train.worker",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return root


def test_checkpoint_of_another_model_is_refused_and_kept(saved_run: Path, tmp_path: Path) -> None:
    before = tree_digest(saved_run)
    proc = cli(
        "--set", "train.task=regression", "--set", "train.task_args={hidden: 8}", "--set",
        "rendezvous.run_id=other", "--steps", "6", "--checkpoint", str(tmp_path / "new"),
        "--resume-from", str(saved_run / "saved"), module="elastic_train.worker",
    )  # fmt: skip
    line = one_line(proc)
    assert "in the checkpoint but" in line, line
    assert tree_digest(saved_run) == before, "the checkpoint it refused is untouched"


def test_resume_from_a_missing_step(saved_run: Path, tmp_path: Path) -> None:
    before = tree_digest(saved_run)
    proc = cli(
        "--set", "train.task=regression", "--set", "train.task_args={hidden: 16}", "--set",
        "rendezvous.run_id=again", "--steps", "6", "--checkpoint", str(tmp_path / "new"),
        "--resume-from", str(saved_run / "saved" / "step-00000999"), module="elastic_train.worker",
    )  # fmt: skip
    line = one_line(proc)
    assert "step-00000999" in line, line
    assert tree_digest(saved_run) == before
    verify = cli("ckpt", "verify", str(saved_run / "saved" / "step-00000999"))
    assert verify.returncode == 1 and "step-00000999: does not exist" in verify.stderr
