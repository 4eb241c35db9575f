"""Stale writers never win: a world that is no longer current cannot make its checkpoint the newest, nor
touch a checkpoint of the current world — also when its upload lands after the new world committed.

Real files on a local directory; the stale world's manifest upload is held back by a slow-store wrapper
until the new world has restored and committed. The publish gate is the agent's answer, played here by a
shared record of the current round (the agent side is tested in tests/integration/test_partition.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager, WriteFailed, durable
from elastic_train.checkpoint.policy import off_line, step_dir
from elastic_train.checkpoint.storage import open_storage
from elastic_train.node.gate import CURRENT, STALE, UNKNOWN
from elastic_train.node.gate import Link as AgentLink

pytestmark = pytest.mark.timeout(120)


class Coordinator:
    """The run's current round, as the agents' publish gate reads it from etcd."""

    def __init__(self, current: int) -> None:
        self.current = current
        self.answer: str | None = None  # force an answer (UNKNOWN: etcd unreachable)


class GateLink(AgentLink):
    def __init__(self, coord: Coordinator, round: int) -> None:
        super().__init__(None, round)
        self.coord = coord
        self.asked = 0

    def may_publish(self, timeout: float = 0) -> str:
        self.asked += 1
        if self.coord.answer is not None:
            return self.coord.answer
        return CURRENT if self.coord.current == self.round else STALE


class HeldManifests:
    """A slow store: manifest uploads wait until released (the rest goes through)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.waiting = threading.Event()
        self.release = threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def write_small(self, path: str, data: bytes) -> None:
        if path.endswith(durable.MANIFEST):
            self.waiting.set()
            assert self.release.wait(60), "the test never released the held upload"
        self._inner.write_small(path, data)


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(64)}, "step": step}


def manager(url: str, memdir: str, link: AgentLink, **kw: Any) -> CheckpointManager:
    c = CheckpointConfig(url=url, memory_dir=memdir, memory=False, every_steps=1, keep_last=10, **kw)
    return CheckpointManager(c, "run", rank=0, world_size=1, local_rank=0, link=link)


def digest_tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def test_a_late_stale_upload_never_becomes_newest_nor_touches_the_new_worlds_checkpoints(
    tmp_path: Path, memdir: str
) -> None:
    url = str(tmp_path / "ckpt")
    coord = Coordinator(current=3)
    old = manager(url, memdir, GateLink(coord, 3), async_write=True)
    assert old.restore() is None
    for step in (1, 2, 3, 4):
        old.save(step, state(step))
    old.wait()
    slow = HeldManifests(old.storage)
    old.storage = slow
    old.save(5, state(5))  # its shares are written, the manifest upload hangs
    assert slow.waiting.wait(30)

    # The world is re-formed without the old one (its node was cut off): round 4 starts from step 4.
    coord.current = 4
    new = manager(url, memdir, GateLink(coord, 4), async_write=False)
    restored = new.restore()
    assert restored is not None and restored.step == 4 and new.base == 4
    new.save(5, state(50))
    run = tmp_path / "ckpt" / "run"
    assert (run / step_dir(5, 4) / durable.MANIFEST).exists()
    before = digest_tree(run / step_dir(5, 4))

    slow.release.set()  # the stale upload lands now, after the new world's commit
    old.wait()
    old.close()
    assert (run / step_dir(5, 3) / durable.MANIFEST).exists()  # it did land ...

    storage = open_storage(url)
    entries = durable.list_entries(storage, str(run))
    stale = next(e for e in entries if e.path.endswith(step_dir(5, 3)))
    assert stale.problem is not None  # the new world's commit swept its unfinished directory first
    newest = durable.newest_valid(storage, str(run))
    assert newest is not None and newest.path.endswith(step_dir(5, 4))  # ... but never wins
    assert digest_tree(run / step_dir(5, 4)) == before  # and touched nothing of the new world
    assert (run / durable.LATEST).read_text().strip() == step_dir(5, 4)  # nor moved `latest`

    # The stale world's step 6 gets no manifest at all (the gate says stale before publishing).
    late = manager(url, memdir, GateLink(coord, 3), async_write=False)
    late.save(6, state(6))
    assert not (run / step_dir(6, 3) / durable.MANIFEST).exists()

    # A restart restores the new world's step 5, and the new world's next commit removes the stale ones.
    again = manager(url, memdir, GateLink(coord, 4), async_write=False)
    r = again.restore()
    assert r is not None and r.step == 5 and torch.equal(r.state["model"]["w"], state(50)["model"]["w"])
    new.save(6, state(60))
    names = sorted(os.listdir(run))
    assert step_dir(5, 3) not in names and step_dir(6, 3) not in names, names


def test_a_complete_stale_checkpoint_landing_before_the_new_worlds_first_commit_is_left_behind(
    tmp_path: Path, memdir: str
) -> None:
    url = str(tmp_path / "ckpt")
    coord = Coordinator(current=3)
    old = manager(url, memdir, GateLink(coord, 3), async_write=True)
    old.restore()
    for step in (1, 2):
        old.save(step, state(step))
    old.wait()
    slow = HeldManifests(old.storage)
    old.storage = slow
    old.save(3, state(3))
    assert slow.waiting.wait(30)
    coord.current = 4
    new = manager(url, memdir, GateLink(coord, 4), async_write=False)
    r = new.restore()  # round 4 starts from step 2 and records it; it has committed nothing yet
    assert r is not None and r.step == 2
    slow.release.set()
    old.wait()
    old.close()
    run = tmp_path / "ckpt" / "run"
    storage = open_storage(url)
    (stale,) = [e for e in durable.list_entries(storage, str(run)) if e.step == 3]
    assert stale.manifest is not None and stale.problem == (
        "written by round 3, left behind: round 4 restarted from step 2"
    )
    newest = durable.newest_valid(storage, str(run))
    assert newest is not None and newest.step == 2
    again = manager(url, memdir, GateLink(coord, 4), async_write=False).restore()
    assert again is not None and again.step == 2


def test_unconfirmed_rounds_skip_regular_checkpoints_but_not_the_final_one(
    tmp_path: Path, memdir: str
) -> None:
    url = str(tmp_path / "ckpt")
    coord = Coordinator(current=2)
    coord.answer = UNKNOWN  # etcd does not answer the agent
    m = manager(url, memdir, GateLink(coord, 2), async_write=False, retries=1)
    m.restore()
    m.save(1, state(1))  # training goes on; the checkpoint waits for a later save
    run = tmp_path / "ckpt" / "run"
    assert not (run / step_dir(1, 2) / durable.MANIFEST).exists()
    m.finalize(2, state(2))  # the job's result is published (the lineage rule still guards it)
    assert (run / step_dir(2, 2) / durable.MANIFEST).exists()


def test_a_stale_world_never_publishes_its_final_checkpoint(tmp_path: Path, memdir: str) -> None:
    coord = Coordinator(current=3)
    m = manager(str(tmp_path / "ckpt"), memdir, GateLink(coord, 2), async_write=False, retries=1)
    m.restore()
    with pytest.raises(WriteFailed, match="round 2 is no longer the run's current round"):
        m.finalize(1, state(1))
    assert not (tmp_path / "ckpt" / "run" / step_dir(1, 2) / durable.MANIFEST).exists()


def test_outside_an_agent_names_and_manifests_stay_as_they_were(tmp_path: Path, memdir: str) -> None:
    m = manager(str(tmp_path / "ckpt"), memdir, AgentLink(None, None), async_write=False)
    m.restore()
    m.save(1, state(1))
    manifest = (tmp_path / "ckpt" / "run" / "step-00000001" / durable.MANIFEST).read_text()
    assert '"round"' not in manifest and '"base"' not in manifest


def test_off_line_rule() -> None:
    # (step, round, base): round 4 restarted from step 4, so round 3's step 5 and 6 are off the line;
    # its step 4 and the unstamped checkpoint are not.
    cps = [(4, 3, 0), (5, 3, 0), (6, 3, 0), (5, 4, 4), (7, None, None)]
    assert off_line(cps) == {1: (4, 4), 2: (4, 4)}
    # A later world that restarted from the stale step itself keeps it on the line.
    assert off_line([(5, 3, 0), (6, 4, 5)]) == {}


def test_a_reused_run_id_starting_again_at_round_1_comes_after_the_earlier_worlds(
    tmp_path: Path, memdir: str
) -> None:
    url = str(tmp_path / "ckpt")
    earlier = manager(url, memdir, GateLink(Coordinator(current=7), 7), async_write=False)
    earlier.restore()
    for step in (1, 2, 3):
        earlier.save(step, state(step))
    # The run's record expired; the same run id starts again at rendezvous round 1 and resumes step 3.
    again = manager(url, memdir, GateLink(Coordinator(current=1), 1), async_write=False)
    r = again.restore()
    assert r is not None and r.step == 3 and again.stamp == 8
    again.save(4, state(4))
    storage = open_storage(url)
    newest = durable.newest_valid(storage, str(tmp_path / "ckpt" / "run"))
    assert newest is not None and newest.path.endswith(step_dir(4, 8)) and newest.round == 8
