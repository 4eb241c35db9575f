"""What each benchmark script writes with ``--json FILE``: one pydantic model per document.

``report.py`` reads every benchmark's JSON through :func:`parse`, so a document that does not fit (a
missing key, a string where a number belongs, a key no script writes, another benchmark's document) is
refused with one line naming the file and the place, instead of being rendered as "not measured". The
models are strict (no string-to-number coercion) and closed (an unknown key is an error): a script that
starts writing something new says so here, where the report can be taught to show it.

The scripts write these documents as they go (``rendezvous.py`` after every job, ``rdzv_scale.py`` after
every size, ``rdzv_latency.py`` after every sample), so a partial run fits the same model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class SchemaError(ValueError):
    """A benchmark document does not fit its model (the message names the file and the first problem)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)


# ------------------------------------------------------------------------------------------- shared parts


class Machine(_Model):
    """Where the figures were measured (``harness.machine_info``)."""

    cpu: str
    cores: int | None
    ram_gib: float
    loadavg: list[float]
    torch: str
    python: str
    etcd: str
    platform: str


class Phases(_Model):
    """Seconds from an event to each stage of a recovery (``harness.phases``); None: not reached."""

    workers_started: float | None = None
    all_started: float | None = None
    imported: float | None = None
    pg_ready: float | None = None
    first_step: float | None = None


class Sample(_Model):
    """One timed event (``harness.Outcome``); the leader-kill and latency samples carry a little more."""

    status: str
    """``ok``, ``timeout``, ``failed`` or ``not_run``."""
    seconds: float | None = None
    cap: float | None = None
    detail: str = ""
    phases: Phases | None = None
    restarted: bool | None = None
    worlds_after: list[int] | None = None
    leader: int | None = None


class Summary(_Model):
    """Median and spread over repeats (``harness.summarize``); a censored median is the cap."""

    n: int
    ok: int
    median: float | None
    median_censored: bool
    min: float | None
    max: float | None
    max_censored: bool
    cap: float | None


class Ratio(_Model):
    """Baseline median / our median (``harness.speedup``); a lower bound when the baseline was censored."""

    ratio: float
    lower_bound: bool


class BackendInfo(_Model):
    """One rendezvous configuration (``harness.BackendConfig.to_json``)."""

    name: str
    backend: str
    rdzv_conf: dict[str, str] = {}
    env: dict[str, str] = {}
    ours: bool = False
    description: str = ""
    launcher: str = "torchrun"


class TargetRecord(_Model):
    """A target a benchmark evaluates itself (``overhead.py``, ``recovery.py``), shown as it is."""

    name: str
    threshold: str
    figure: str = "not measured"
    status: Literal["met", "missed", "inconclusive", "not measured", "reported"] = "not measured"
    why: str = ""


#: One row of a self-describing figures table: column name -> cell.
FigureRow = dict[str, str | int | float | None]


# -------------------------------------------------------------------------------------- rendezvous.py


class RendezvousSettings(_Model):
    nnodes: str
    nproc_per_node: int
    cap: float
    hang_cap: float
    step_interval: float
    monitor_interval: float
    max_restarts: int
    jobs: list[str]
    baseline_jobs: list[str]
    slow_repeats: int
    slow_configs: list[str]


class ScenarioResult(_Model):
    """One configuration in one scenario: every sample, their summary and the phases of each recovery."""

    samples: list[Sample]
    summary: Summary
    phases: list[Phases | None] = []


class Scenario(_Model):
    title: str
    results: dict[str, ScenarioResult]


class RendezvousDoc(_Model):
    """``rendezvous.py``: torchrun agents, every backend, launch / kill / scale-up / SIGSTOP."""

    benchmark: Literal["rendezvous"]
    schema_version: int = Field(alias="schema")
    quick: bool
    repeats: int
    command: str
    machine: Machine
    started: float
    planned_jobs: int
    settings: RendezvousSettings
    ours: str
    configs: list[BackendInfo]
    not_run: dict[str, str]
    seconds: float
    complete: bool
    loadavg_end: list[float]
    scenarios: dict[str, Scenario]
    ratios: dict[str, dict[str, Ratio | None]]
    timelines: dict[str, dict[str, list[tuple[float, int]]]]
    """Rank 0's steps around the event of the first repeat: (seconds since the event, world size)."""
    runs: list[dict[str, Any]]
    """Every job as it ran (samples, victim, phases): kept for audits, not rendered."""

    def summary(self, scenario: str, config: str) -> Summary | None:
        """The summary of ``config`` in ``scenario`` when it has a median, else None."""
        block = self.scenarios.get(scenario)
        res = block.results.get(config) if block else None
        return res.summary if res and res.summary.median is not None else None

    @property
    def own(self) -> dict[str, Summary]:
        """Our configuration's summary per scenario (only those with a median)."""
        out = {}
        for scen in self.scenarios:
            s = self.summary(scen, self.ours)
            if s is not None:
                out[scen] = s
        return out


# -------------------------------------------------------------------------------------- rdzv_scale.py


class EtcdOps(_Model):
    reads: int
    writes: int
    txns: int
    leases: int
    watch_events: int
    requests: int = 0
    keepalives: int = 0
    watch_bytes: int = 0
    failovers: int = 0


class ClientCpu(_Model):
    first_round: float
    failure_round: float


class ScaleRound(_Model):
    """N participants: a first round, then a round after one of them leaves."""

    n: int
    processes: int
    watch: Literal["shared", "own"]
    first_round_s: float
    first_round_ops: EtcdOps
    probe_first_round_s: float
    detect_s: float
    failure_round_s: float
    failure_round_ops: EtcdOps
    probe_failure_round_s: float
    client_cpu_ms_per_participant: ClientCpu
    keepalive: Literal["batch", "own"] | None = None
    start_s: float | None = None
    first_round: dict[str, Any] | None = None
    """Watch bytes and events per agent, etcd CPU, leases lost, keep-alive exchanges of the first round."""
    failure_round: dict[str, Any] | None = None
    projection: dict[str, Any] | None = None
    """The slower round's cost apart from the simulation (client CPU per participant, CPU of the whole
    machine, watch bytes with a watch per agent)."""

    @property
    def slowest_s(self) -> float:
        """The slower of the two rounds: the figure the N=256 target is checked on."""
        return max(self.first_round_s, self.failure_round_s)

    @property
    def probe_s(self) -> float:
        return max(self.probe_first_round_s, self.probe_failure_round_s)

    @property
    def writes(self) -> int:
        """etcd writes of the larger of the two rounds."""
        return max(self.first_round_ops.writes, self.failure_round_ops.writes)


class ScaleFailure(_Model):
    """A size that did not finish (the script stops there)."""

    n: int
    watch: Literal["shared", "own"]
    error: str


class Bootstrap(_Model):
    n: int
    tcpstore_s: float
    etcd_keys_s: float
    etcd_over_tcp: float


class ScaleDoc(_Model):
    """``rdzv_scale.py``: the rendezvous alone with N participants, two watch set-ups."""

    benchmark: Literal["rdzv_scale"]
    settle_s: float
    processes: int
    per_client: int
    watch: Literal["shared", "own", "both"]
    bootstrap: list[Bootstrap]
    keepalive: Literal["batch", "own"] | None = None
    etcd_data: str | None = None
    cores: int | None = None
    scale: list[ScaleRound | ScaleFailure] = []
    """One watch per host process (the figure the targets are checked on)."""
    scale_own: list[ScaleRound | ScaleFailure] = []
    """A watch per participant."""

    @property
    def rounds(self) -> dict[str, ScaleRound]:
        """The finished sizes of ``scale``, by N (as a string: a figure path names them ``rounds.256``)."""
        return {str(r.n): r for r in sorted(self.scale, key=lambda r: r.n) if isinstance(r, ScaleRound)}

    @property
    def writes_growth(self) -> float | None:
        """etcd writes per participant at the largest N over those at the smallest (1.0: O(N))."""
        rounds = list(self.rounds.values())
        if len(rounds) < 2:
            return None
        lo, hi = rounds[0], rounds[-1]
        return (hi.writes / hi.n) / (lo.writes / lo.n)


# -------------------------------------------------------------------------------------- checkpoint.py


class CheckpointRatios(_Model):
    stall_over_shm_copy: float
    """Median over repeats of each save's stall over a shared-memory copy timed right before it."""
    stall_over_shm_copy_unpaired: float
    memory_step_stall_over_shm_copy: float
    durable_over_raw_write: float
    durable_over_raw_overwrite: float
    durable_over_dcp: float
    durable_over_torch_save: float


class CheckpointSize(_Model):
    """Every way to save one state size: median seconds, samples, throughput and the target ratios."""

    size_mb: float
    shm_copy_s: float
    raw_write_s: float
    raw_overwrite_s: float
    torch_save_s: float
    dcp_s: float
    et_stall_s: float
    et_memory_step_stall_s: float
    et_durable_s: float
    samples: dict[str, list[float]]
    throughput_mb_s: dict[str, float]
    ratios: CheckpointRatios

    @property
    def label(self) -> str:
        return f"{self.size_mb:g} MB"


class CheckpointDoc(_Model):
    """``checkpoint.py``: training-loop stall per checkpoint and durable throughput, per state size."""

    benchmark: Literal["checkpoint"]
    torch: str
    cpus: int | None
    repeats: int
    results: list[CheckpointSize]


# -------------------------------------------------------------------------------- overhead.py, recovery.py


class OverheadRun(_Model):
    """One configuration of ``overhead.py``: median step time of each loop and the paired-block ratios."""

    config: str
    task: str
    task_args: dict[str, Any]
    global_batch: int
    world_size: int
    state_mb: float
    memory_every_steps: int
    blocks: int
    block_steps: int
    plain_step_s: float
    loop_step_s: float
    allin_step_s: float
    loop_ratio: float
    allin_ratio: float
    pair_ratios: dict[str, list[float]]
    block_times: dict[str, list[float]]
    copy_floor_s: float | None = None
    """Seconds to copy and hash the state once (what a snapshot costs where no core is idle)."""
    copy_floor_ratio: float | None = None
    """1 + that copy per snapshot step / the plain step: the all-in ratio's floor on such a machine."""
    snapshot_python_s: float | None = None
    """CPU seconds per snapshot on the training thread other than copying tensors (median over blocks)."""
    snapshot_python_wall_s: float | None = None
    """The same in wall time (waits for a core, the interpreter lock or the previous seal included)."""
    copier_wake_s: float | None = None
    """CPU seconds per snapshot on the training thread handing the copy to the copier thread (the wake's
    system call; apart from the Python above). None in runs from before it was measured apart."""


class OverheadDoc(_Model):
    """``overhead.py``: per-step overhead of the loop over plain DDP; it evaluates its own targets."""

    benchmark: Literal["overhead"]
    description: str
    runs: list[OverheadRun]
    figures: list[FigureRow]
    targets: list[TargetRecord]
    target_ratio: float


class RecoveryDoc(_Model):
    """``recovery.py``: where the seconds of a recovery go; it evaluates its own target."""

    benchmark: Literal["recovery"]
    description: str
    loopback_bytes_per_s: float
    runs: list[dict[str, Any]]
    """Per state size: the phases of each fault as measured (kept for audits; ``figures`` shows them)."""
    figures: list[FigureRow]
    targets: list[TargetRecord]


class LightningDoc(_Model):
    """``lightning.py``: ElasticStrategy against plain Lightning under a kill and a join; its own targets."""

    benchmark: Literal["lightning"]
    description: str
    loadavg: list[list[float]]
    """Load average (1, 5, 15 min) at the start and at the end of the run."""
    runs: list[dict[str, Any]]
    """One per variant and repeat: the seconds, steps redone and samples lost/duplicated as measured."""
    figures: list[FigureRow]
    targets: list[TargetRecord]


class HotDoc(_Model):
    """``hot.py``: hot recovery against the restart path, paired in one run; it evaluates its own targets."""

    benchmark: Literal["hot"]
    description: str
    loadavg: list[float]
    loadavg_end: list[float]
    settings: dict[str, Any]
    summary: dict[str, Any]
    """Per loop, scenario and mode: the figures' summary (and a hot kill's phases)."""
    runs: list[dict[str, Any]]
    figures: list[FigureRow]
    targets: list[TargetRecord]
    torchft: dict[str, Any] | None = None
    """``torchft_probe.py``'s figures (``--torchft-python``), or why it did not run (``skipped``)."""


# ------------------------------------------------------------------------------------ rdzv_latency.py


class LatencySettings(_Model):
    delays_ms: list[float]
    repeats: int
    leader_repeats: int
    cap: float
    nnodes: str
    step_interval: float


class LatencyCell(_Model):
    samples: list[Sample]
    summary: Summary | None = None


class LeaderKill(_Model):
    samples: list[Sample]
    summary: Summary | None = None
    restarts: int = 0


class LatencyDoc(_Model):
    """``rdzv_latency.py``: recovery against one-way delay to the rendezvous service; etcd leader kills."""

    benchmark: Literal["rdzv_latency"]
    schema_version: int = Field(alias="schema")
    command: str
    machine: Machine
    started: str
    complete: bool
    settings: LatencySettings
    configs: list[BackendInfo]
    recovery: dict[str, dict[str, LatencyCell]]
    """Per configuration, per one-way delay in ms (as written: ``"25"``)."""
    leader_kill: LeaderKill
    seconds: float
    loadavg_end: list[float]

    def series(self) -> dict[str, list[tuple[float, Summary]]]:
        """``{config: [(delay ms, summary)]}`` sorted by delay, the cells with at least one sample."""
        out: dict[str, list[tuple[float, Summary]]] = {}
        for name, per_delay in self.recovery.items():
            for delay, cell in per_delay.items():
                if cell.summary is not None and cell.summary.n:
                    out.setdefault(name, []).append((float(delay), cell.summary))
        return {k: sorted(v, key=lambda p: p[0]) for k, v in out.items()}


# ------------------------------------------------------------------------------------------- reading

Document = (
    RendezvousDoc | ScaleDoc | CheckpointDoc | OverheadDoc | RecoveryDoc | LatencyDoc | LightningDoc | HotDoc
)

#: The model of each benchmark script's document, by script name.
MODELS: dict[str, type[Document]] = {
    "rendezvous": RendezvousDoc,
    "rdzv_scale": ScaleDoc,
    "checkpoint": CheckpointDoc,
    "overhead": OverheadDoc,
    "recovery": RecoveryDoc,
    "rdzv_latency": LatencyDoc,
    "lightning": LightningDoc,
    "hot": HotDoc,
}


def reason(exc: ValidationError) -> str:
    """The first error of ``exc`` as ``where: what`` (and how many more there are)."""
    errors = exc.errors()
    first = errors[0]
    where = ".".join(str(p) for p in first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}" if where else f"{first['msg']}{more}"


def parse(name: str, text: str | bytes, source: str = "") -> Document:
    """The document of benchmark ``name`` from its JSON text.

    Raises:
        SchemaError: ``text`` is not JSON, or not the document ``benchmarks/NAME.py`` writes; the message
            names ``source`` (the file) and the first problem.
        KeyError: ``name`` is not a benchmark.
    """
    model = MODELS[name]
    try:
        return model.model_validate_json(text)
    except ValidationError as exc:
        raise SchemaError(f"{source or name}: does not fit the {name} schema: {reason(exc)}") from None


# ------------------------------------------------------------------------------------------- figures


@dataclass(frozen=True, slots=True)
class Reading:
    """One figure read from a document for a target: what it is called and how sure it is."""

    label: str
    value: float | None
    at_least: bool = False
    """The true figure is at least ``value`` (a censored time, a ratio over a censored baseline)."""


def read(doc: Any, path: str) -> list[Reading]:
    """The figures at ``path`` in ``doc``: dotted attribute names or mapping keys, ``*`` for every element.

    A figure that is absent reads as ``value=None`` (not measured); a :class:`Ratio` reads as its ratio
    (at least, when a lower bound), a :class:`Summary` as its median (at least, when censored). The label is
    the last key or the element's ``label`` (``*``), e.g. ``c10d`` for ``ratios.launch.c10d``.
    """
    nodes: list[tuple[str, Any]] = [("", doc)]
    for part in path.split("."):
        nxt: list[tuple[str, Any]] = []
        for label, node in nodes:
            if part == "*":
                items = node.items() if isinstance(node, dict) else enumerate(node or [])
                nxt += [(str(getattr(v, "label", k)), v) for k, v in items]
            elif isinstance(node, dict):
                nxt.append((part, node.get(part)))
            else:
                nxt.append((label or part, getattr(node, part, None)))
        nodes = nxt
    out = []
    for label, node in nodes:
        if isinstance(node, Ratio):
            out.append(Reading(label, node.ratio, node.lower_bound))
        elif isinstance(node, Summary):
            out.append(Reading(label, node.median, node.median_censored))
        elif isinstance(node, int | float) and not isinstance(node, bool):
            out.append(Reading(label, float(node)))
        else:
            out.append(Reading(label, None))
    return out
