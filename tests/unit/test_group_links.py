"""A broken gloo group's connections are cut: a peer blocked on this process fails at once instead of waiting
for it (gloo keeps a group's sockets open while anything still refers to the group), and only the group's
own sockets are touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from elastic_train.net import free_port

CHILD = textwrap.dedent(
    """
    import json, os, socket, sys, time
    import torch
    import torch.distributed as dist
    from elastic_train.train import group

    out, flag = sys.argv[1], sys.argv[2]
    server = socket.create_server(("127.0.0.1", 0))
    outside = socket.create_connection(server.getsockname())  # opened before the group: not one of its links
    accepted, _ = server.accept()
    world = group.init("gloo")
    if world.rank == 0:
        open(out + ".ready0", "w").close()
        started = time.monotonic()
        try:
            dist.recv(torch.zeros(4), src=1)  # rank 1 never sends
            error = None
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        json.dump({"error": error, "blocked_s": time.monotonic() - started}, open(out, "w"))
        os._exit(0)
    while not os.path.exists(flag):
        time.sleep(0.01)
    cut = group.cut_links()
    outside.sendall(b"still open")
    echo = accepted.recv(64)
    json.dump({"cut": cut, "echo": echo.decode(), "again": group.cut_links()}, open(out, "w"))
    time.sleep(30)  # alive: only the cut can have failed rank 0's receive
    """
)


def start_rank(rank: int, port: int, script: str, *args: str) -> subprocess.Popen[bytes]:
    """Rank ``rank`` of a 2-rank group on loopback ``port``, running ``script`` with ``args``."""
    env = dict(
        os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=os.getcwd(),
    )  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env)


def run_ranks(script: str, tmp_path: Path, *args: str) -> list[Any]:
    """Both ranks of a 2-rank group running ``script`` with (its JSON output path, ``*args``) to the end
    (exit status 0 each); what each wrote."""
    port = free_port()
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = []
    try:
        for rank in range(2):
            procs.append(start_rank(rank, port, script, str(outs[rank]), *args))
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [json.loads(out.read_text()) for out in outs]


def test_cutting_a_groups_links_fails_a_peer_blocked_on_it(tmp_path: Path) -> None:
    port = free_port()
    flag = tmp_path / "cut-now"
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = []
    try:
        for rank in range(2):
            procs.append(start_rank(rank, port, CHILD, str(outs[rank]), str(flag)))
        deadline = time.monotonic() + 120
        while not Path(str(outs[0]) + ".ready0").exists():
            assert time.monotonic() < deadline, "the group did not form"
            assert procs[0].poll() is None and procs[1].poll() is None, "a rank failed to form the group"
            time.sleep(0.05)
        time.sleep(1.0)
        assert not outs[0].exists(), "rank 0's receive ended before anything was cut"
        flag.touch()
        assert procs[0].wait(timeout=30) == 0
        result = json.loads(outs[0].read_text())
        deadline = time.monotonic() + 30
        while not outs[1].exists():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cutter = json.loads(outs[1].read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert result["error"], "rank 0's receive did not fail"
    assert cutter["cut"] >= 1  # rank 1's connection(s) to rank 0
    assert cutter["again"] == 0  # forgotten once cut
    assert cutter["echo"] == "still open", "a socket outside the group was cut"


SELF_CUT = textwrap.dedent(
    """
    import json, os, sys, threading, time
    import torch
    import torch.distributed as dist
    from elastic_train.train import group

    out = sys.argv[1]
    world = group.init("gloo")
    if world.rank == 1:  # alive, never sends: a peer that stopped
        time.sleep(60)
        os._exit(0)
    other = group.cut_links(world.round + 1)  # a group that is not the current one: nothing
    cut = []
    cutter = threading.Timer(1.0, lambda: cut.append(group.cut_links(world.round)))
    cutter.start()
    started = time.monotonic()
    try:
        dist.recv(torch.zeros(4), src=1)
        error = None
    except RuntimeError as exc:
        error = str(exc).splitlines()[0]
    blocked_s = time.monotonic() - started
    cutter.join(30)  # the receive fails while cut_links still runs: its count comes after
    json.dump({"error": error, "blocked_s": blocked_s, "other": other, "cut": cut},
              open(out, "w"))
    os._exit(0)
    """
)


def test_a_rank_blocked_on_a_silent_peer_fails_once_another_thread_cuts_its_own_links(tmp_path: Path) -> None:
    """What a gloo worker's cut watcher does when its agent asks (a stopped peer): the training thread's
    collective with the silent peer fails; a cut for another round's group does nothing."""
    port = free_port()
    out = tmp_path / "rank0.json"
    procs = []
    try:
        for rank in range(2):
            procs.append(start_rank(rank, port, SELF_CUT, str(out)))
        assert procs[0].wait(timeout=120) == 0
        result = json.loads(out.read_text())
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert result["other"] == 0
    assert result["cut"] and result["cut"][0] >= 1
    assert result["error"], "the receive from the silent peer did not fail"
    assert result["blocked_s"] >= 0.9  # it failed because of the cut, not before
