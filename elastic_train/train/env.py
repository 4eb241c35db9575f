"""What torchrun tells a worker through its environment, and the round its agent assigned (pure parsing)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from elastic_train.errors import ConfigError
from elastic_train.node import Assignment

__all__ = ["WorkerEnv"]


@dataclass(frozen=True, slots=True)
class WorkerEnv:
    """Identity of this worker in the current worker group."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of workers in the group."""
    local_rank: int
    """Rank on this node (the CUDA device index)."""
    round: int
    """Rendezvous round of the group (increases with every re-rendezvous)."""
    round_is_global: bool
    """True when ``round`` came from the rendezvous (the agent's assignment: the same on every node), not
    from a node's restart count."""
    local_world_size: int
    """Workers on this node."""
    restart_count: int
    """How often this node's agent restarted its workers."""
    run_id: str | None
    """torchrun's run id (``--rdzv-id``), or ``None`` when not launched by torchrun."""
    master_addr: str
    """Address of the rank-0 store the process group bootstraps from."""
    master_port: int
    """Port of that store (0: pick one, single-process runs only)."""
    agent_store: bool
    """The store at MASTER_ADDR:MASTER_PORT is the agent's own, kept across worker groups."""

    @property
    def group_generation(self) -> str | None:
        """A key prefix unique to this worker group and known to all its members (``None``: none is).

        The round when the rendezvous provides it; on a single node (all workers from one agent) the agent's
        restart count serves as well.
        """
        if self.round_is_global:
            return f"round-{self.round}"
        if self.local_world_size == self.world_size:
            return f"restart-{self.restart_count}"
        return None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], assignment: Assignment | None = None) -> WorkerEnv:
        """Read torchrun's variables; without ``RANK`` this is a single-process world on loopback.

        Args:
            environ: the process's environment.
            assignment: the assignment of this worker's agent (:mod:`elastic_train.node`), which carries the
                round; None outside an ``etcd3`` agent (the round is then the restart count).

        Raises:
            ConfigError: a variable is present but not an integer, or rank/world size are inconsistent.
        """

        def num(name: str, default: int) -> int:
            raw = environ.get(name)
            if raw is None or raw == "":
                return default
            try:
                return int(raw)
            except ValueError as exc:
                raise ConfigError(f"{name}={raw!r}: expected an integer") from exc

        rank = num("RANK", 0)
        world_size = num("WORLD_SIZE", 1)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"RANK={rank} WORLD_SIZE={world_size}: inconsistent")
        restart = num("TORCHELASTIC_RESTART_COUNT", 0)
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=num("LOCAL_RANK", 0),
            round=assignment.round if assignment is not None else restart,
            round_is_global=assignment is not None,
            local_world_size=num("LOCAL_WORLD_SIZE", world_size),
            restart_count=restart,
            run_id=environ.get("TORCHELASTIC_RUN_ID") or None,
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=num("MASTER_PORT", 0),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
