"""Every private name of torch that elastic_train uses, in one place: a torch upgrade breaks here or nowhere.

torch gives a rendezvous handler neither the agent that calls it nor the launch configuration, and a few
things a running process needs have no public spelling yet. Each is reached only through this module:

==================================================  ==========================================================
torch's private name                                why, and what uses it
==================================================  ==========================================================
frame walk (``sys._getframe``) to the local         the hot path and a standby start update torchrun's record
``worker_group`` and ``self`` of the agent's        of its worker group after a round formed in-process
``SimpleElasticAgent._rendezvous`` (and callers)    (:class:`TorchrunAgent`): torch passes the handler nothing
``SimpleElasticAgent._assign_worker_ranks``         the agents of a round formed in-process exchange their
                                                    workers' global ranks as torchrun's own path does, so its
                                                    exit barrier and monitoring follow the new round
``SimpleElasticAgent._store``                       the agent's store of the current round (its exit barrier
                                                    runs on it)
``SimpleElasticAgent._exit_barrier``                an agent whose workers finished the run while it was
                                                    stopping them for a change waits in the round's exit
                                                    barrier as if they had exited first
                                                    (:meth:`TorchrunAgent.exit_barrier`)
``agent.server.api._RoleInstanceInfo`` and the      what ``_assign_worker_ranks`` writes first, written ahead
raw key ``torchelastic/role_info/<rank>``           so that a member waiting for the others' parts does not
                                                    block in the store on a dead one
frame walk to the ``config`` (a ``LaunchConfig``)   processes per node, part of a plain-torchrun node's job
of ``launch_agent``                                 identity (:func:`torchrun_nproc_per_node`)
frame walk to the ``run_result`` (a ``RunResult``)  how torchrun's workers exited (code, error file) when the
of ``SimpleElasticAgent._invoke_run``               agent restarts them (:func:`torchrun_failures`)
``distributed_c10d._abort_process_group``           abort every NCCL communicator in one NCCL group call
                                                    before a broken group is destroyed (:func:`abort_groups`)
``OptimizedModule._orig_mod``                       the module inside a ``torch.compile`` wrapper, whose
                                                    state-dict keys are the model's own (:func:`uncompiled`)
module ``torch._dynamo``                            preloaded by the fork server: the first ``Optimizer()``
                                                    imports it, over a second on its own (:data:`PRELOAD`)
``torch._foreach_copy_``                            the memory snapshot's batched copy of many tensors in one
                                                    call (:func:`foreach_copy`, :func:`foreach_copy_op`)
``distributed.checkpoint._fsspec_filesystem.``     DCP's writer to an fsspec URL, which the sharded tier's
``FsspecWriter``                                    durable checkpoint of a remote root writes through
                                                    (:func:`dcp_fsspec_writer`)
``filesystem._StorageInfo``,                        classes a DCP ``.metadata`` pickle names, which the
``metadata._MEM_FORMAT_ENCODING`` (both under       sharded tier's restricted unpickler admits
``torch.distributed.checkpoint``),                  (:data:`DCP_METADATA_PRIVATE`)
``serialization._get_layout``
``distributed.tensor.debug.``                       DTensor's sharding-propagation caches, dropped when the
``_clear_sharding_prop_cache``                      group re-forms in-process (:func:`clear_sharding_caches`)
``FSDPModule._get_fsdp_state``, its                 the all-gather and reduce-scatter a ``fully_shard``
``_fsdp_param_groups`` and their                    module uses (torch has setters, no getters): slow-node
``_all_gather_comm``, ``_reduce_scatter_comm``      timing wraps them (:func:`fsdp_comms`)
==================================================  ==========================================================

Checked against torch 2.13.0 and 2.14.1 (``make compat`` runs the rendezvous, hot-path and checkpoint tests
on both; pyproject's torch range is what passes there). Everything degrades to "not under torchrun's agent"
or "not available" rather than raising when a name moved: the handler then takes the restart path, which
uses only public API.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

#: Modules the worker fork server imports by name besides the public ones (see the module docstring).
PRELOAD = ("torch._dynamo",)

#: torch's key prefix of an agent's role information in the round's store (``_assign_worker_ranks``).
ROLE_INFO_PREFIX = "torchelastic/role_info/"

#: The private (module, name) pairs a DCP ``.metadata`` pickle names besides public classes (see the module
#: docstring): a restricted unpickler of DCP metadata admits them.
DCP_METADATA_PRIVATE = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
    }
)


def _frames(start: int = 2) -> Any:
    """The frames calling the caller of this module's function, innermost first."""
    frame: Any = sys._getframe(start)
    while frame is not None:
        yield frame
        frame = frame.f_back


@dataclass(frozen=True, slots=True)
class WorkerSlot:
    """One worker of torchrun's worker group as a round formed in-process places it."""

    local_rank: int
    global_rank: int
    world_size: int


class TorchrunAgent:
    """torchrun's agent and its worker group, as found on the stack of ``next_rendezvous``.

    Args:
        agent: a ``SimpleElasticAgent``.
        group: its ``WorkerGroup``.
    """

    def __init__(self, agent: Any, group: Any) -> None:
        self._agent = agent
        self._group = group

    @classmethod
    def find(cls) -> TorchrunAgent | None:
        """The agent whose ``_rendezvous`` (or a caller of it) is on this thread's stack, or None (not under
        torchrun's agent: a test, a launcher of another kind)."""
        for frame in _frames():
            group = frame.f_locals.get("worker_group")
            agent = frame.f_locals.get("self")
            if (
                group is not None
                and hasattr(group, "group_world_size")
                and hasattr(group, "spec")
                and hasattr(agent, "_assign_worker_ranks")
            ):
                return cls(agent, group)
        return None

    @property
    def local_world_size(self) -> int:
        """Workers of the group on this node (``WorkerSpec.local_world_size``)."""
        return int(self._group.spec.local_world_size)

    @property
    def role(self) -> str:
        return str(self._group.spec.role)

    def write_role_info(self, store: Any, group_rank: int) -> None:
        """Write this agent's part of the rank exchange as ``_assign_worker_ranks`` does first, so that the
        other agents of the round can see it before this one blocks in the exchange.

        Raises:
            RuntimeError: the store is unreachable.
        """
        from torch.distributed.elastic.agent.server.api import _RoleInstanceInfo

        info = _RoleInstanceInfo(self.role, group_rank, self.local_world_size).serialize()
        store.set(role_info_key(group_rank), info)

    def assign_ranks(self, store: Any, group_rank: int, group_world_size: int) -> list[WorkerSlot]:
        """torchrun's rank exchange for a round formed outside its own ``_rendezvous``; the new ranks of this
        node's workers, by local rank. Blocks in the store until every agent of the round took part.

        Raises:
            RuntimeError: the store failed or timed out.
        """
        workers = self._agent._assign_worker_ranks(store, group_rank, group_world_size, self._group.spec)
        ordered = sorted(self._group.workers, key=lambda w: w.local_rank)
        for old, new in zip(ordered, workers, strict=True):
            old.global_rank, old.role_rank = new.global_rank, new.role_rank
            old.world_size, old.role_world_size = new.world_size, new.role_world_size
        return [WorkerSlot(w.local_rank, w.global_rank, w.world_size) for w in ordered]

    def exit_barrier(self) -> None:
        """Wait in torchrun's exit barrier of the worker group's round, as the agent does when its workers
        succeed (up to ``exit_barrier_timeout``; torchrun logs a barrier that fails or times out). Nothing
        when torch's agent has no such barrier."""
        barrier = getattr(self._agent, "_exit_barrier", None)
        if callable(barrier):
            barrier()

    def adopt_round(self, group_rank: int, group_world_size: int, store: Any, addr: str, port: int) -> None:
        """Make torchrun's record of the worker group that of the new round (its exit barrier then waits for
        this round's nodes)."""
        group = self._group
        group.group_rank, group.group_world_size, group.store = group_rank, group_world_size, store
        group.master_addr, group.master_port = addr, port
        self._agent._store = store


def role_info_key(group_rank: int) -> str:
    """The store key of agent ``group_rank``'s part of torchrun's rank exchange."""
    return f"{ROLE_INFO_PREFIX}{group_rank}"


def torchrun_nproc_per_node() -> int | None:
    """``nproc_per_node`` of the torchrun launch on this thread's stack (the ``LaunchConfig`` of
    ``launch_agent``, which creates the handler), or None outside one."""
    from torch.distributed.launcher.api import LaunchConfig

    for frame in _frames():
        config = frame.f_locals.get("config")
        if isinstance(config, LaunchConfig):
            return int(config.nproc_per_node)
    return None


@dataclass(frozen=True, slots=True)
class WorkerExit:
    """How one of torchrun's workers ended, as its agent saw it."""

    local_rank: int
    exit_code: int
    """The process's exit code (negative: the signal that killed it)."""
    message: str
    """The first line of the error its ``@record`` wrote (torchrun's error file), or ``""``."""


def torchrun_failures() -> list[WorkerExit] | None:
    """The failed workers of the run that torchrun's agent is restarting from (the ``run_result`` of
    ``_invoke_run`` on this thread's stack), or None when there is none (a first start, a restart for a
    membership change, not under torchrun's agent)."""
    for frame in _frames():
        result = frame.f_locals.get("run_result")
        failures = getattr(result, "failures", None)
        if result is None or not isinstance(failures, dict) or not hasattr(result, "state"):
            continue
        if not failures:
            return None
        out = []
        for local_rank, failure in sorted(failures.items()):
            code = getattr(failure, "exitcode", None)
            if not isinstance(code, int) or isinstance(code, bool):
                continue
            out.append(WorkerExit(int(local_rank), code, _error_file_line(failure)))
        return out or None
    return None


def _error_file_line(failure: Any) -> str:
    """The first line of the message a worker's ``@record`` left in torchrun's error file; ``""`` when it
    left none (torch then makes one up, with the PID in it for a signal: not the script's own line)."""
    error_file = getattr(failure, "error_file", None)
    if not isinstance(error_file, str) or not os.path.isfile(error_file):
        return ""  # torch's placeholder data ("<NONE>"), not a line of the worker's
    data = getattr(failure, "error_file_data", None)
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return _first_line(message) if isinstance(message, str) else ""


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:2000]
    return ""


def missing() -> list[str]:
    """The private names listed above that this torch lacks (empty on a torch this module was checked
    against): attributes, and the local variables the frame walks look for. ``make compat`` and the unit
    tests assert it is empty."""
    import importlib
    import inspect

    attributes = [
        ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._assign_worker_ranks"),
        ("torch.distributed.elastic.agent.server.api", "_RoleInstanceInfo.serialize"),
        ("torch.distributed.distributed_c10d", "_abort_process_group"),
        ("torch.distributed.distributed_c10d", "_world.pg_map"),
        ("torch._dynamo.eval_frame", "OptimizedModule"),
        ("torch", "_foreach_copy_"),
        ("torch.distributed.checkpoint._fsspec_filesystem", "FsspecWriter"),
        ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
        ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"),
        *sorted(DCP_METADATA_PRIVATE),
    ]
    locals_ = [
        ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._rendezvous", "worker_group"),
        ("torch.distributed.elastic.agent.server.api", "SimpleElasticAgent._invoke_run", "run_result"),
        ("torch.distributed.launcher.api", "launch_agent", "config"),
    ]
    gone = []
    for module, path, *local in [*attributes, *locals_]:
        try:
            obj: Any = importlib.import_module(module)
            for part in path.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            gone.append(f"{module}.{path}")
            continue
        code = getattr(inspect.unwrap(obj), "__code__", None)  # under torch's @prof
        if local and (code is None or local[0] not in code.co_varnames):
            gone.append(f"{module}.{path}: local {local[0]}")
    return gone


def abort_groups() -> None:
    """Abort every process group's communicators of this process at once (NCCL: one group call, so that no
    abort waits on another); it also unregisters the groups."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group()


def process_groups() -> list[Any]:
    """Every process group of this process that torch's registry holds (the default one included)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def foreach_copy_op() -> Callable[[Any, Any], None]:
    """``torch._foreach_copy_`` itself, for a caller that copies every training step and binds it once (the
    memory snapshot: a wrapper's call would cost the step a Python frame per save)."""
    import torch

    return torch._foreach_copy_


def foreach_copy(dests: Sequence[Any], srcs: Sequence[Any]) -> None:
    """Copy each tensor of ``srcs`` into the tensor of ``dests`` at its place, in one call (torch batches the
    copies: far less Python and launch overhead than one ``copy_`` per tensor)."""
    import torch

    torch._foreach_copy_(list(dests), list(srcs))


def dcp_fsspec_writer(url: str, **options: Any) -> Any:
    """DCP's storage writer to the fsspec ``url`` (``options``: the filesystem's), for ``dcp.save``."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url, **options)


def clear_sharding_caches() -> None:
    """Drop DTensor's sharding-propagation caches (its Python and C++ ones)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()


def fsdp_comms(module: Any) -> tuple[Any, Any] | None:
    """The all-gather and reduce-scatter communication objects of a ``fully_shard`` module (what
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` replace), or None: the module has no parameter
    group of its own, several (those setters refuse them), or this torch keeps them elsewhere."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) != 1:
            return None
        return groups[0]._all_gather_comm, groups[0]._reduce_scatter_comm
    except (AttributeError, TypeError):
        return None


def uncompiled(model: Any) -> Any | None:
    """The module a ``torch.compile`` wrapper holds, or None when ``model`` is not such a wrapper."""
    import torch

    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, torch.nn.Module) else None


__all__: Sequence[str] = (
    "DCP_METADATA_PRIVATE",
    "PRELOAD",
    "ROLE_INFO_PREFIX",
    "TorchrunAgent",
    "WorkerExit",
    "WorkerSlot",
    "abort_groups",
    "clear_sharding_caches",
    "dcp_fsspec_writer",
    "foreach_copy",
    "fsdp_comms",
    "role_info_key",
    "torchrun_failures",
    "torchrun_nproc_per_node",
    "uncompiled",
)
