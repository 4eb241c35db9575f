"""The chaos table: faults injected by kind, recoveries, steps redone, invariant results."""

from __future__ import annotations

from collections import Counter
from typing import Any

#: Faults that change membership, so the job must form a new round (the others must not stop training).
ROUND_KINDS = ("kill-worker", "kill-node", "kill-during-checkpoint", "hang-node", "resume-node", "add-node",
               "partition-etcd")  # fmt: skip
INVARIANTS = ("finished", "exactly_once", "no_corrupt_resume", "checkpoints_verify", "weights_equal",
              "no_orphans", "no_shm_leak")  # fmt: skip
#: A node started with the job's run id and other settings was refused and wrote nothing (collision kinds).
INVARIANTS += ("intruders_refused",)
#: A partitioned node fenced itself, the others went on without it, it came back, no stale checkpoint won.
INVARIANTS += ("partition_fenced", "no_stale_newest")
#: Hot recovery on: survivors of a kill or a join kept their worker processes, and every fallback to the
#: restart path had an injected fault that requires it; off: no group re-formed in-process.
INVARIANTS += ("hot_kept",)

#: Fallback reasons as the table counts them (the first marker found in the agent's ``hot_fallback`` reason).
FALLBACK_LABELS = (
    ("own lease expired", "node stopped or cut off"),
    ("did not reach a step boundary", "peer stopped (no step boundary)"),
    ("blocked in a collective", "peer stopped (no step boundary)"),
    ("exited", "a worker exited"),
    ("was fenced", "node fenced"),
)


#: The recovery path a fault took (each fault's ``path`` in the results; see :func:`recovery_path`).
IN_PROCESS, RESTART, HOT_OFF, NO_ROUND = "in-process", "restart", "restart (hot off)", "-"
#: Seconds after a fault's recovery within which an agent's event still belongs to it.
PATH_SLACK_S = 1.0

Event = tuple[float, int, str]
"""An agent's log event: when, on which node, and its reason (empty for a ``hot_round``)."""


def recovery_path(
    kind: str, node: int | None, fired_at: float | None, resumed_at: float | None, hot: bool,
    rounds: list[Event], fallbacks: list[Event],
) -> str:  # fmt: skip
    """How the job got from a fault to training in a new round, from the agents' events in between.

    ``in-process``: the agents formed the new round on the hot path (``hot_round``) and no node but the one
    the fault hit fell back (a killed worker's own node restarting its workers is the fault itself);
    ``restart (...)``: a surviving node fell back to torchrun's restart path, with the first reason label;
    ``restart (hot off)``: the run had hot recovery off; ``-``: no new round was formed (a fault that needs
    none, or one the job ended before recovering from).
    """
    if kind not in ROUND_KINDS or fired_at is None or resumed_at is None:
        return NO_ROUND
    if not hot:
        return HOT_OFF
    end = resumed_at + PATH_SLACK_S
    fell_back = [(n, why) for t, n, why in fallbacks if fired_at <= t <= end and n != node]
    if fell_back:
        why = fell_back[0][1]
        return f"{RESTART} ({next((label for marker, label in FALLBACK_LABELS if marker in why), why[:40])})"
    if any(fired_at <= t <= end for t, _, _ in rounds):
        return IN_PROCESS
    return RESTART


def hot_summary(results: list[dict[str, Any]]) -> list[str]:
    """The hot/restart mix: runs of each, survivors that kept their workers, fallbacks by reason."""
    hot = [r for r in results if r.get("hot")]
    if not any("hot" in r for r in results):
        return []
    kept = sum(len(r.get("hot_detail", {}).get("kept", [])) for r in hot)
    broken = sum(len(r.get("hot_detail", {}).get("broken", [])) for r in hot)
    rounds = sum(int(r.get("hot_detail", {}).get("hot_rounds", 0)) for r in hot)
    reasons: Counter[str] = Counter()
    for r in hot:
        for reason in r.get("hot_detail", {}).get("fallbacks", []):
            reasons[next((label for marker, label in FALLBACK_LABELS if marker in reason), reason[:40])] += 1
    fallbacks = ", ".join(f"{label} {n}" for label, n in sorted(reasons.items())) or "none"
    return [
        f"hot recovery: {len(hot)} run(s) on, {len(results) - len(hot)} on the restart path; "
        f"{rounds} in-process round(s) (per node); survivors kept their workers across {kept} kill/join "
        f"fault(s), restarted across {broken}; fallbacks to the restart path: {fallbacks}"
    ]


def render(results: list[dict[str, Any]]) -> str:
    kinds: Counter[str] = Counter()
    recovered: Counter[str] = Counter()
    paths: dict[str, Counter[str]] = {}
    redone: list[int] = []
    resume_s: list[float] = []
    head = f"{'seed':>5} {'etcd':>4} {'hot':>3} {'model':>5} {'faults':>7} {'wall s':>7}  "
    lines = [head + " ".join(f"{i[:12]:>12}" for i in INVARIANTS)]
    for r in results:
        for f in r["faults"]:
            kinds[f["kind"]] += 1
            if f["kind"] in ROUND_KINDS and f.get("resumed_s") is not None:
                recovered[f["kind"]] += 1
                resume_s.append(f["resumed_s"])
                paths.setdefault(f["kind"], Counter())[f.get("path", "?")] += 1
            if f.get("steps_redone") is not None:
                redone.append(f["steps_redone"])
        marks = " ".join(f"{'ok' if r['invariants'].get(i) else 'FAIL':>12}" for i in INVARIANTS)
        members = r.get("etcd_members", 1)
        hot = "on" if r.get("hot") else "off"
        model = "fsdp" if r.get("sharded") else "ddp"
        lines.append(
            f"{r['seed']:>5} {members:>4} {hot:>3} {model:>5} {len(r['faults']):>7} {r['wall_s']:>7.1f}  "
            f"{marks}"
        )
    lines.append("")
    lines.append(f"{'fault kind':<24}{'injected':>9}{'recovered in a new round':>26}  recovery path")
    for kind, n in sorted(kinds.items()):
        how = ", ".join(f"{p} {c}" for p, c in sorted(paths.get(kind, Counter()).items()))
        lines.append(
            f"{kind:<24}{n:>9}{recovered[kind] if kind in ROUND_KINDS else 'n/a (no round)':>26}"
            f"  {how or '-'}"
        )
    total = sum(kinds.values())
    every = sum((c for c in paths.values()), Counter())
    how = ", ".join(f"{p} {c}" for p, c in sorted(every.items()))
    lines.append(f"{'total':<24}{total:>9}{sum(recovered.values()):>26}  {how or '-'}")
    if resume_s:
        resume_s.sort()
        lines.append(
            f"recovery (fault → training again): median {resume_s[len(resume_s) // 2]:.2f}s, "
            f"max {resume_s[-1]:.2f}s; steps redone: max {max(redone) if redone else 0}, "
            f"total {sum(redone)}"
        )
    lines += hot_summary(results)
    passed = sum(all(r["invariants"].get(i) for i in INVARIANTS) for r in results)
    lines.append(f"runs with every invariant held: {passed}/{len(results)}")
    return "\n".join(lines)


def fault_rows(results: list[dict[str, Any]]) -> list[str]:
    """A markdown table of every fault of every run, with the recovery path it took."""

    def cell(v: Any, unit: str = "") -> str:
        return "-" if v is None else f"{v:.2f}{unit}" if isinstance(v, float) else str(v)

    rows = [
        "| seed | hot | fault | detected | training again | world | steps redone | state from "
        "| recovery path |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for f in r["faults"]:
            label = f"{f['kind']} {'' if f.get('node') is None else f['node']}@step={f['step']}"
            if f["kind"] not in ROUND_KINDS:  # training goes on through it: no recovery to time
                rows.append(
                    f"| {r['seed']} | {'on' if r.get('hot') else 'off'} | `{label}` | | | | | | no round |"
                )
                continue
            rows.append(
                f"| {r['seed']} | {'on' if r.get('hot') else 'off'} | `{label}` "
                f"| {cell(f.get('detected_s'), ' s')} "
                f"| {cell(f.get('resumed_s'), ' s')} | {cell(f.get('resumed_world_size'))} "
                f"| {cell(f.get('steps_redone'))} | {cell(f.get('source'))} | {f.get('path', '?')} |"
            )
    return rows


def markdown(results: list[dict[str, Any]], *, command: str) -> str:
    """docs/chaos.md: what ran, the table, and how to reproduce it."""
    import platform
    import time

    import torch

    total = sum(len(r["faults"]) for r in results)
    passed = sum(all(r["invariants"].get(i) for i in INVARIANTS) for r in results)
    return "\n".join(
        [
            "# Chaos runs",
            "",
            f"Generated by `make chaos` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
            f"{len(results)} seeded runs, {total} faults injected, every invariant held in {passed} of "
            f"{len(results)} runs.",
            "",
            f"Command: `{command}` (Python {platform.python_version()}, torch {torch.__version__}, "
            f"{platform.machine()}).",
            "",
            "Each run is a real job (torchrun agents on the etcd3 rendezvous, loopback, embedded etcd, the "
            "regression task, 3 nodes on 2:4, 90 steps) with faults drawn from the seed "
            "(tests/chaos/plan.py): kill -9 of a worker, of a node (also right when a durable checkpoint "
            "is due), SIGSTOP and later SIGCONT of a node, a node joining, etcd killed and restarted, the "
            "newest checkpoint corrupted on disk, storage failing for 3 s. Odd seeds run on a 3-member etcd "
            "(column `etcd`) and open with an etcd fault: the leader killed (restarted 3 s later) or two of "
            "three members stopped for 4 s (no quorum), instead of a restart. Seeds 2, 6, 10 … open with "
            "`partition-etcd`: one node's etcd traffic silently dropped (held, no reset) until the others "
            "trained without it for 2 s (at most 12 s), then healed. Invariants checked after each run: "
            "finished (by itself: no node still running at the launcher's 420 s timeout); "
            "every sample of each epoch trained exactly once (audit files); no resume from a "
            "corrupted checkpoint; every committed checkpoint verifies and the corrupted ones are reported; "
            "final weights equal the fault-free run within 1e-5 relative; no process of the job left; no "
            "shared-memory snapshot left; a partitioned node's workers gone within 2 TTL + 2.5 s of the "
            "cut and the others training without it within TTL + 8 s (once the heal let it back, when a "
            "node lost meanwhile left fewer than the minimum nodes; or, when the job trained its last "
            "step before the node's lease ran out, the node training to the end with the others), the node "
            "back and ending with the job, no traceback (`partition_fenced`); the newest checkpoint is the "
            "last training world's, or of a world formed after it from the final state "
            "(`no_stale_newest`).",
            "",
            "Hot recovery (column `hot`, docs/rendezvous.md) is drawn per run, since `rendezvous.hot` is a "
            "job setting: two seeds in three run with it on (0, 2, 3, 5, 6 …), the others on the restart "
            "path (1, 4, 7, 10 …), independently of the etcd size and the partition seeds. Every invariant "
            "above is checked for both. `hot_kept` adds, with hot on: across each kill -9 of a node (also "
            "when a checkpoint is due) and each join, every node that was training before the fault has the "
            "same worker processes once the job trains again (pids sampled every 0.1 s and right before each "
            "fault; a node another fault hit meanwhile, or that fell back, is no survivor), and every "
            "`hot_fallback` an agent logged has a cause among the injected faults of the 30 s before: a "
            'stopped peer (SIGSTOP, a partition) for "did not reach a step boundary", a killed worker of '
            'that node for "exited", a stop or partition of that node or an etcd fault for "own lease '
            'expired", a partition or an etcd fault for "fenced". With hot off it checks that no group '
            "re-formed in-process.",
            "",
            "Two seeds in five (2, 4, 7, 9 …; column `model`) shard the model: `train.fsdp` (FSDP2) with "
            "`checkpoint.shard_replicas: 1`, so the memory tier keeps each rank's shards and a replica of "
            "another node's, a membership change re-shards from the survivors' memory, and the durable "
            "checkpoints are torch.distributed.checkpoint directories. Every invariant above is checked "
            "for them too (the final weights read back from the last DCP checkpoint); the other seeds "
            "replicate the model with DDP.",
            "",
            "```text",
            render(results),
            "```",
            "",
            "## Every fault and the path it took",
            "",
            "*recovery path*: `in-process` — the agents formed the new round on the hot path and every "
            "surviving node kept its worker processes (the node a killed worker belonged to restarts its "
            "own); `restart (why)` — a surviving node fell back to torchrun's restart path, for the reason "
            "its agent's `hot_fallback` line gave; `restart (hot off)` — the run had hot recovery off; "
            "`no round` — a fault training goes on through (etcd, storage, a corrupted checkpoint, a refused "
            "intruder); `-` — the job ended before a new round formed. "
            "*detected* and *training again* count from the fault.",
            "",
            *fault_rows(results),
            "",
            "Recovery: from a membership fault (kill, hang, resume, join) to the first step completed in a "
            "later rendezvous round. etcd restarts, leader kills and quorum losses, storage outages and "
            "corruption need no new round: "
            "training goes on through them. A join (or a hang of a node that is still starting) that lands "
            "in the last seconds of a 90-step run can end with the job before any new round forms: those are "
            "the injected faults without a recovery.",
            "",
        ]
    )
