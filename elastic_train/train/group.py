"""The process group of a worker, formed from torchrun's environment (:func:`init`), and its :class:`World`.

Used by the built-in worker and by scripts with their own loop alike (``elastic_train.init``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import types
from collections.abc import MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic_train import torchcompat
from elastic_train.errors import ElasticTrainError
from elastic_train.log import bind_context, configure_logging
from elastic_train.net import cut_extra_links, free_groups, free_port, opened_by, shut_down
from elastic_train.train.env import WorkerEnv
from elastic_train.train.errors import TrainingError
from elastic_train.train.link import process_link

#: Run id of the checkpoints when torchrun gives none (``TORCHELASTIC_RUN_ID`` unset: a plain process).
DEFAULT_RUN_ID = "default"
#: Seconds between two looks of a rank other than 0 at the group's store port while rank 0 opens it. torch's
#: own TCPStore client retries a refused connection only after about half a second (with jitter): a group
#: whose members start together (a re-formation, a restart) would pay it whenever rank 0 is a moment late.
STORE_POLL = 0.005
#: Seconds a rank waits for rank 0 to open the group's store (torch's default store timeout).
STORE_WAIT = 300.0
#: Seconds the last :func:`init` spent in each phase of forming its group: ``store_s`` (rank 0 opened the
#: store, the others reached it), ``pg_s`` (the process group itself: gloo's full-mesh connect).
last_formation: dict[str, float] = {}
#: The connections of the current gloo group to its peers: file descriptor -> socket inode, recorded when the
#: group formed (what :func:`init_process_group` opened, listeners left out) and cut by a broken group's
#: :func:`shutdown`.
_LINKS: dict[int, int] = {}
#: The round of the group :data:`_LINKS` belongs to (-1: none recorded).
_LINKS_ROUND = [-1]
#: Orders recording and cutting: a watcher thread may cut while the training thread re-forms.
_LINKS_LOCK = threading.Lock()
#: The NCCL watchdog mode hot recovery needs: abort the failed communicator and raise on the training thread
#: (torch's ``ErrorHandlingMode::CleanUpOnly``); torch's default (3, ``SkipCleanUp``) takes the process down.
NCCL_CLEAN_UP_ONLY = "2"
ENV_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def nccl_error_handling(environ: MutableMapping[str, str], reform: bool) -> None:
    """Under an agent that re-forms in-process (``reform``), make NCCL's watchdog abort a failed communicator
    and raise instead of ending the process (unless the user chose a mode: then hot recovery leaves NCCL
    groups to the restart path, ``hot.Reformer.register``). torch reads the variable when an NCCL group
    forms: :func:`init` calls this first."""
    if reform:
        environ.setdefault(ENV_NCCL_ERROR_HANDLING, NCCL_CLEAN_UP_ONLY)


@dataclass(frozen=True, slots=True)
class World:
    """This process's place in the current worker group (what :func:`init` formed)."""

    rank: int
    """Global rank."""
    world_size: int
    """Processes in the group."""
    local_rank: int
    """Rank on this node (the CUDA device index with NCCL)."""
    local_world_size: int
    """Processes on this node."""
    device: torch.device
    """Where this rank trains: ``cuda:LOCAL_RANK`` with NCCL, the CPU with gloo."""
    backend: str
    """Process-group backend (``gloo`` or ``nccl``)."""
    round: int
    """Rendezvous round of the group (grows with every restart; audit lines and events carry it)."""
    run_id: str
    """Checkpoints go to ``URL/run_id``: torchrun's ``--rdzv-id``, or ``"default"`` outside torchrun."""
    restart_count: int
    """How often this node's agent restarted its workers."""

    @property
    def device_ids(self) -> list[int] | None:
        """``device_ids`` for ``DistributedDataParallel``: ``[index]`` on a GPU, None on the CPU."""
        return [self.device.index or 0] if self.device.type == "cuda" else None

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (where one-per-job things such as printing go)."""
        return self.rank == 0


_WORLD: World | None = None


def resolve_backend(requested: str, cuda: bool) -> str:
    """``auto`` → nccl when CUDA is usable, gloo otherwise.

    Raises:
        ValueError: ``requested`` is not auto, gloo or nccl.
    """
    if requested not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend: {requested!r} is not one of auto, gloo, nccl")
    if requested == "auto":
        return "nccl" if cuda else "gloo"
    return requested


def init(backend: str = "auto", *, timeout: timedelta | None = None, env: WorkerEnv | None = None) -> World:
    """Form the default process group from torchrun's environment; idempotent.

    The backend is NCCL on ``cuda:LOCAL_RANK`` when a GPU is visible (``torch.cuda.set_device`` first),
    gloo on the CPU otherwise. When torchrun hands its workers the agent's long-lived TCPStore
    (``TORCHELASTIC_USE_AGENT_STORE=True``, torch's own dynamic rendezvous), keys are prefixed with the
    group's round, so a restarted group never reads the gloo addresses of the one before. Without torchrun's
    variables (``RANK`` unset) this is a world of one on loopback. A group the script formed itself is
    adopted as is.

    Also configures logging when nothing else did, and renders elastic_train's own errors that reach the top
    of the script as one line (``SCRIPT: error: rank R: ...``) instead of a traceback.

    Args:
        backend: ``auto``, ``gloo`` or ``nccl``.
        timeout: collective timeout of the group (torch's default when None).
        env: torchrun's variables, parsed (default: from ``os.environ``).

    Raises:
        ConfigError: torchrun's variables are inconsistent or not integers.
        TrainingError: ``nccl`` asked for without a visible GPU.
    """
    global _WORLD
    if _WORLD is not None and dist.is_initialized():
        return _WORLD
    link = process_link()
    env = env or WorkerEnv.from_environ(os.environ, link.assignment)
    import structlog

    if not structlog.is_configured():
        configure_logging()
    _install_excepthook()
    cuda = torch.cuda.is_available()
    if dist.is_initialized():  # the script formed the group itself: adopt it
        chosen = str(dist.get_backend())
        on_gpu = chosen == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        chosen = resolve_backend(backend, cuda)
        if chosen == "nccl":
            if not cuda:
                raise TrainingError("backend nccl needs CUDA, and no GPU is visible")
            device = torch.device("cuda", env.local_rank)
            torch.cuda.set_device(device)
            nccl_error_handling(os.environ, link.reform)
        else:
            device = torch.device("cpu")
        _form_group(chosen, device, env, timeout)
        rank, world_size = env.rank, env.world_size
    _WORLD = World(
        rank=rank,
        world_size=world_size,
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        device=device,
        backend=chosen,
        round=env.round,
        run_id=env.run_id or DEFAULT_RUN_ID,
        restart_count=env.restart_count,
    )
    bind_context(rank=rank, world_size=world_size, round=env.round)
    return _WORLD


def _form_group(backend: str, device: torch.device, env: WorkerEnv, timeout: timedelta | None) -> None:
    started = time.perf_counter()
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    generation = env.group_generation
    if env.agent_store and generation is not None:
        # torch's dynamic rendezvous hands workers the agent's TCPStore, which outlives worker groups: keys of
        # an earlier group (gloo peer addresses) would be read by the next one; a per-group prefix avoids it.
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False)
        kwargs["store"] = dist.PrefixStore(f"elastic_train/{generation}/", store)
    elif env.master_port == 0:  # a world of one outside torchrun: a store of its own on a free port
        assert env.world_size == 1, "MASTER_PORT is required for a multi-process group"
        kwargs["init_method"] = f"tcp://{env.master_addr}:{free_port(env.master_addr)}"
    else:
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
        kwargs["store"] = _open_store(env, timeout)
    formed = time.perf_counter()

    def form() -> None:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, **kwargs)

    if backend == "gloo":
        _, opened = opened_by(form)
        with _LINKS_LOCK:
            _LINKS.clear()
            _LINKS.update(opened)
            _LINKS_ROUND[0] = env.round
    else:
        form()
    last_formation.clear()
    last_formation.update(store_s=formed - started, pg_s=time.perf_counter() - formed)


def _open_store(env: WorkerEnv, timeout: timedelta | None) -> dist.Store:
    """The group's bootstrap store at MASTER_ADDR:MASTER_PORT: rank 0 hosts it, the others connect once it
    listens (what ``env://`` does, without torch's half-second retry when rank 0 is a moment late).

    Raises:
        TrainingError: rank 0 did not open the store within the store timeout.
    """
    wait = timeout or timedelta(seconds=STORE_WAIT)
    if env.rank == 0:
        return dist.TCPStore(
            env.master_addr, env.master_port, env.world_size, is_master=True, timeout=wait,
            wait_for_workers=False, multi_tenant=True,
        )  # fmt: skip
    deadline = time.monotonic() + wait.total_seconds()
    while True:
        try:
            socket.create_connection((env.master_addr, env.master_port), timeout=1.0).close()
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TrainingError(
                    f"rank 0's store at {env.master_addr}:{env.master_port} did not open within "
                    f"{wait.total_seconds():g} s ({exc})"
                ) from exc
            time.sleep(STORE_POLL)
    return dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=wait)


def current_world() -> World:
    """The :class:`World` of this process: the one :func:`init` formed (forming it if nobody did)."""
    return _WORLD if _WORLD is not None and dist.is_initialized() else init()


def shutdown(*, broken: bool = False) -> None:
    """Take the process group down (a no-op without one): NCCL communicators are aborted, then destroyed.

    Call it at the end instead of ``destroy_process_group()``, after dropping the DDP model: a DDP reducer
    freed after its group is gone can abort the process (gloo: ``terminate called without an active
    exception``); this collects such garbage first.

    NCCL is aborted first because destroying a communicator finalizes it, which waits for every peer: on a
    dead peer (the group broke, hot recovery re-forms it) it never returns, and a collective still queued on
    the stream would spin on the device. Abort returns at once and releases the communicators; the CUDA
    context, the device's memory and everything on it stay. At a normal end every collective has completed
    (the loop waited on each), so the abort loses nothing. gloo is destroyed as before (its collectives fail
    on a dead peer's closed socket instead of waiting).

    ``broken``: the group failed (a peer died). gloo has no communicator abort, and its connections close
    only when the last reference to the group is gone: a peer blocked on this process in the failed
    collective (in a ring all-reduce, every rank not next to the dead one) would wait for it until its
    fence gave up on it. The group's connections are shut down first, so that such a peer fails at once
    and the failure reaches every rank of the group within a hop per rank.
    """
    global _WORLD
    import gc

    if broken:
        cut_links()
    gc.collect()
    if dist.is_initialized():
        if _backend_of_default_group() == "nccl":
            _abort_nccl()
        if dist.is_initialized():
            # gloo: the groups' C++ teardown (~10 ms each) runs beside the next group's formation
            doomed = torchcompat.process_groups() if _backend_of_default_group() == "gloo" else []
            dist.destroy_process_group()
            free_groups(doomed)
    _forget_meshes()
    _WORLD = None
    with _LINKS_LOCK:
        _LINKS.clear()


def cut_links(round: int | None = None) -> int:
    """Shut down the current gloo group's connections to its peers (both directions); returns how many.

    Only the sockets the group opened are touched: each is checked by inode, since gloo closes a failed
    pair's socket itself and its descriptor may by now belong to another connection of this process.
    ``round``: only if the group is that round's (another thread asks for a group that may have re-formed
    meanwhile). The connections other layers registered (:func:`elastic_train.net.add_extra_links`: the
    sharded checkpoint's replica group) are cut too.
    """
    with _LINKS_LOCK:
        if round is not None and _LINKS_ROUND[0] != round:
            return 0
        links = dict(_LINKS)
        _LINKS.clear()
    # and the groups other layers formed on it (a sharded checkpoint's replica exchange runs on the memory
    # tier's copier thread, on a group of its own: a stopped peer would block it past the cut)
    return shut_down(links) + cut_extra_links()


def _backend_of_default_group() -> str:
    return str(dist.get_backend()).lower()


def _abort_nccl() -> None:
    """Abort every NCCL communicator of this process (all groups, within one NCCL group call so that no
    abort waits on another); it also unregisters the groups."""
    torchcompat.abort_groups()


def _forget_meshes() -> None:
    """Drop DTensor's sharding-propagation caches (torch's Python and C++ ones) with the group.

    They key a device mesh by equality, which ignores this process's rank in it: after a group re-forms
    in-process with this process at another rank (a world of a size it trained at before), DTensors made
    by an operator — FSDP2's sharded parameters included (``nn.Parameter`` of a DTensor detaches it) —
    would carry the old group's mesh and so the old coordinate, and a DCP checkpoint written from them
    would hold overlapping chunks. Only when DTensor was imported (a DDP job never is).
    """
    if "torch.distributed.tensor" in sys.modules:
        torchcompat.clear_sharding_caches()


def _install_excepthook() -> None:
    """Render an :class:`ElasticTrainError` that ends the script as one line on stderr (exit code 1), and
    tell the worker's agent how the script ended (:meth:`.link.ProcessLink.report_exit`)."""
    previous = sys.excepthook
    if getattr(previous, "_elastic_train", False):
        return

    def hook(kind: type[BaseException], exc: BaseException, tb: types.TracebackType | None) -> None:
        with contextlib.suppress(Exception):  # best effort: the error itself is what must be seen
            process_link().report_exit(exc)
        if isinstance(exc, ElasticTrainError):
            rank = _WORLD.rank if _WORLD is not None else os.environ.get("RANK", "0")
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"
            sys.stderr.write(f"{prog}: error: rank {rank}: {exc}\n")
            sys.stderr.flush()
            return
        previous(kind, exc, tb)

    hook._elastic_train = True  # type: ignore[attr-defined]
    sys.excepthook = hook
