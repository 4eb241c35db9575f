"""Fault plans for ``elastic-train local``: what to break, where and when.

A fault is keyed by (node, step): ``kill-node 1@step=30`` kills node 1 (its agent and every worker, SIGKILL)
once the job has completed step 30. Nodes are numbered in launch order: the first ``--nodes`` are
0..N-1, each ``add-node`` gets the next number. Some kinds take options after the step:
``slow-node 1@step=30,factor=2,for=20`` slows node 1's workers twofold for 20 seconds (without ``for``: for
good). Parsing and the "is it due" decision are pure functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from elastic_train.errors import ConfigError

#: kind → whether it names a node
KINDS: dict[str, bool] = {
    "kill-node": True,  # SIGKILL the agent and all its workers (a machine lost)
    "kill-worker": True,  # SIGKILL one worker process of the node (a crashed trainer)
    # SIGTERM to the agent only, as Kubernetes sends a pod's main process on preemption, drain or deletion:
    # the node leaves cleanly (not a failure) and exits by the signal
    "preempt-node": True,
    "hang-node": True,  # SIGSTOP the agent and all its workers (a frozen machine)
    "resume-node": True,  # SIGCONT a hung node (it comes back and rejoins)
    "add-node": False,  # start one more node (scale up)
    "restart-etcd": False,  # SIGKILL etcd and start it again on the same port and data
    "kill-etcd-leader": False,  # SIGKILL the leader of a 3-member etcd (restarted a few seconds later)
    "etcd-quorum-loss": False,  # SIGSTOP 2 of 3 etcd members (the followers) for a few seconds
    # A partition: the node's etcd traffic silently dropped (held, no reset) for a while, then healed; its
    # workers' own traffic goes on. The node must fence itself, and rejoin on heal.
    "partition-etcd": True,
    # Operator mistakes: one more node started with the job's run id but other settings. It must be refused
    # (exit 2, one line) without the job noticing.
    "collide-checkpoint": False,  # ... another checkpoint URL
    "collide-nodes": False,  # ... another node range (max nodes + 1)
    # A slow node: its workers stopped and continued (SIGSTOP/SIGCONT) so that they run 1/factor of the time,
    # for a span or for good; its agent keeps its lease. Options: factor=F (default 2), for=SECONDS.
    "slow-node": True,
}
#: Options a kind takes after its step (``,name=value``), with their defaults (``None``: unset).
OPTIONS: dict[str, dict[str, float | None]] = {"slow-node": {"factor": 2.0, "for": None}}
#: Kinds that need a multi-member etcd (``--etcd-members 3``).
CLUSTER_KINDS = ("kill-etcd-leader", "etcd-quorum-loss")
#: Kinds that start an intruding node (see :data:`KINDS`); their outcome is in ``FaultRecord.extra``.
COLLISION_KINDS = ("collide-checkpoint", "collide-nodes")
#: Kinds the rendezvous does not react to (no round follows them): their record says what happened.
SILENT_KINDS = ("slow-node",)

_SPEC = re.compile(r"^(?P<node>\d+)?@step=(?P<step>\d+)(?P<options>(,[a-z]+=[^,]+)*)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One planned fault: what to break, where and when (what then happened is a :class:`FaultRecord`)."""

    kind: str
    """One of :data:`KINDS`."""
    step: int
    """Fire once this many optimizer steps have completed."""
    node: int | None = None
    """Node index (launch order) for node faults."""
    options: tuple[tuple[str, float], ...] = ()
    """The kind's options given (:data:`OPTIONS`), in the order given."""

    def option(self, name: str) -> float | None:
        """An option's value, or its default."""
        return dict(self.options).get(name, OPTIONS.get(self.kind, {}).get(name))

    @property
    def label(self) -> str:
        node = "" if self.node is None else str(self.node)
        opts = "".join(f",{k}={v:g}" for k, v in self.options)
        return f"{self.kind} {node}@step={self.step}{opts}"


@dataclass(kw_only=True, slots=True)
class FaultRecord:
    """What was observed about one planned fault during a run."""

    fault: Fault
    """The plan."""
    fired_at: float | None = None
    """Unix time the fault was injected."""
    fired_step: int | None = None
    """Last completed step seen when it was injected."""
    fired_round: int | None = None
    """Rendezvous round the job was in when it was injected."""
    detected_at: float | None = None
    """Unix time the rendezvous reacted (new round started or the node left the live set)."""
    resumed_at: float | None = None
    """Unix time of the first completed step after the fault in a later round."""
    resumed_world_size: int | None = None
    """World size of that first step."""
    resumed_from: int | None = None
    """Step the job resumed from (state restored)."""
    source: str | None = None
    """Where that state came from (memory, durable, …)."""
    extra: dict[str, object] = field(default_factory=dict)
    """Kind-specific facts (PIDs signalled, new node index …)."""

    @property
    def kind(self) -> str:
        return self.fault.kind

    @property
    def label(self) -> str:
        return self.fault.label

    @property
    def steps_redone(self) -> int | None:
        if self.fired_step is None or self.resumed_from is None:
            return None
        return max(0, self.fired_step - self.resumed_from)

    def to_json(self) -> dict[str, object]:
        def rel(t: float | None) -> float | None:
            return None if t is None or self.fired_at is None else round(t - self.fired_at, 3)

        return {
            "kind": self.fault.kind,
            "node": self.fault.node,
            "step": self.fault.step,
            "fired_step": self.fired_step,
            "fired_round": self.fired_round,
            "detected_s": rel(self.detected_at),
            "resumed_s": rel(self.resumed_at),
            "resumed_world_size": self.resumed_world_size,
            "resumed_from": self.resumed_from,
            "steps_redone": self.steps_redone,
            "source": self.source,
            **({"extra": self.extra} if self.extra else {}),
        }


def parse_fault(kind: str, spec: str) -> Fault:
    """Parse ``"1@step=30"`` (or ``"@step=70"`` for kinds without a node, ``"1@step=30,factor=3,for=20"``
    for kinds with options) into a :class:`Fault`.

    Raises:
        ConfigError: unknown kind, malformed spec, a node where none belongs or a missing node, an option
            the kind does not take or a bad value.
    """
    if kind not in KINDS:
        raise ConfigError(f"unknown fault kind {kind!r} (one of {', '.join(KINDS)})")
    m = _SPEC.match(spec.strip())
    if not m:
        raise ConfigError(f"--{kind} {spec!r}: expected {spec_form(kind)}")
    options = _options(kind, spec, m["options"])
    node = int(m["node"]) if m["node"] is not None else None
    if KINDS[kind] and node is None:
        raise ConfigError(f"--{kind} {spec!r}: needs a node index, e.g. 1@step=30")
    if not KINDS[kind] and node is not None:
        raise ConfigError(f"--{kind} {spec!r}: takes no node index, e.g. @step=30")
    return Fault(kind=kind, step=int(m["step"]), node=node, options=options)


def spec_form(kind: str) -> str:
    """How a fault of ``kind`` is written (``NODE@step=S[,factor=X][,for=X]``)."""
    options = "".join(f"[,{o}=X]" for o in OPTIONS.get(kind, {}))
    return ("NODE@step=S" if KINDS[kind] else "@step=S") + options


def _options(kind: str, spec: str, text: str) -> tuple[tuple[str, float], ...]:
    allowed = OPTIONS.get(kind, {})
    out = []
    for item in filter(None, text.split(",")):
        name, _, raw = item.partition("=")
        if name not in allowed:
            takes = f"takes {', '.join(allowed)}" if allowed else "takes no options"
            raise ConfigError(f"--{kind} {spec!r}: unknown option {name!r} ({kind} {takes})")
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(f"--{kind} {spec!r}: {name}={raw!r} is not a number") from None
        if name == "factor" and not 1.0 < value <= 100.0:
            raise ConfigError(
                f"--{kind} {spec!r}: factor={raw} must be above 1 (times slower) and at most 100"
            )
        if name == "for" and not value > 0:
            raise ConfigError(f"--{kind} {spec!r}: for={raw} must be > 0 seconds")
        out.append((name, value))
    return tuple(out)


def validate_plan(faults: list[Fault], initial_nodes: int, steps: int, etcd_members: int = 1) -> None:
    """Check node indices refer to nodes that exist by then, steps are inside the run, and etcd faults have
    the cluster they need.

    Raises:
        ConfigError: a fault can never fire or names a node that will not exist.
    """
    nodes = initial_nodes
    for f in sorted(faults, key=lambda f: f.step):
        if f.kind in CLUSTER_KINDS and etcd_members < 3:
            raise ConfigError(f"--{f.kind} needs a 3- or 5-member etcd (--etcd-members 3)")
        if f.step >= steps:
            raise ConfigError(f"--{f.kind} @step={f.step}: the job only trains {steps} steps")
        if f.kind == "add-node":
            nodes += 1
        elif f.node is not None and f.node >= nodes:
            raise ConfigError(
                f"--{f.kind} {f.node}@step={f.step}: there are only nodes 0..{nodes - 1} by then"
            )


def due(records: list[FaultRecord], completed_step: int) -> list[FaultRecord]:
    """Faults not yet fired whose step has been reached, in plan order."""
    return [r for r in records if r.fired_at is None and completed_step >= r.fault.step]
