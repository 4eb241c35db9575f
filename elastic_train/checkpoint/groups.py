"""The checkpoint manager's own gloo groups over the training group's ranks.

``ctl`` carries the loop-side collectives (a restore's decision and verdict, the agreed ``every_seconds``
cadence), ``io`` the durable writer's background ones: neither interleaves with the training group's (NCCL
training included) nor with the other's. A restore streams its bytes over both (two TCP connections per
link, :func:`~elastic_train.checkpoint.transfer.lane`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from elastic_train import net
from elastic_train.log import get_logger

log = get_logger(__name__)


class Groups:
    """The groups of one manager (none without a training group of more than one rank).

    Args:
        group: the training process group (None: no coordination).
        rank: this worker's rank in it.
        world_size: its size.
    """

    def __init__(self, group: Any, *, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.ctl: Any = None
        self.io: Any = None
        if group is not None and world_size > 1:
            ranks = dist.get_process_group_ranks(group)
            self.ctl = dist.new_group(ranks=ranks, backend="gloo")
            self.io = dist.new_group(ranks=ranks, backend="gloo")

    @property
    def coordinated(self) -> bool:
        """Whether the ranks act together (False: this rank decides and writes alone)."""
        return self.io is not None

    @property
    def lanes(self) -> tuple[Any, ...]:
        """The groups a restored state streams over."""
        return (self.ctl, self.io)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.ctl, group_rank)

    def gather_object(self, obj: Any) -> list[Any]:
        """Collective on ``ctl``: every rank's small picklable ``obj``, in rank order."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.ctl)
        return out

    def any_rank(self, flag: bool) -> bool:
        """Collective on ``ctl``: whether ``flag`` is set on any rank."""
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.ctl)
        return bool(value.item())

    def destroy(self) -> None:
        """Destroy both groups (the manager is done; nothing is coordinated from now on)."""
        doomed = [self.ctl, self.io]
        self.ctl = self.io = None
        for error in net.destroy_groups(doomed):  # the default group may already be gone
            log.debug("checkpoint_group_destroy_failed", error=error)
