"""A job's rendezvous state as read from etcd (``elastic-train status``, ``elastic-train local`` reports)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_train.etcd.client import Etcd
from elastic_train.rendezvous.protocol import run_prefix


@dataclass(slots=True)
class Member:
    """One node of the current round."""

    node: str
    addr: str | None
    rank: int
    alive: bool


@dataclass(slots=True)
class JobStatus:
    """Snapshot of a run's rendezvous keys."""

    run_id: str
    round: int
    """Last closed round (0: none yet)."""
    state: str
    """"waiting" (no round yet), "running", "restarting" (nodes asked for a new round or a member is lost),
    "closed" (finished) or "failed" (failure budget spent)."""
    members: list[Member] = field(default_factory=list)
    world_size: int = 0
    waiting: list[str] = field(default_factory=list)
    """Nodes that asked for a round after the current one."""
    failures_used: int = 0
    failure_budget: int | None = None
    closed: bool = False
    message: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def read_status(client: Any, run_id: str) -> JobStatus:
    """Read the run's keys once (one range request) and summarize them.

    Args:
        client: an :class:`~elastic_train.etcd.client.Etcd` or a client from ``connect``.
        run_id: the job's run id (validated).

    Raises:
        EtcdError: etcd failed.
    """
    etcd = client if isinstance(client, Etcd) else Etcd(client)
    prefix = run_prefix(run_id)
    kvs, _ = etcd.get_prefix(prefix)
    keys = {kv.key[len(prefix) :]: kv.value for kv in kvs}
    live = {k[len("nodes/") :] for k in keys if k.startswith("nodes/")}
    rec = json.loads(keys["round"]) if "round" in keys else None
    cfg = json.loads(keys["config"]) if "config" in keys else {}
    closed = json.loads(keys["closed"]) if "closed" in keys else None
    rnd = int(rec["round"]) if rec else 0
    members = []
    nodes = rec.get("nodes", {}) if rec else {}
    for rank, node in enumerate(rec["members"] if rec else []):
        addr = (nodes.get(node) or {}).get("addr")
        members.append(Member(node=node, addr=addr, rank=rank, alive=node in live))
    waiting = []
    for k, v in keys.items():
        if k.startswith("join/"):
            try:
                if int(json.loads(v)["target"]) > rnd and k[5:] in live:
                    waiting.append(k[5:])
            except (ValueError, KeyError, TypeError):
                continue
    if closed is not None:
        state = "failed" if closed.get("reason") == "budget" else "closed"
    elif rec is None:
        state = "waiting"
    elif waiting or any(not m.alive for m in members):
        state = "restarting"
    else:
        state = "running"
    return JobStatus(
        run_id=run_id,
        round=rnd,
        state=state,
        members=members,
        world_size=len(members),
        waiting=sorted(waiting),
        failures_used=int(keys.get("failures", b"0")),
        failure_budget=cfg.get("failure_budget"),
        closed=closed is not None,
        message=str(closed.get("message", "")) if closed else "",
    )
