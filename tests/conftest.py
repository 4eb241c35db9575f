"""Shared fixtures: real etcd servers on free loopback ports, a reaper for every process a test starts, a
shared-memory directory for checkpoint snapshots; and the order of the collection (known-slow tests first)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator

import pytest
import structlog

from elastic_train.etcd.server import EmbeddedEtcd, EtcdCluster, etcd_version, find_etcd_binary
from elastic_train.procs import kill_tree


def etcd_binaries() -> list[str]:
    """Every distinct etcd binary available here (bundled 3.5, Debian's 3.4, …), bundled first."""
    found: list[str] = []
    with contextlib.suppress(Exception):
        found.append(find_etcd_binary())
    for extra in (shutil.which("etcd"), "/usr/bin/etcd"):
        if (
            extra
            and os.access(extra, os.X_OK)
            and os.path.realpath(extra) not in map(os.path.realpath, found)
        ):
            found.append(extra)
    return found


@pytest.fixture
def etcd_server() -> Iterator[EmbeddedEtcd]:
    """A fresh single-member etcd (the default binary) for one test."""
    with EmbeddedEtcd() as server:
        yield server


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd on loopback (``.endpoint`` is the list of all three) for one test."""
    with EtcdCluster(3) as cluster:
        yield cluster


@pytest.fixture(params=etcd_binaries() or [None], ids=lambda b: etcd_version(b) if b else "none")
def any_etcd(request: pytest.FixtureRequest) -> Iterator[EmbeddedEtcd]:
    """A fresh etcd for each available server version (3.5 bundled, 3.4 from Debian when installed)."""
    if request.param is None:
        pytest.skip("no etcd binary")
    with EmbeddedEtcd(binary=request.param) as server:
        yield server


class Reaper:
    """Remembers processes a test started and kills their whole trees at teardown, pass or fail."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        kwargs.setdefault("start_new_session", True)
        return self.add(subprocess.Popen(*args, **kwargs))

    def reap(self) -> None:
        for proc in self.procs:
            kill_tree(proc.pid)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def memdir() -> Iterator[str]:
    """A private directory in /dev/shm (elsewhere a temporary one) for memory-tier snapshots."""
    d = tempfile.mkdtemp(prefix="et-ckpt-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def reaper() -> Iterator[Reaper]:
    r = Reaper()
    try:
        yield r
    finally:
        r.reap()


@pytest.fixture(autouse=True)
def _no_leaked_snapshots() -> Iterator[None]:
    """Remove shared-memory snapshots left by processes a test killed (their owner agent is gone)."""
    yield
    from elastic_train.checkpoint.shmfiles import sweep_stale

    sweep_stale("/dev/shm")


@pytest.fixture(scope="session", autouse=True)
def _no_snapshots_of_this_process() -> Iterator[None]:
    """At the session's end, remove snapshots owned by this test process: a script a test ran directly (a
    world of one, stopped before it finalized) names its parent, this process, as the owner, which the
    per-test sweep finds alive."""
    yield
    from elastic_train.checkpoint.shmfiles import owned_by

    for path in owned_by("/dev/shm", os.getpid()):
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.fixture(autouse=True)
def _restored_environ() -> Iterator[None]:
    """Give every test the environment the session started with.

    Code under test may set process-wide variables (the etcd3 rendezvous handler names its node's directory
    for the workers an agent starts, ``ELASTIC_TRAIN_NODE_DIR``); left behind, they reach every process a
    later test starts and change what it does. The process's link to its agent, made from the environment
    on first use, is made afresh too.
    """
    from elastic_train.train.link import use_process_link

    saved = dict(os.environ)
    yield
    use_process_link(None)
    for key in set(os.environ) - set(saved):
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _fresh_logging() -> Iterator[None]:
    """Undo any logging set-up a test (or a CLI main() it ran) made: its stream is closed after the test."""
    yield
    import logging

    structlog.reset_defaults()
    structlog.contextvars.clear_contextvars()
    for handler in list(logging.root.handlers):
        logging.root.removeHandler(handler)


# -- order: the known-slow tests first, spread over the xdist workers ---------------------------------------

#: Seconds each known-slow test took in a whole-suite run (tests/durations.py writes it from a JUnit report).
DURATIONS = os.path.join(os.path.dirname(__file__), "durations.json")


@pytest.hookimpl(trylast=True)  # after -k/-m deselection: the slices are cut from what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Lay the collection out so that each xdist worker starts with its share of the slow tests.

    ``--dist worksteal`` hands worker *k* the *k*-th contiguous slice of the collection and later lets an idle
    worker steal the tail of the longest queue. In file order the multi-minute end-to-end tests cluster in a
    few slices and one of them starts last, so the run ends waiting on it alone. Here the known-slow tests
    are dealt out longest first to the least loaded slice (by known seconds) and put at the head of their
    slice, in that order; every other test keeps its order and fills the slices. Without xdist, slow first.
    """
    try:
        with open(DURATIONS, encoding="utf-8") as f:
            known: dict[str, float] = json.load(f)
    except FileNotFoundError:
        return
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    slow = sorted((i for i in items if i.nodeid in known), key=lambda i: -known[i.nodeid])
    rest = [i for i in items if i.nodeid not in known]
    sizes = slice_sizes(len(items), workers)
    slices: list[list[pytest.Item]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    for item in slow:
        open_slices = [k for k in range(len(sizes)) if len(slices[k]) < sizes[k]]
        k = min(open_slices, key=lambda k: load[k])
        slices[k].append(item)
        load[k] += known[item.nodeid]
    fill = iter(rest)
    for k, size in enumerate(sizes):
        slices[k].extend(next(fill) for _ in range(size - len(slices[k])))
    items[:] = [item for s in slices for item in s]


def slice_sizes(n: int, workers: int) -> list[int]:
    """The sizes of the first slices pytest-xdist's worksteal scheduler sends to ``workers`` idle workers."""
    sizes = []
    for i in range(workers):
        sizes.append(n // (workers - i))
        n -= sizes[-1]
    return sizes
