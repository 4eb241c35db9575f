"""Destroyed process groups are freed on a thread of their own (a gloo group's C++ teardown waits for its
event loop's next poll): the registry forgets them at once, their connections close, and the process forms
its next group meanwhile."""

from __future__ import annotations

import textwrap
import threading
import time
from pathlib import Path

import pytest

from elastic_train import net
from elastic_train.net import free_port
from tests.unit.test_group_links import run_ranks


class Recorded:
    """Records the thread that drops its last reference."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def __del__(self) -> None:
        self.seen.append(threading.current_thread().name)


def test_free_groups_drops_the_last_references_on_another_thread() -> None:
    seen: list[str] = []
    groups = [Recorded(seen), None, Recorded(seen)]
    net.free_groups(groups)
    assert groups == []  # handed off: the caller holds nothing
    assert net.wait_groups_freed(timeout=30)
    assert seen == ["process-group-free", "process-group-free"]
    assert threading.current_thread().name not in seen


def test_free_groups_of_nothing_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []

    class Recording(threading.Thread):
        def start(self) -> None:
            started.append(self.name)
            super().start()

    monkeypatch.setattr(net.threading, "Thread", Recording)
    groups: list[object] = [None, None]
    net.free_groups(groups)
    assert started == [] and groups == []
    net.free_groups([object()])
    assert started == ["process-group-free"]  # the recording itself works
    assert net.wait_groups_freed(timeout=30)


CHILD = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    from elastic_train import net
    from elastic_train.train import group

    out, second_port = sys.argv[1], sys.argv[2]
    world = group.init("gloo")
    made, links = net.opened_by(lambda: [dist.new_group(backend="gloo") for _ in range(3)])
    x = torch.ones(2)
    for i in range(3):
        dist.all_reduce(x, group=made[i])
    errors = net.destroy_groups(made)
    registered = [dist.get_world_size(dist.group.WORLD)]  # the default group stays
    group.shutdown()
    initialized = dist.is_initialized()
    os.environ["MASTER_PORT"] = second_port
    world = group.init("gloo")  # the next group forms while the old ones are freed
    y = torch.ones(2) * (world.rank + 1)
    dist.all_reduce(y)
    freed = net.wait_groups_freed(timeout=60)
    still_open = net.shut_down(links)  # the destroyed groups' own sockets: all closed by now
    group.shutdown()
    assert net.wait_groups_freed(timeout=60)
    json.dump({"errors": errors, "made_left": len(made), "registered": registered, "initialized": initialized,
               "sum": y.tolist(), "freed": freed, "links": len(links), "still_open": still_open},
              open(out, "w"))
    """
)


def test_destroyed_gloo_groups_close_their_connections_while_the_next_group_forms(tmp_path: Path) -> None:
    for got in run_ranks(CHILD, tmp_path, str(free_port())):
        assert got["errors"] == [] and got["made_left"] == 0
        assert got["registered"] == [2] and got["initialized"] is False
        assert got["sum"] == [3.0, 3.0]
        assert got["freed"] is True
        assert got["links"] >= 3  # each of the three groups connects to the other rank
        assert got["still_open"] == 0


def test_wait_groups_freed_times_out_on_a_group_still_being_freed() -> None:
    release = threading.Event()

    class Slow:
        def __del__(self) -> None:
            release.wait(30)

    net.free_groups([Slow()])
    started = time.monotonic()
    try:
        assert net.wait_groups_freed(timeout=0.05) is False
    finally:
        release.set()
    assert net.wait_groups_freed(timeout=30)
    assert time.monotonic() - started < 30
