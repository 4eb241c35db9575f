"""The targets the benchmarks are held to, as a table, and the one function that evaluates them.

Each :class:`TargetSpec` names its benchmark, the bar in words (as the report shows it) and one or more
:class:`Bar` s: a figure path into that benchmark's document (see :func:`schema.read`), a direction, a
threshold and a unit. :func:`evaluate` reads every bar's figures and decides the status the same way for
every target:

- ``met``: every figure is on the right side of its bar;
- ``missed``: a figure is on the wrong side (or a time is censored above a ``<=`` bar);
- ``inconclusive``: a figure that is only a bound (a ratio over a censored baseline) is short of its bar;
- ``not measured``: a figure is absent (the benchmark did not run, or not that configuration or size).

How the measured figures are shown in the report (the ``measured`` column and the context appended to
``why``) is per target, in :data:`DESCRIBE`; it does not decide anything.

``overhead.py``, ``recovery.py``, ``lightning.py`` and ``hot.py`` evaluate their own targets (the figures need
their per-run context); their rows here only stand for them while the benchmark has not run.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from harness import format_ratio, format_summary
from schema import CheckpointDoc, CheckpointSize, Document, Reading, RendezvousDoc, ScaleDoc, ScaleRound, read

Status = Literal["met", "missed", "inconclusive", "not measured", "reported"]
Direction = Literal[">=", ">", "<="]
_COMPARE: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


@dataclass(frozen=True, slots=True)
class Bar:
    """One figure a target is checked on."""

    figure: str
    """Path into the benchmark's document (``ratios.kill.etcd-v2``, ``results.*.ratios.durable_over_dcp``)."""
    direction: Direction
    threshold: float
    unit: str
    """Shown after figures and thresholds: ``x`` (a ratio), `` s``, ``%``."""
    label: str = ""
    """What the figure is called in a ``why``; default: the last key of the path (or each element's label)."""


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """A promise the benchmarks check, from the issue that made it."""

    name: str
    """What is promised, in words."""
    benchmark: str
    """The script whose document holds the figures."""
    bar: str
    """The bar in words, as the report shows it."""
    bars: tuple[Bar, ...]
    """Empty: the benchmark evaluates this target itself (see the module docstring)."""
    why: str
    """Why the bar is where it is."""
    met: str = ""
    """Shown as ``why`` when every figure is well within its bar."""


@dataclass(slots=True)
class Target:
    """One target and how this run did against it (a row of the report's targets table)."""

    name: str
    """What is promised, in words."""
    threshold: str
    """The bar, e.g. ">= 4x faster than c10d and etcd-v2 defaults"."""
    figure: str = "not measured"
    """What this run measured."""
    status: Status = "not measured"
    """``met``, ``missed``, ``inconclusive``, ``not measured`` (or ``reported``, by a benchmark itself)."""
    why: str = ""
    """The reason, in particular for anything not met."""


TARGETS: tuple[TargetSpec, ...] = (
    TargetSpec(
        "launch 3 agents -> first step", "rendezvous", ">= 4x faster than c10d and etcd-v2 defaults",
        (Bar("ratios.launch.c10d", ">=", 4.0, "x"), Bar("ratios.launch.etcd-v2", ">=", 4.0, "x")),
        why="a job starts without torchrun's default 30 s last-call wait",
        met="every ratio at or above its bar",
    ),
    TargetSpec(
        "kill -9 one node -> first step at world 2", "rendezvous",
        ">= 10x faster than etcd-v2 defaults, faster than c10d-tuned",
        (Bar("ratios.kill.etcd-v2", ">=", 10.0, "x"), Bar("ratios.kill.c10d-tuned", ">", 1.0, "x")),
        why="a lost node is noticed by its lease, not by a keep-alive timeout, and no worker restarts",
        met="every ratio at or above its bar",
    ),
    TargetSpec(
        "add a 4th node -> first step at world 4", "rendezvous", "<= 5 s (etcd3)",
        (Bar("own.scale_up", "<=", 5.0, " s", label="etcd3"),),
        why="a node that joins is in the next round within one settle window plus a worker start",
        met="median within 5 s",
    ),
    TargetSpec(
        "rendezvous alone at N=256 participants", "rdzv_scale",
        "<= 3 s per round (first round and failure round)",
        (Bar("rounds.256.slowest_s", "<=", 3.0, " s", label="slowest round at N=256"),),
        why="the rendezvous is not what limits a large job",
    ),
    TargetSpec(
        "etcd writes per rendezvous round", "rdzv_scale", "O(N): writes/N flat from smallest to largest N",
        (Bar("writes_growth", "<=", 2.0, "x", label="writes/N at the largest N over the smallest"),),
        why="a round costs etcd O(N) writes, not O(N^2)",
    ),
    TargetSpec(
        "checkpoint stall of the training loop", "checkpoint",
        "<= 1.5x a plain shared-memory copy, every size",
        (Bar("results.*.ratios.stall_over_shm_copy", "<=", 1.5, "x"),),
        why="a checkpoint costs the loop little more than copying the state once",
    ),
    TargetSpec(
        "durable checkpoint throughput", "checkpoint", ">= 80% of raw write and >= torch DCP, every size",
        (
            Bar("results.*.ratios.durable_over_raw_write", ">=", 0.8, "x"),
            Bar("results.*.ratios.durable_over_dcp", ">=", 1.0, "x"),
        ),
        why="the background writer keeps up with the disk and with torch's own checkpointing",
    ),
    TargetSpec(
        "per-step overhead over plain DDP", "overhead",
        "<= 3% (>= 100 ms steps), <= 5% (17 ms); snapshot Python <= 0.2 ms", (),
        why="elastic training costs a training step almost nothing",
    ),
    TargetSpec(
        "Lightning under a kill and a join (run --entry)", "lightning", "<= 3 s, 0 samples lost or twice", (),
        why="a Lightning script keeps the guarantees and the recovery speed of the own loop",
    ),
    TargetSpec(
        "restore/broadcast vs state size / loopback bandwidth", "recovery",
        "<= 1.3x, one receiver, >= 100 MB", (),
        why="a recovery moves the state about once at network speed",
    ),
    TargetSpec(
        "kill -9 one node -> first step at world 2, hot recovery", "hot", "<= 0.5 s", (),
        why="survivors keep their processes: a lost node costs one step and a fraction of a second",
    ),
    TargetSpec(
        "join -> first step at world 3 after the joiner's model is built, hot recovery", "hot",
        "<= 0.5 s", (),
        why="a joiner costs the running job no more than a fraction of a second once it is ready",
    ),
    TargetSpec(
        "torch.compile'd model: kill -9 -> first step at world 2, hot recovery", "hot", "<= 1 s", (),
        why="survivors keep their compiled code: a membership change recompiles nothing",
    ),
)  # fmt: skip

_ORDER: tuple[Status, ...] = ("missed", "not measured", "inconclusive")


def evaluate(spec: TargetSpec, doc: Document | None) -> Target:
    """How ``doc`` (``spec.benchmark``'s document, None when it did not run) does against ``spec``."""
    target = Target(spec.name, spec.bar)
    if doc is None:
        target.why = f"{spec.benchmark} benchmark not run"
        return target
    if not spec.bars:
        target.why = f"{spec.benchmark} reported no target"
        return target
    statuses: list[Status] = []
    short, missing, bounds = [], [], []
    for bar in spec.bars:
        for r in read(doc, bar.figure):
            label = bar.label or r.label
            status = _check(bar, r)
            statuses.append(status)
            if status == "not measured":
                missing.append(label)
                continue
            if r.at_least:
                bounds.append(label)
            if status in ("missed", "inconclusive"):
                short.append(
                    f"{label} {_show(r, bar.unit)} (bar {bar.direction} {bar.threshold:g}{bar.unit})"
                )
    target.status = next((s for s in _ORDER if s in statuses), "met") if statuses else "not measured"
    parts = []
    if short:
        parts.append("outside the bar: " + ", ".join(short))
    if missing:
        parts.append(f"no figure for {', '.join(missing)} in this run")
    if bounds:
        what = "ratio is a lower bound" if all(b.unit == "x" for b in spec.bars) else "figure is a bound"
        parts.append(f"{', '.join(bounds)} did not get there within the cap: {what}")
    if target.status == "inconclusive":
        parts.append("a longer cap could show more")
    target.why = "; ".join(parts) or (spec.met if target.status == "met" else "")
    describe = DESCRIBE.get(spec.name)
    if describe is not None:
        target.figure, target.why = describe(doc, target.why)
    return target


def _check(bar: Bar, r: Reading) -> Status:
    if r.value is None:
        return "not measured"
    ok = _COMPARE[bar.direction](r.value, bar.threshold)
    if not r.at_least:
        return "met" if ok else "missed"
    # The true figure is at least the value: short of a ">=" bar is unknown; past a "<=" bar is a miss.
    if bar.direction == "<=":
        return "inconclusive" if ok else "missed"
    return "met" if ok else "inconclusive"


def _show(r: Reading, unit: str) -> str:
    assert r.value is not None
    return (">= " if r.at_least else "") + f"{r.value:.2f}{unit}"


def evaluate_all(docs: Mapping[str, Document | None]) -> list[Target]:
    """Every target of :data:`TARGETS`, in order; a benchmark's own targets stand for its rows."""
    out: list[Target] = []
    expanded: set[str] = set()
    for spec in TARGETS:
        doc = docs.get(spec.benchmark)
        own = getattr(doc, "targets", None)
        if not spec.bars and own:
            # a benchmark's own targets stand for all of its rows, once (``hot`` has several)
            if spec.benchmark not in expanded:
                out += [Target(t.name, t.threshold, t.figure, t.status, t.why) for t in own]
                expanded.add(spec.benchmark)
        else:
            out.append(evaluate(spec, doc))
    return out


# --------------------------------------------------------------------------------------------------------
# How each target's figures are shown (no decisions here)


def _phase_note(doc: RendezvousDoc, scenario: str) -> str:
    """ " (etcd3: workers started at X s, process group formed at Y s)" from the median phases."""
    block = doc.scenarios.get(scenario)
    res = block.results.get(doc.ours) if block else None
    parts = []
    for key, label in (("workers_started", "workers started"), ("pg_ready", "process group formed")):
        med = median(
            getattr(p, key) for p in (res.phases if res else []) if p and getattr(p, key) is not None
        )
        if med is not None:
            parts.append(f"{label} at {med:.1f} s")
    return f" ({doc.ours}: {', '.join(parts)})" if parts else ""


def _rendezvous(scenario: str, baselines: tuple[str, ...], sep: str) -> Callable[[Any, str], tuple[str, str]]:
    def describe(doc: RendezvousDoc, why: str) -> tuple[str, str]:
        own = doc.summary(scenario, doc.ours)
        if own is None:
            return "not measured", f"{doc.ours} {scenario} not measured"
        figure = f"{doc.ours} {format_summary(own.model_dump())}"
        ratios = doc.ratios.get(scenario) or {}
        shown = [
            f"{b} {format_summary(s.model_dump() if (s := doc.summary(scenario, b)) else {})} "
            f"({format_ratio(r.model_dump() if (r := ratios.get(b)) else None)})"
            for b in baselines
        ]
        if shown:
            figure += "; " + sep.join(shown)
        return figure, why + _phase_note(doc, scenario)

    return describe


def _scale(doc: ScaleDoc, why: str) -> tuple[str, str]:
    at256 = doc.rounds.get("256")
    if at256 is None:
        timed = list(doc.rounds.values())
        why = "no N=256 point in rdzv_scale output" + (" (quick mode?)" if timed else "")
        return (f"N={timed[-1].n}: {_round_figure(timed[-1])}" if timed else "not measured"), why
    own = [r for r in doc.scale_own if isinstance(r, ScaleRound) and r.n == 256]
    if doc.watch in ("shared", "both") or own:
        why = (why + "; " if why else "") + (
            "one watch per host process (as behind an etcd gRPC proxy), a probe participant with its own "
            f"watch finished in {max(at256.probe_s, 0.0):.2f} s"
        )
        if own:
            why += f"; with a watch per participant (N^2 events decoded on 2 cores) {own[0].slowest_s:.2f} s"
    return _round_figure(at256), why


def _round_figure(r: ScaleRound) -> str:
    return (
        f"{r.slowest_s:.2f} s (first round {r.first_round_s:.2f} s, failure round {r.failure_round_s:.2f} s)"
    )


def _writes(doc: ScaleDoc, why: str) -> tuple[str, str]:
    rounds = list(doc.rounds.values())
    if len(rounds) < 2:
        return "not measured", "no write counts in rdzv_scale output"
    lo, hi = rounds[0], rounds[-1]
    figure = f"{lo.writes / lo.n:.1f} writes/participant at N={lo.n}, {hi.writes / hi.n:.1f} at N={hi.n}"
    return figure, why


def _stall(doc: CheckpointDoc, why: str) -> tuple[str, str]:
    figure = ", ".join(f"{r.label}: {r.ratios.stall_over_shm_copy:.2f}x" for r in _by_size(doc))
    return figure or "not measured", why


def _throughput(doc: CheckpointDoc, why: str) -> tuple[str, str]:
    figure = ", ".join(
        f"{r.label}: {r.ratios.durable_over_raw_write:.0%} of raw, {r.ratios.durable_over_dcp:.2f}x DCP"
        for r in _by_size(doc)
    )
    return figure or "not measured", why


def _by_size(doc: CheckpointDoc) -> list[CheckpointSize]:
    return sorted(doc.results, key=lambda r: r.size_mb)


#: Per target name: (document, the evaluated why) -> (measured figures in words, why with its context).
DESCRIBE: dict[str, Callable[[Any, str], tuple[str, str]]] = {
    "launch 3 agents -> first step": _rendezvous("launch", ("c10d", "etcd-v2"), ", "),
    "kill -9 one node -> first step at world 2": _rendezvous("kill", ("etcd-v2", "c10d-tuned"), "; "),
    "add a 4th node -> first step at world 4": _rendezvous("scale_up", (), ""),
    "rendezvous alone at N=256 participants": _scale,
    "etcd writes per rendezvous round": _writes,
    "checkpoint stall of the training loop": _stall,
    "durable checkpoint throughput": _throughput,
}


def median(values: Any) -> float | None:
    """The median of ``values`` (mean of the middle two for an even count), None when empty."""
    vals = sorted(values)
    if not vals:
        return None
    mid = len(vals) // 2
    return float(vals[mid] if len(vals) % 2 else (vals[mid - 1] + vals[mid]) / 2)
