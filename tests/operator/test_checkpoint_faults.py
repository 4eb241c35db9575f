"""Operator mistakes against the checkpoint store, through the real commands.

Each case is a mistake from issue 12 that touches checkpoints: tampered or hostile manifests, ``ckpt rm`` /
``export`` / ``ls`` typed carelessly, ``--checkpoint`` naming a regular file, ``--resume-from`` naming
nothing. The invariants: one clear line and a non-zero exit (no traceback), nothing outside the checkpoint
read or written, and no committed checkpoint made invalid.
"""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, durable
from elastic_train.checkpoint.storage import open_storage
from tests.helpers import QUIET, cli, log_records, made_once, one_line, tree_digest

pytestmark = pytest.mark.timeout(300)

TASK = ["--set", "train.task=regression", "--set", "train.task_args={hidden: 16}"]
STEPS = ("step-00000002", "step-00000004", "step-00000006")


def all_valid(run: Path, steps: tuple[str, ...]) -> None:
    storage = open_storage(str(run))
    for step in steps:
        assert durable.verify(storage, str(run / step)) == [], step


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root with run ``job``: checkpoints of steps 2, 4 and 6 written by a real worker (once a
    session; each test works on a copy, :func:`root`)."""

    def train(tmp: Path) -> None:
        proc = cli(
            *TASK, "--set", "rendezvous.run_id=job", "--steps", "6", "--checkpoint", str(tmp / "ckpt"),
            "--checkpoint-every", "2", module="elastic_train.worker",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    root = made_once(tmp_path_factory, "trained", train) / "ckpt"
    assert sorted(os.listdir(root / "job")) == ["latest", *STEPS]
    return root


@pytest.fixture
def root(trained: Path, tmp_path: Path) -> Path:
    """A private copy of the trained checkpoint root."""
    copy = tmp_path / "ckpt"
    shutil.copytree(trained, copy)
    return copy


def tamper(step_dir: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = step_dir / durable.MANIFEST
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


def _add_bytes(m: dict[str, Any]) -> None:
    m["skeleton"]["extra"]["note"] = {"__bytes__": "not*base64!"}


TAMPERED: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "parent-path": (lambda m: m["files"][0].update(name="../../x"), "'../../x' is not a plain file name"),
    "absolute-path": (lambda m: m["files"][0].update(name="/etc/shadow"), "'/etc/shadow' is not a plain"),
    "bad-base64": (_add_bytes, "skeleton at /extra/note: bytes are not valid base64"),
    "shape-vs-nbytes": (
        lambda m: m["tensors"][0].update(shape=[16, 9]),
        "float64[16, 9] is 1152 bytes, the manifest says 1024",
    ),
    "tensor-index": (
        lambda m: m["skeleton"]["model"]["0.bias"].update(__tensor__=999),
        "skeleton at /model/0.bias: tensor index 999",
    ),
    "offset-beyond-state": (
        lambda m: m["tensors"][0].update(offset=1 << 40),
        "lies beyond the end of the state",
    ),
    "step-not-integer": (lambda m: m.update(step="6"), "step: Input should be a valid integer"),
    "unknown-dtype": (lambda m: m["tensors"][0].update(dtype="float128"), "unknown tensor dtype 'float128'"),
}


@pytest.mark.parametrize("case", sorted(TAMPERED))
def test_tampered_manifest_is_an_invalid_checkpoint(
    root: Path, tmp_path: Path, memdir: str, case: str
) -> None:
    change, reason = TAMPERED[case]
    run = root / "job"
    newest = run / STEPS[-1]
    if case == "parent-path":  # a file where the name points: it must not be read
        (root.parent / "x").write_bytes(b"\0" * 4096)
    tamper(newest, change)
    before = tree_digest(run)

    verify = cli("ckpt", "verify", str(newest))
    assert verify.returncode == 1 and "Traceback" not in verify.stderr, verify.stderr
    assert f"FAIL {newest}: invalid manifest: " in verify.stdout and reason in verify.stdout, verify.stdout

    refused = cli("ckpt", "export", str(newest), "--to", str(tmp_path / "w.pt"))
    assert "not a valid checkpoint: invalid manifest" in one_line(refused)
    assert not (tmp_path / "w.pt").exists()

    # Restore falls back to step 4, as for a checksum mismatch: as the run itself and as a resume source.
    cfg = CheckpointConfig(url=str(root), memory=False, memory_dir=memdir)
    restored = CheckpointManager(cfg, "job", rank=0, world_size=1, local_rank=0).restore()
    assert restored is not None and restored.step == 4 and restored.source == "durable"
    cfg = CheckpointConfig(url=str(tmp_path / "new"), memory=False, memory_dir=memdir, resume_from=str(run))
    restored = CheckpointManager(cfg, "new", rank=0, world_size=1, local_rank=0).restore()
    assert restored is not None and restored.step == 4 and restored.source == "resume_from"

    assert tree_digest(run) == before, "nothing in the run changed"
    all_valid(run, STEPS[:-1])


def test_ls_shows_why_and_export_takes_the_previous_checkpoint(root: Path, tmp_path: Path) -> None:
    run = root / "job"
    change, reason = TAMPERED["bad-base64"]
    tamper(run / STEPS[-1], change)
    listing = cli("ckpt", "ls", str(run))
    assert listing.returncode == 1, listing
    rows = {line.split()[0]: line for line in listing.stdout.splitlines()[1:]}
    assert rows["6"].split("  ")[-1].startswith("invalid: invalid manifest") and reason in rows["6"]
    assert rows["4"].endswith("valid") and rows["2"].endswith("valid")
    exported = cli("ckpt", "export", str(run), "--to", str(tmp_path / "w.pt"))
    assert exported.returncode == 0 and "of step 4" in exported.stdout, exported.stderr
    all_valid(run, STEPS[:-1])


def test_worker_resumes_from_the_previous_checkpoint_past_a_tampered_one(root: Path, tmp_path: Path) -> None:
    tamper(root / "job" / STEPS[-1], TAMPERED["parent-path"][0])
    proc = subprocess.run(
        [sys.executable, "-m", "elastic_train.worker", *TASK, "--set", "rendezvous.run_id=next",
         "--steps", "8", "--checkpoint", str(tmp_path / "new"), "--resume-from", str(root / "job")],
        env={**os.environ, **QUIET, "ELASTIC_TRAIN_LOG_LEVEL": "info", "ELASTIC_TRAIN_LOG_FORMAT": "json"},
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = log_records(proc.stdout + proc.stderr)
    skipped = [e for e in events if e.get("event") == "checkpoint_skipped"]
    assert skipped and "not a plain file name" in skipped[0]["reason"]
    (resumed,) = [e for e in events if e.get("event") == "training_resumed"]
    assert resumed["step"] == 4 and resumed["source"] == "resume_from"
    assert sorted(os.listdir(tmp_path / "new" / "next"))[-1] == "step-00000008"


# -- ckpt rm ---------------------------------------------------------------------------------------


def latest(run: Path) -> str:
    return (run / durable.LATEST).read_text().strip()


def test_rm_refuses_the_newest_valid_checkpoint_without_force(root: Path) -> None:
    run = root / "job"
    before = tree_digest(run)
    line = one_line(cli("ckpt", "rm", str(run / STEPS[-1]), "--yes"))
    assert "the newest valid checkpoint of run job; pass --force" in line
    assert tree_digest(run) == before

    done = cli("ckpt", "rm", str(run / STEPS[-1]), "--yes", "--force")
    assert done.returncode == 0 and "latest is now step-00000004" in done.stdout, done.stderr
    assert not (run / STEPS[-1]).exists() and latest(run) == "step-00000004"
    all_valid(run, STEPS[:2])


def test_rm_of_the_only_checkpoint_and_then_none(root: Path) -> None:
    run = root / "job"
    for step in STEPS[:2]:
        assert cli("ckpt", "rm", str(run / step), "--yes").returncode == 0
    assert "newest and only valid checkpoint" in one_line(cli("ckpt", "rm", str(run / STEPS[2]), "--yes"))
    assert cli("ckpt", "rm", str(run / STEPS[2]), "--yes", "--force").returncode == 0
    assert not (run / durable.LATEST).exists(), "latest names no checkpoint that is gone"


def test_rm_needs_yes_without_a_terminal(root: Path) -> None:
    run = root / "job"
    before = tree_digest(run)
    line = one_line(cli("ckpt", "rm", str(run / STEPS[0])))
    assert "not confirmed; pass --yes (stdin is not a terminal)" in line
    assert tree_digest(run) == before
    assert cli("ckpt", "rm", str(run / STEPS[0]), "-y").returncode == 0
    assert not (run / STEPS[0]).exists() and latest(run) == STEPS[-1]
    all_valid(run, STEPS[1:])


def _rm_on_a_terminal(target: Path, answer: bytes) -> tuple[int, str]:
    """Run ``ckpt rm`` with a pseudo-terminal as stdin/stdout, answer its question, return (code, output)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_train", "ckpt", "rm", str(target)],
        env=dict(os.environ, **QUIET),
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    out = b""
    try:
        deadline = time.monotonic() + 120
        while b"[y/N]" not in out and time.monotonic() < deadline:
            if select.select([leader], [], [], 1)[0]:
                out += os.read(leader, 4096)
        assert b"[y/N]" in out, out
        os.write(leader, answer)
        code = proc.wait(timeout=60)
        while select.select([leader], [], [], 0.2)[0]:
            try:
                chunk = os.read(leader, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return code, out.decode(errors="replace")


def test_rm_asks_on_a_terminal(root: Path) -> None:
    run = root / "job"
    code, out = _rm_on_a_terminal(run / STEPS[0], b"n\n")
    assert code == 1 and "nothing removed" in out and "Traceback" not in out
    assert "step 2, valid" in out
    assert (run / STEPS[0] / durable.MANIFEST).exists()
    code, out = _rm_on_a_terminal(run / STEPS[0], b"y\n")
    assert code == 0 and f"removed {run / STEPS[0]}" in out
    assert not (run / STEPS[0]).exists()


def test_rm_removes_only_checkpoint_directories(root: Path) -> None:
    run = root / "job"
    mine = run / "step-00000009"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert "not a checkpoint (it holds 'notes.txt')" in one_line(cli("ckpt", "rm", str(mine), "--yes"))
    assert "not a checkpoint" in one_line(cli("ckpt", "rm", str(mine), "--yes", "--force"))
    assert (mine / "notes.txt").read_text() == "keep me"

    other = run / "step-00000010"
    other.mkdir()
    (other / durable.MANIFEST).write_text(json.dumps({"kind": "someone-else"}))
    assert "not an elastic_train manifest" in one_line(cli("ckpt", "rm", str(other), "--yes", "--force"))
    assert other.exists()

    torn = run / "step-00000011"
    torn.mkdir()
    (torn / "share-00000.0badc0de.bin").write_bytes(b"\0" * 64)
    assert "no manifest.json" in one_line(cli("ckpt", "rm", str(torn), "--yes"))
    assert cli("ckpt", "rm", str(torn), "--yes", "--force").returncode == 0 and not torn.exists()

    assert "does not exist" in one_line(cli("ckpt", "rm", str(run / "step-00000099"), "--yes"))
    assert "rm takes one step directory" in one_line(cli("ckpt", "rm", str(run), "--yes"))
    all_valid(run, STEPS)
    assert latest(run) == STEPS[-1]


def test_rm_of_an_invalid_newest_checkpoint_needs_no_force(root: Path) -> None:
    run = root / "job"
    share = next((run / STEPS[-1]).glob("share-*.bin"))
    data = bytearray(share.read_bytes())
    data[0] ^= 0xFF  # a checksum mismatch: the size is right, so only verify notices
    share.write_bytes(bytes(data))
    done = cli("ckpt", "rm", str(run / STEPS[-1]), "--yes")
    assert done.returncode == 0, done.stderr
    assert latest(run) == "step-00000004"


# -- ckpt export -----------------------------------------------------------------------------------


def test_export_never_overwrites_without_force(root: Path, tmp_path: Path) -> None:
    target = tmp_path / "weights.pt"
    target.write_text("precious")
    assert "exists; pass --force" in one_line(cli("ckpt", "export", str(root / "job"), "--to", str(target)))
    assert target.read_text() == "precious"
    assert cli("ckpt", "export", str(root / "job"), "--to", str(target), "--force").returncode == 0
    weights = torch.load(target, weights_only=True)
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "weights.pt"], "no temporary file left"


@pytest.mark.parametrize("where", ["manifest", "step", "run", "root", "symlink"])
def test_export_never_writes_into_the_checkpoint_store(root: Path, tmp_path: Path, where: str) -> None:
    run = root / "job"
    target = {
        "manifest": run / STEPS[-1] / durable.MANIFEST,
        "step": run / STEPS[-1] / "weights.pt",
        "run": run / "weights.pt",
        "root": root / "weights.pt",
        "symlink": tmp_path / "link" / "weights.pt",
    }[where]
    (tmp_path / "link").symlink_to(run)
    before = tree_digest(root)
    line = one_line(cli("ckpt", "export", str(run), "--to", str(target), "--force"))
    assert "inside the checkpoint store" in line, line
    assert tree_digest(root) == before
    all_valid(run, STEPS)


def test_export_to_a_bad_target_is_one_line_and_leaves_nothing(root: Path, tmp_path: Path) -> None:
    run = str(root / "job")
    missing = tmp_path / "no" / "such" / "dir" / "w.pt"
    assert "does not exist" in one_line(cli("ckpt", "export", run, "--to", str(missing)))
    assert "is a directory" in one_line(cli("ckpt", "export", run, "--to", str(tmp_path)))
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in one_line(
        cli("ckpt", "export", run, "--to", str(tmp_path / "file" / "w.pt"))
    )
    # A directory nobody can create files in (even root): /proc.
    line = one_line(cli("ckpt", "export", run, "--to", "/proc/weights.pt"))
    assert line.startswith("elastic-train: error: cannot write /proc/weights.pt:"), line
    assert not [p for p in os.listdir("/proc") if p.endswith(".tmp")]
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "file"]


# -- ckpt ls ---------------------------------------------------------------------------------------


def test_ls_of_the_checkpoint_root_lists_runs_with_their_newest_valid_step(root: Path) -> None:
    shutil.copytree(root / "job", root / "broken")
    for step in STEPS:
        tamper(root / "broken" / step, TAMPERED["absolute-path"][0])
    (root / "job" / "step-00000008").mkdir()  # a save in progress: not a checkpoint yet
    listing = cli("ckpt", "ls", str(root))
    assert listing.returncode == 0, listing.stderr
    rows = {line.split()[0]: line.split() for line in listing.stdout.splitlines()[1:]}
    assert rows["job"][1] == "6" and rows["job"][-1] == "4"
    assert rows["broken"][1] == "none" and rows["broken"][-1] == "3"

    run = cli("ckpt", "ls", str(root / "job"))  # a save in progress does not fail the listing
    assert run.returncode == 0 and "invalid: no manifest.json" in run.stdout


def test_listing_showing_and_verifying_do_not_load_torch(root: Path) -> None:
    """Reading manifests and checking digests needs no torch (an interpreter importing it takes seconds);
    only ``export`` writes tensors."""
    run, step = root / "job", root / "job" / STEPS[-1]
    script = (
        "import sys\n"
        "from elastic_train.cli.main import main\n"
        "for argv in sys.argv[1:]:\n"
        "    assert main(argv.split('|')) == 0, argv\n"
        "print('torch loaded' if 'torch' in sys.modules else 'no torch')\n"
    )
    argvs = [f"ckpt|ls|{root}", f"ckpt|ls|{run}", f"ckpt|verify|{run}", f"ckpt|show|{step}"]
    proc = subprocess.run([sys.executable, "-c", script, *argvs], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "no torch", proc.stdout


def test_ls_verify_show_of_a_missing_path_say_it_does_not_exist(tmp_path: Path) -> None:
    for verb in ("ls", "verify", "show"):
        line = one_line(cli("ckpt", verb, str(tmp_path / "nowhere")))
        assert line.endswith(f"{tmp_path / 'nowhere'}: does not exist"), line
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no checkpoints here" in one_line(cli("ckpt", "ls", str(empty)))


def test_verify_of_a_checkpoint_root_names_its_runs(root: Path) -> None:
    line = one_line(cli("ckpt", "verify", str(root)))
    assert "a checkpoint root (runs job); name a run" in line


# -- fail fast: --checkpoint and --resume-from -----------------------------------------------------


def _fast_one_line(proc: subprocess.CompletedProcess, started: float, expected: str) -> None:
    elapsed = time.monotonic() - started
    line = one_line(proc)
    assert expected in line, line
    assert proc.returncode == 2, proc
    # Seconds: an interpreter importing torch (14 s seen on a loaded 2-core machine), not a training run.
    assert elapsed < 60, f"took {elapsed:.1f}s"


def test_run_refuses_a_checkpoint_root_that_is_a_file(etcd_server: Any, tmp_path: Path) -> None:
    afile = tmp_path / "ckpt.bin"
    afile.write_text("not a directory")
    for url, expected in ((afile, "is a file, not a directory"), (afile / "sub", f"{afile} is a file")):
        t = time.monotonic()
        proc = cli("run", "--endpoint", etcd_server.endpoint, "--run-id", "ff", "--checkpoint", str(url))
        _fast_one_line(proc, t, expected)
    assert afile.read_text() == "not a directory"


def test_run_refuses_a_resume_source_that_does_not_exist(etcd_server: Any, tmp_path: Path) -> None:
    t = time.monotonic()
    proc = cli(
        "run", "--endpoint", etcd_server.endpoint, "--run-id", "ff", "--checkpoint", str(tmp_path / "c"),
        "--resume-from", "/nonexistent",
    )  # fmt: skip
    _fast_one_line(proc, t, "resume_from /nonexistent: does not exist")
    assert not (tmp_path / "c").exists(), "nothing was created"


def test_run_refuses_a_resume_source_without_a_valid_checkpoint(
    etcd_server: Any, root: Path, tmp_path: Path
) -> None:
    for step in STEPS:
        tamper(root / "job" / step, TAMPERED["shape-vs-nbytes"][0])
    common = [
        "run",
        "--endpoint",
        etcd_server.endpoint,
        "--run-id",
        "ff",
        "--checkpoint",
        str(tmp_path / "c"),
    ]
    t = time.monotonic()
    proc = cli(*common, "--resume-from", str(root / "job"))
    _fast_one_line(proc, t, "no valid checkpoint (step-00000006: invalid manifest: tensors.0: ")
    t = time.monotonic()
    proc = cli(*common, "--resume-from", str(root))
    _fast_one_line(proc, t, "is a checkpoint root holding runs job; name one")


def test_local_checks_before_starting_anything(tmp_path: Path) -> None:
    afile = tmp_path / "ckpt.bin"
    afile.write_text("x")
    t = time.monotonic()
    proc = cli("local", "--nodes", "1", "--steps", "4", "--checkpoint", str(afile), cwd=tmp_path)
    _fast_one_line(proc, t, "is a file, not a directory")
    t = time.monotonic()
    proc = cli("local", "--nodes", "1", "--steps", "4", "--resume-from", "/nonexistent", cwd=tmp_path)
    _fast_one_line(proc, t, "resume_from /nonexistent: does not exist")
    assert sorted(os.listdir(tmp_path)) == ["ckpt.bin"], "no run directory, no logs: nothing started"


def test_plain_worker_fails_at_start(tmp_path: Path) -> None:
    """A worker under plain torchrun (no launcher): the mistake ends it before training, not at the first
    save or after retries."""
    afile = tmp_path / "ckpt.bin"
    afile.write_text("x")
    # Its first save would come after a million steps: failing within seconds means failing at start.
    common = [*TASK, "--set", "rendezvous.run_id=pw", "--steps", "1000000", "--checkpoint-every", "1000000"]
    t = time.monotonic()
    proc = cli(*common, "--checkpoint", str(afile), module="elastic_train.worker")
    _fast_one_line(proc, t, "is a file, not a directory")
    t = time.monotonic()
    proc = cli(
        *common,
        "--checkpoint",
        str(tmp_path / "c"),
        "--resume-from",
        "/nonexistent",
        module="elastic_train.worker",
    )
    _fast_one_line(proc, t, "resume_from /nonexistent: does not exist")
