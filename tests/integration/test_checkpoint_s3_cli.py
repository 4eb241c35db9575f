"""Durable checkpoints on s3:// through s3fs against a real local S3 (moto server), and the ckpt CLI."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator

import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
from elastic_train.cli.main import main as cli
from elastic_train.net import free_port

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    port = free_port()
    server = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or shutil.which("moto_server")
    cmd = [server] if server else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen(
        [*cmd, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError("moto server did not start") from None
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch) -> str:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint}).mkdir(bucket)
    return bucket


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {
        "model": torch.nn.Linear(6, 2).state_dict(),
        "sampler": {"epoch": 0, "cursor": step},
        "step": step,
    }


def test_s3_save_restore_and_cli(s3_endpoint, s3_env, capsys, tmp_path):
    memdir = tempfile.mkdtemp(dir=str(tmp_path))
    url = f"s3://{s3_env}/ckpt"
    cfg = CheckpointConfig(
        url=url,
        every_steps=2,
        keep_last=2,
        memory=False,
        memory_dir=memdir,
        storage_options={"endpoint_url": s3_endpoint},
    )
    m = CheckpointManager(cfg, "job", rank=0, world_size=1, local_rank=0)
    assert m.restore() is None
    for step in range(1, 6):
        m.save(step, state(step))
    m.finalize(5, state(5))
    r = CheckpointManager(cfg, "job", rank=0, world_size=1, local_rank=0).restore()
    assert r is not None and (r.step, r.source) == (5, "durable")
    assert torch.equal(r.state["model"]["weight"], state(5)["model"]["weight"])

    opt = ["--storage-option", f"endpoint_url={s3_endpoint}"]
    capsys.readouterr()
    assert cli(["ckpt", "ls", f"{url}/job", *opt]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [int(r.split()[0]) for r in rows] == [4, 5] and all(r.endswith("valid") for r in rows)
    assert cli(["ckpt", "verify", f"{url}/job", *opt]) == 0
    capsys.readouterr()
    assert cli(["ckpt", "show", f"{url}/job", *opt]) == 0
    shown = capsys.readouterr().out
    assert "step        5   world size at save 1" in shown and "at            0" in shown
    assert "model       2 tensors" in shown and "weight" in shown
    assert cli(["ckpt", "show", f"{url}/job/step-00000004", "--json", *opt]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 4
    assert cli(["ckpt", "export", f"{url}/job", "--to", str(tmp_path / "w.pt"), *opt]) == 0
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(weights["weight"], state(5)["model"]["weight"])

    # A corrupted object: verify fails, restore falls back to step 4.
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_endpoint})
    share = next(p for p in fs.ls(f"{s3_env}/ckpt/job/step-00000005") if p.endswith(".bin"))
    data = bytearray(fs.cat_file(share))
    data[0] ^= 0xFF
    fs.pipe_file(share, bytes(data))
    assert cli(["ckpt", "verify", f"{url}/job/step-00000005", *opt]) == 1
    assert "checksum mismatch" in capsys.readouterr().out
    r = CheckpointManager(cfg, "job", rank=0, world_size=1, local_rank=0).restore()
    assert r is not None and r.step == 4
    # Step 5 is the newest: rm asks for --force unless it is invalid, as its checksum now makes it.
    assert cli(["ckpt", "rm", f"{url}/job/step-00000005", "--yes", *opt]) == 0
    capsys.readouterr()
    assert cli(["ckpt", "ls", f"{url}/job", *opt]) == 0
    assert [int(r.split()[0]) for r in capsys.readouterr().out.splitlines()[1:]] == [4]


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli(["ckpt", "ls", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none: does not exist" in err
    assert cli(["ckpt", "rm", str(tmp_path)]) == 1
    assert "one step directory" in capsys.readouterr().err
    (tmp_path / "run" / "step-00000003").mkdir(parents=True)
    assert cli(["ckpt", "verify", str(tmp_path / "run" / "step-00000003")]) == 1
    assert "no manifest" in capsys.readouterr().out
    assert cli(["ckpt", "ls", str(tmp_path / "run")]) == 0
    assert "invalid: no manifest.json" in capsys.readouterr().out
