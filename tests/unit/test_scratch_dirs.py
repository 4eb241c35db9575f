"""An agent's scratch directories carry their owner; a later agent removes those of owners that are gone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_train import procs


def test_a_dead_owners_directories_are_swept_and_a_live_owners_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    child = subprocess.run(
        [sys.executable, "-c", "from elastic_train.procs import scratch_dir; print(scratch_dir('reform'))"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    dead = Path(child.stdout.strip())
    assert dead.parent == tmp_path and dead.is_dir()
    (dead / "ready-0.json").write_text("{}")
    reused = tmp_path / f"elastic_train-reform-{os.getpid()}-1-abcdefgh"  # this PID, another start time
    reused.mkdir()
    other_kind = tmp_path / "elastic_train-outcome-4194305-1-abcdefgh"  # a PID above pid_max
    other_kind.mkdir()
    unrelated = tmp_path / "elastic_train-reform-notapid"
    unrelated.mkdir()
    legacy = tmp_path / "elastic_train-reform-4194305-k2x9abcd"  # an older version's name, owner gone
    legacy.mkdir()
    legacy_live = tmp_path / f"elastic_train-reform-{os.getpid()}-k2x9abcd"
    legacy_live.mkdir()
    socket_of_dead = tmp_path / "elastic_train-fs-4194305-1.sock"
    socket_of_dead.touch()

    mine = Path(procs.scratch_dir("reform"))

    assert mine.is_dir() and mine.name.startswith(f"elastic_train-reform-{os.getpid()}-")
    assert not dead.exists() and not reused.exists() and not legacy.exists()
    assert legacy_live.exists()
    assert Path(procs.scratch_path("fs", ".sock")).name.startswith(f"elastic_train-fs-{os.getpid()}-")
    assert not socket_of_dead.exists()
    assert other_kind.exists() and unrelated.exists()  # another kind, not an owner's name: left alone
    assert procs.sweep_scratch("reform") == []  # its own live directory stays
    assert mine.is_dir()


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux's /proc gives the start tick")
def test_an_owners_identity_does_not_move_with_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """psutil's ``create_time`` adds a boot time the kernel derives from the wall clock, which steps when the
    clock is adjusted: an identity built on it would call every live owner gone, and its snapshots swept."""
    import psutil

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        mine, theirs = procs.start_ms(os.getpid()), procs.start_ms(child.pid)
        assert theirs >= mine
        real = psutil.Process.create_time
        monkeypatch.setattr(psutil.Process, "create_time", lambda self: real(self) + 15.0)  # a clock step
        assert procs.owner_alive(child.pid, theirs)
        assert procs.start_ms(os.getpid()) == mine
        assert not procs.owner_alive(child.pid, theirs + 1)  # another start is another process
    finally:
        child.kill()
        child.wait()
    assert not procs.owner_alive(child.pid, theirs)
