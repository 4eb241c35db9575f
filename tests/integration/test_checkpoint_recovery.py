"""Multi-process checkpoint recovery: kill -9 mid-save, shared memory surviving a kill, world 3 → 2 and 4."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.shmfiles import snapshot_files
from elastic_train.checkpoint.storage import open_storage
from elastic_train.net import free_port

WORKER = Path(__file__).with_name("ckpt_worker.py")
_spec = importlib.util.spec_from_file_location("ckpt_worker", WORKER)
assert _spec is not None and _spec.loader is not None
ckpt_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ckpt_worker)


def launch(reaper, world: int, out: Path, *args: str) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "ELASTIC_TRAIN_LOG_LEVEL": "warning",
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            reaper.popen(
                [sys.executable, str(WORKER), "--out", str(out), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    return procs


def finish(procs: list[subprocess.Popen], out: Path, timeout: float = 180) -> list[dict]:
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        assert p.returncode == 0, err.decode()[-3000:]
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(len(procs))]


def wait_line(proc: subprocess.Popen, word: str, timeout: float = 120) -> None:
    """Read the worker's stdout (raw, unbuffered on our side) until ``word`` appears."""
    import selectors
    import time

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    seen = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=1):
            chunk = os.read(fd, 65536)
            seen += chunk
            if word.encode() in seen:
                return
            if not chunk and proc.poll() is not None:
                break
    raise AssertionError(f"worker never printed {word}: {seen.decode(errors='replace')[-2000:]}")


def test_kill_mid_save_never_loads_torn_checkpoint(tmp_path, memdir, reaper):
    url = str(tmp_path / "ckpt")
    # keep_last 1: the commit of step 4 retires step 2's share into the pool, and the save of step 6 tears
    # while overwriting that very file in place (so the torn file has the full size of a good share).
    (p,) = launch(
        reaper,
        1,
        tmp_path / "a",
        "--url",
        url,
        "--memdir",
        memdir,
        "--steps",
        "6",
        "--every",
        "2",
        "--keep-last",
        "1",
        "--mem-every",
        "0",
        "--tear-step",
        "6",
        "--finish",
        "hang",
    )
    wait_line(p, "MIDWRITE")
    p.kill()
    p.wait(timeout=30)
    storage = open_storage(url)
    root = storage.join(storage.root, "run")
    entries = {e.step: e for e in durable.list_entries(storage, root)}
    assert entries[4].valid and not entries[6].valid and "no manifest" in (entries[6].problem or "")
    assert entries[4].manifest is not None
    full = entries[4].manifest["files"][0]["size"]
    (torn,) = os.listdir(entries[6].path)
    assert os.path.getsize(os.path.join(entries[6].path, torn)) == full  # the recycled file, half rewritten
    assert storage.listdir(durable.pool_path(storage, root)) == []  # it was claimed from the pool
    # A new worker resumes from step 4 (the torn step 6 is skipped) and its next save is not blocked.
    procs = launch(
        reaper,
        1,
        tmp_path / "b",
        "--url",
        url,
        "--memdir",
        memdir,
        "--steps",
        "7",
        "--every",
        "3",
        "--mem-every",
        "0",
    )
    (res,) = finish(procs, tmp_path / "b")
    assert res["restored"] == {"step": 4, "source": "durable", "holder": None}
    assert res["sum"] == pytest.approx(ckpt_worker.reference(7), rel=1e-6)
    entries = {e.step: e for e in durable.list_entries(storage, root)}
    assert entries[6].valid and entries[7].valid
    assert not durable.verify(storage, entries[6].path)
    assert durable.POOL not in os.listdir(root)  # the final checkpoint empties the pool


def test_memory_snapshot_survives_kill_and_is_used(tmp_path, memdir, reaper):
    url = str(tmp_path / "ckpt")
    (p,) = launch(
        reaper,
        1,
        tmp_path / "a",
        "--url",
        url,
        "--memdir",
        memdir,
        "--steps",
        "5",
        "--every",
        "0",
        "--finish",
        "hang",
    )
    wait_line(p, "READY")
    p.kill()
    p.wait(timeout=30)
    assert len(snapshot_files(memdir, "run")) == 1
    procs = launch(
        reaper, 1, tmp_path / "b", "--url", url, "--memdir", memdir, "--steps", "8", "--every", "0"
    )
    (res,) = finish(procs, tmp_path / "b")
    assert res["restored"] == {"step": 5, "source": "memory", "holder": 0}
    assert res["sum"] == pytest.approx(ckpt_worker.reference(8), rel=1e-6)
    assert snapshot_files(memdir, "run") == []  # finalize released it


@pytest.mark.slow
def test_save_at_world_3_resume_at_2_and_4(tmp_path, memdir, reaper):
    url = str(tmp_path / "ckpt")
    # world 3: durable every 4 steps; finish with close() so the shared-memory snapshots (step 6) stay.
    res3 = finish(
        launch(
            reaper,
            3,
            tmp_path / "w3",
            "--url",
            url,
            "--memdir",
            memdir,
            "--steps",
            "6",
            "--every",
            "4",
            "--finish",
            "close",
        ),
        tmp_path / "w3",
    )
    assert {r["restored"] is None for r in res3} == {True}
    storage = open_storage(url)
    (entry,) = [e for e in durable.list_entries(storage, storage.join(storage.root, "run")) if e.valid]
    assert entry.step == 4 and entry.manifest is not None and entry.manifest["world_size"] == 3
    assert len(entry.manifest["files"]) == 3  # each rank wrote a share
    assert len(snapshot_files(memdir, "run")) == 3

    # world 4 on the same node: local ranks 0-2 hold step 6 in shared memory, rank 3 gets it by broadcast.
    res4 = finish(
        launch(
            reaper,
            4,
            tmp_path / "w4",
            "--url",
            url,
            "--memdir",
            memdir,
            "--steps",
            "9",
            "--every",
            "4",
            "--finish",
            "finalize",
        ),
        tmp_path / "w4",
    )
    assert [r["restored"] for r in res4] == [{"step": 6, "source": "memory", "holder": 0}] * 4
    assert {round(r["sum"], 9) for r in res4} == {round(ckpt_worker.reference(9), 9)}
    assert snapshot_files(memdir, "run") == []

    # world 2 with no shared memory left: the durable checkpoint of step 9 (finalize at world 4) is used.
    res2 = finish(
        launch(
            reaper,
            2,
            tmp_path / "w2",
            "--url",
            url,
            "--memdir",
            memdir,
            "--steps",
            "11",
            "--every",
            "4",
            "--mem-every",
            "0",
        ),
        tmp_path / "w2",
    )
    assert [r["restored"] for r in res2] == [{"step": 9, "source": "durable", "holder": None}] * 2
    assert {round(r["sum"], 9) for r in res2} == {round(ckpt_worker.reference(11), 9)}
