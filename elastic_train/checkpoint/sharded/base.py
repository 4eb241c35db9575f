"""What the sharded manager's parts share: its state's declarations and a few small methods.

:class:`~elastic_train.checkpoint.sharded.manager.ShardedCheckpointManager` is made of the memory tier's
saves (``manager.py``), the durable writer (:mod:`.writer`) and the restore (:mod:`.restore`); each part is a
class over this base, and the manager's ``__init__`` sets every attribute declared here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.agent import Agent
from elastic_train.checkpoint.background import OneJob
from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.sharded.slots import ShardedMemory
from elastic_train.checkpoint.storage import Storage
from elastic_train.checkpoint.writer import Committed


class ManagerBase:
    """The state every part of the sharded manager reads (set by the manager's ``__init__``)."""

    cfg: CheckpointConfig
    run_id: str
    rank: int
    world_size: int
    local_rank: int
    round: int
    storage: Storage
    run_path: str
    agent: Agent
    memory: ShardedMemory | None
    model: torch.nn.Module
    optimizer: Any
    current_state: Any
    stamp: int | None
    base: int
    last_committed: Committed | None
    last_moved: dict[str, Any]
    _ctl: Any
    _io: Any
    _rep: Any
    _mesh: Any
    _cpu_mesh: Any
    _staging: torch.Tensor | None
    _last_durable_time: float
    _last_durable_step: int | None
    _durable_ok_step: int | None
    _failure: CheckpointError | None
    _jobs: OneJob[Any]
    _closed: bool
    _fqns: tuple[Any, list[str]] | None
    _lineage: durable.LineageWrite | None
    _relayout: bool

    @property
    def coordinated(self) -> bool:
        return self._ctl is not None

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self._ctl, rank) if self._ctl is not None else rank

    def wait(self) -> None:
        """Block until no durable write is in flight."""
        self._jobs.wait(self.agent.beat)

    def _raise_pending(self) -> None:
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        if self.memory is not None:
            self.memory.raise_error()

    def _fqn_of(self) -> list[str]:
        """The name of each parameter the optimizer's state dict numbers (its param groups, in order).

        Read between steps on the training thread: during a forward FSDP2 registers the unsharded
        parameters on the module, and the optimizer's (sharded) ones have no name there."""
        opt = self.optimizer
        if not isinstance(opt, torch.optim.Optimizer):
            return []
        key = [id(p) for g in opt.param_groups for p in g["params"]]
        if self._fqns is not None and self._fqns[0] == key:
            return self._fqns[1]
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        seen: dict[int, str] = {}
        for pid in key:
            seen.setdefault(pid, names.get(pid, f"param{len(seen)}"))
        fqns = list(seen.values())
        if all(pid in names for pid in seen):  # else: an optimizer over tensors the model does not hold
            self._fqns = (key, fqns)
        return fqns
