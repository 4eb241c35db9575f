"""Chaos: real jobs (torchrun agents on etcd3, loopback) under seeded random faults, checked for invariants.

Each seed runs one job through :class:`~elastic_train.launch.local.LocalJob` with a plan from
:func:`tests.chaos.plan.make_plan` and asserts: the job finishes by itself (before the launcher's timeout);
every sample of each epoch trained exactly once (audit files); no resume ever came from a corrupted
checkpoint; every committed checkpoint verifies (the deliberately corrupted ones are reported by verify);
final weights equal a fault-free run within 1e-5 relative; no process of the job survives it; no
shared-memory snapshot is left behind; a node started with the job's run id but another checkpoint URL or
node range is refused (exit 2, one line naming the run) and writes nothing; a node cut off from etcd
(``partition-etcd``) has its workers stopped within 2 TTL + 2.5 s and the others train without it within
TTL + 8 s (unless a node lost meanwhile left fewer than the minimum: then they train once it heals; or unless
the job trained its last step before its lease ran out: then it trained to the end with the others), it comes
back and ends with the job without a traceback, and no checkpoint of a world that is no
longer current is ever the newest.

Each seed also draws whether hot recovery is on (:func:`tests.chaos.plan.hot_recovery`). With it on, every
invariant above holds unchanged, and ``hot_kept`` adds: across each kill -9 of a node and each join, the
surviving nodes' worker processes are the same before the fault and once the job trains again, and every
``hot_fallback`` an agent logged names a reason that an injected fault requires (a stopped peer, a worker
that exited, a fenced node). With it off, no agent re-formed a group in-process.

Two seeds in five shard the model (:func:`tests.chaos.plan.sharded`: ``train.fsdp`` with one replica of each
shard): every invariant above holds for the sharded tiers too, the final weights read from the last
checkpoint, a torch.distributed.checkpoint directory.

``make test`` runs seed 0; ``make chaos SEEDS=20`` runs seeds 0..19 and prints a table.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.codec import tensor_at, unflatten
from elastic_train.checkpoint.sharded import manifest as sharded_manifest
from elastic_train.checkpoint.sharded.export import model_tensors
from elastic_train.checkpoint.shmfiles import snapshot_files
from elastic_train.checkpoint.storage import open_storage
from elastic_train.config import load_job_config
from elastic_train.launch.faults import COLLISION_KINDS, Fault, FaultRecord
from elastic_train.launch.local import LocalJob, LocalOptions, Node
from elastic_train.procs import tree
from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from tests.chaos.chaos_task import ENV_FLAG
from tests.chaos.plan import PlanSpec, etcd_members, hot_recovery, make_plan, sharded
from tests.chaos.report import recovery_path
from tests.helpers import log_records

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SPEC = PlanSpec(steps=90, initial_nodes=3, min_nodes=2, max_nodes=4, faults=5, checkpoint_every=10)
TRAIN_SEED = 1234
OUTAGE_SECONDS = 3.0
INTRUDER_WAIT = 3.0
#: The longest a partition-etcd fault cuts a node off from etcd (it heals once the others trained without it
#: for 2 s, and the node rejoins, or ends with the job if the job ended meanwhile).
PARTITION_SECONDS = 12.0


#: Faults the hot path handles in-process: the survivors' workers stay the same processes.
HOT_HANDLED = ("kill-node", "kill-during-checkpoint", "add-node")
#: Seconds between two looks at every node's worker processes (the pids checked by ``hot_kept``).
PID_SAMPLE_S = 0.1
#: Seconds after its fault within which a fallback counts as caused by it.
FALLBACK_WINDOW_S = 30.0
#: The faults that expire a node's own lease: stopped (SIGSTOP) longer than it and resumed, cut off from etcd,
#: or etcd unavailable for longer than it (kind, as in :data:`FALLBACK_CAUSES`).
OWN_LEASE_LOST: tuple[tuple[str, bool | None], ...] = (
    ("hang-node", True),
    ("partition-etcd", True),
    ("restart-etcd", None),
    ("kill-etcd-leader", None),
    ("etcd-quorum-loss", None),
)
#: The faults that leave a node's workers blocked with a peer that stopped (SIGSTOP, or cut off from etcd).
PEER_STOPPED: tuple[tuple[str, bool | None], ...] = (("hang-node", False), ("partition-etcd", False))
#: A ``hot_fallback`` reason (substring) → the faults that require it: (kind, on the node that logged the
#: fallback: True; on another node: False; either: None).
FALLBACK_CAUSES: dict[str, tuple[tuple[str, bool | None], ...]] = {
    # this node's own lease expired (first: its reasons also name a collective or a step boundary)
    "own lease expired": OWN_LEASE_LOST,
    # survivors blocked in a collective with a peer that stopped
    "did not reach a step boundary": PEER_STOPPED,
    "blocked in a collective": PEER_STOPPED,
    # a worker of this node died by itself (the agent sees its pid gone, or torchrun restarted the group)
    "exited": (("kill-worker", True),),
    # this node lost its lease, and its fence stopped its workers
    "was fenced": OWN_LEASE_LOST,
}


def overrides(
    tmp: Path, run_id: str, ckpt_url: str, max_nodes: int, hot: bool | None = None, shard: bool = False
) -> dict[str, Any]:
    extra: dict[str, Any] = {} if hot is None else {"rendezvous.hot": hot}
    if shard:
        extra.update({"train.fsdp": True, "checkpoint.shard_replicas": 1})
    return {
        **extra,
        "rendezvous.run_id": run_id,
        "rendezvous.min_nodes": SPEC.min_nodes,
        "rendezvous.max_nodes": max_nodes,
        "rendezvous.failure_budget": 100,
        "train.task": "tests.chaos.chaos_task:build",
        "train.task_args": {"step_delay": 0.05},
        "train.steps": SPEC.steps,
        "train.global_batch": 24,
        "train.seed": TRAIN_SEED,
        "train.audit_dir": str(tmp / "audit"),
        "checkpoint.url": ckpt_url,
        "checkpoint.every_steps": SPEC.checkpoint_every,
        "checkpoint.keep_last": 100,
        "checkpoint.on_error": "log",
        # a colliding node waits this long for the job to go away before it is refused
        "rendezvous.identity_wait": INTRUDER_WAIT,
    }


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(ENV_FLAG, str(tmp_path / "storage-outage"))


def run_job(tmp: Path, run_id: str, ckpt_url: str, nodes: int, faults: list[Fault], actions=None):
    ov = overrides(tmp, run_id, ckpt_url, SPEC.max_nodes)
    cfg = load_job_config(None, ov)
    job = LocalJob(
        cfg,
        LocalOptions(
            config_path=None, overrides=ov, nodes=nodes, faults=faults, workdir=str(tmp / "work"),
            timeout=420.0, out=io.StringIO(), actions=actions or {},
        ),
    )  # fmt: skip
    summary = job.run()
    return cfg, job, summary


def final_weights(ckpt_url: str, run_id: str) -> dict[str, torch.Tensor]:
    storage = open_storage(ckpt_url)
    _, entries = durable.resolve(storage, storage.join(storage.root, run_id))
    entry = max((e for e in entries if e.valid), key=lambda e: e.step)
    assert entry.manifest is not None
    if entry.manifest.get("format") == sharded_manifest.FORMAT:  # a DCP directory
        return model_tensors(storage, entry.path, entry.manifest)
    buf, specs = durable.load(storage, entry)
    state = unflatten(entry.manifest["skeleton"], [tensor_at(buf, s) for s in specs])
    return {k: v.clone() for k, v in state["model"].items()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """Final weights of the same job without faults (2 nodes)."""
    tmp = tmp_path_factory.mktemp("reference")
    mp = pytest.MonkeyPatch()
    mp.setenv("PYTHONPATH", str(ROOT))
    try:
        _, _, summary = run_job(tmp, "chaos-reference", str(tmp / "ckpt"), 2, [])
    finally:
        mp.undo()
    assert summary.succeeded, f"the fault-free reference run failed; logs in {tmp / 'work'}"
    return final_weights(str(tmp / "ckpt"), "chaos-reference")


def corrupt_newest(ckpt_root: str, run_id: str, fault: FaultRecord, flipped: set[tuple[str, int]]) -> None:
    """Flip one byte in the middle of a share file of the newest committed checkpoint. ``flipped``: the
    (file, offset) pairs flipped before; a second fault on the same checkpoint (no newer one committed
    meanwhile) flips the byte after them, since flipping one twice would restore it."""
    storage = open_storage(ckpt_root)
    entries = [e for e in durable.list_entries(storage, storage.join(storage.root, run_id)) if e.valid]
    if not entries:
        fault.extra["skipped"] = "no checkpoint yet"
        return
    entry = max(entries, key=lambda e: e.step)
    assert entry.manifest is not None
    share = next(f for f in entry.manifest["files"] if f["size"] > 0)
    path = os.path.join(
        ckpt_root.removeprefix("flaky://"), run_id, os.path.basename(entry.path), share["name"]
    )
    offset = share["size"] // 2
    while (path, offset) in flipped and offset + 1 < share["size"]:
        offset += 1
    flipped.add((path, offset))
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
    fault.extra.update(step=entry.step, file=share["name"], offset=offset)


def test_chaos_invariants(
    chaos_seed: int, tmp_path: Path, reference: dict[str, torch.Tensor], chaos_results: list[dict[str, Any]]
) -> None:
    run_id = f"chaos-{chaos_seed}"
    ckpt_url = f"flaky://{tmp_path / 'ckpt'}"
    plan = make_plan(chaos_seed, SPEC)
    flag = tmp_path / "storage-outage"
    job_ref: dict[str, LocalJob] = {}

    def kill_during_checkpoint(fault: FaultRecord, node: Node | None) -> None:
        job_ref["job"].actions["kill-node"](fault, node)

    def storage_outage(fault: FaultRecord, _node: Node | None) -> None:
        flag.touch()
        threading.Timer(OUTAGE_SECONDS, lambda: flag.unlink(missing_ok=True)).start()
        fault.extra["seconds"] = OUTAGE_SECONDS

    flipped: set[tuple[str, int]] = set()

    def corrupt(fault: FaultRecord, _node: Node | None) -> None:
        corrupt_newest(ckpt_url, run_id, fault, flipped)

    actions = {
        "kill-during-checkpoint": kill_during_checkpoint,
        "storage-outage": storage_outage,
        "corrupt-checkpoint": corrupt,
    }
    hot, shard = hot_recovery(chaos_seed), sharded(chaos_seed)
    ov = overrides(tmp_path, run_id, ckpt_url, SPEC.max_nodes, hot=hot, shard=shard)
    cfg = load_job_config(None, ov)
    job = LocalJob(
        cfg,
        LocalOptions(
            config_path=None, overrides=ov, nodes=SPEC.initial_nodes, faults=plan,
            workdir=str(tmp_path / "work"), timeout=420.0, out=io.StringIO(), actions=actions,
            etcd_members=etcd_members(chaos_seed), partition_s=PARTITION_SECONDS,
        ),
    )  # fmt: skip
    job_ref["job"] = job
    pids = PidSampler(job)
    with pids:
        summary = job.run()
    flag.unlink(missing_ok=True)

    inv: dict[str, bool] = {}
    detail: dict[str, Any] = {}
    # ... by itself: every node exited before the launcher's timeout stopped what was left
    timed_out = "!! timeout" in job.opts.out.getvalue()  # type: ignore[attr-defined]
    inv["finished"] = summary.succeeded and summary.completed_steps == SPEC.steps and not timed_out
    detail["timed_out"] = timed_out
    audit = check_exactly_once(str(tmp_path / "audit"), steps=summary.completed_steps)
    inv["exactly_once"] = audit.ok and summary.completed_steps == SPEC.steps
    detail["audit"] = audit.problems[:5]

    records = summary.faults
    corrupted = {
        int(f.extra["step"]) for f in records if f.kind == "corrupt-checkpoint" and "step" in f.extra
    }
    events = read_events(os.path.join(job.opts.workdir, "events.jsonl"))
    durable_resumes = [e for e in events if e.get("event") == "resumed" and e.get("source") == "durable"]
    inv["no_corrupt_resume"] = all(e.get("from_step") not in corrupted for e in durable_resumes)

    storage = open_storage(ckpt_url)
    run_path = storage.join(storage.root, run_id)
    bad = {}
    for name in storage.listdir(run_path):
        if (
            not name.startswith("step-")
            or storage.size(storage.join(run_path, name, durable.MANIFEST)) is None
        ):
            continue
        problems = durable.verify(storage, storage.join(run_path, name))
        step = int(name.split("-")[1])
        if bool(problems) != (step in corrupted):
            bad[name] = problems or "corruption not detected"
    inv["checkpoints_verify"] = not bad
    detail["verify"] = bad

    try:
        weights = final_weights(ckpt_url, run_id)
        rel = max(
            float((weights[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)) for k, v in reference.items()
        )
    except Exception as exc:  # reported as a failed invariant with its reason
        rel, detail["weights"] = float("inf"), repr(exc)
    inv["weights_equal"] = rel <= 1e-5
    detail["max_rel_diff"] = rel

    intruders = [f for f in records if f.kind in COLLISION_KINDS]
    refused = [
        f.extra.get("exit_code") == 2
        and str(f.extra.get("line", "")).startswith(f"elastic-train: error: run {run_id} ")
        for f in intruders
    ]
    inv["intruders_refused"] = all(refused) and not os.path.exists(
        os.path.join(job.opts.workdir, "collision-checkpoints", run_id)
    )
    detail["intruders"] = [f.extra for f in intruders]

    inv["partition_fenced"], detail["partitions"] = partitions_held(
        job, records, cfg.rendezvous.lease_ttl, events
    )
    newest = durable.newest_valid(storage, run_path)
    # where each world started: the lineage record, and each valid manifest's own (round, base) (a lineage
    # write can fail in a storage outage)
    entries = [e for e in durable.list_entries(storage, run_path) if e.valid]
    known = {(e.round, e.base) for e in entries if e.round is not None and e.base is not None}
    starts = sorted(set(durable.read_lineage(storage, run_path)) | known)
    # the newest checkpoint is the final one, of the last world that trained a step (worlds that formed at
    # the end, from the final state, train none)
    last = max((r for r, base in starts if newest is not None and base < newest.step), default=None)
    # a world formed after it from the final state may write the final checkpoint again (the last world's
    # final write failed, e.g. its group broke under it): the same state, not a stale one
    after = [base for r, base in starts if last is not None and r > last]
    inv["no_stale_newest"] = (
        newest is not None
        and newest.step == SPEC.steps
        and (
            newest.round == last
            or (newest.round in {r for r, _ in starts} and all(b == SPEC.steps for b in after))
        )
    )
    detail["newest"] = (newest.path if newest else None, starts[-3:])

    fallbacks, rounds = agent_events(job, "hot_fallback"), agent_events(job, "hot_round")
    inv["hot_kept"], detail["hot"] = hot_kept(fallbacks, rounds, records, pids.samples, hot)
    fell_back = [(t, n, str(rec.get("reason", ""))) for t, n, rec in fallbacks]
    formed = [(t, n, "") for t, n, _ in rounds]

    inv["no_orphans"] = not [p.pid for p in job.known_procs.values() if _running(p)]
    inv["no_shm_leak"] = not snapshot_files(cfg.checkpoint.memory_dir, run_id)

    chaos_results.append(
        {
            "seed": chaos_seed,
            "etcd_members": etcd_members(chaos_seed),
            "hot": hot,
            "sharded": shard,
            "hot_detail": detail["hot"],
            "faults": [
                {
                    **f.to_json(),
                    "path": recovery_path(
                        f.kind, f.fault.node, f.fired_at, f.resumed_at, hot, formed, fell_back
                    ),
                }
                for f in records
            ],
            "wall_s": summary.wall_s,
            "invariants": inv,
        }
    )
    failed = [k for k, ok in inv.items() if not ok]
    assert not failed, (
        f"seed {chaos_seed} (hot {hot}, sharded {shard}): invariants failed: {failed}\n"
        f"plan: {[f.label for f in plan]}\n"
        f"detail: {json.dumps(detail, default=str)[:2000]}\nlogs: {job.opts.workdir}"
    )


Sample = tuple[float, dict[int, frozenset[int]]]
"""When, and each running node's worker pids then."""
AgentEvent = tuple[float, int, dict[str, Any]]
"""When, on which node, and the agent's log record."""


class PidSampler:
    """Samples every running node's worker pids while the job runs (every :data:`PID_SAMPLE_S`), and once more
    right before each fault is injected (its action is wrapped), so that ``hot_kept`` can compare a node's
    workers before a fault with those once the job trains again."""

    def __init__(self, job: LocalJob) -> None:
        self.job = job
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pid-sampler", daemon=True)
        for kind, action in list(job.actions.items()):
            job.actions[kind] = self._before(action)

    def _before(self, action: Any) -> Any:
        def act(record: FaultRecord, node: Node | None) -> None:
            self.sample()
            action(record, node)

        return act

    def sample(self) -> None:
        pids = {
            n.index: frozenset(p.pid for p in tree(n.proc.pid)[1:] if _is_worker(p))
            for n in list(self.job.nodes)
            if n.proc.poll() is None and not n.stopped and not n.killed
        }
        self.samples.append((time.time(), pids))

    def _loop(self) -> None:
        while not self._stop.wait(PID_SAMPLE_S):
            self.sample()

    def __enter__(self) -> PidSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _is_worker(p: Any) -> bool:
    try:
        return "elastic_train.worker" in p.cmdline()
    except Exception:  # gone meanwhile: not a worker of the sample
        return False


def agent_events(job: LocalJob, name: str) -> list[AgentEvent]:
    """(time, node index, record) of every ``name`` line the nodes' agents logged."""
    out = []
    for node in job.nodes:
        for rec in log_records(Path(node.log_path), name):
            if isinstance(rec.get("timestamp"), str):
                when = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
                out.append((when, node.index, rec))
    return sorted(out, key=lambda x: x[0])


def hot_kept(
    fallbacks: list[AgentEvent], rounds: list[AgentEvent], records: list[FaultRecord], samples: list[Sample],
    hot: bool,
) -> tuple[bool, dict[str, Any]]:  # fmt: skip
    """Hot on: across each fault the hot path handles (:data:`HOT_HANDLED`), every node that was training
    before it kept its worker pids until the job trained again, and every ``hot_fallback`` has a cause
    (:data:`FALLBACK_CAUSES`: a fault of a kind that requires it, injected in the 30 s before, or a node
    hung until then). Hot off: no agent formed a round in-process.

    A node's workers count as "training before" when its pids were the same in every sample of the last
    second before the fault (a node still restarting or starting its workers is not a survivor yet). A node
    that another fault hit meanwhile (faults overlap: a joiner killed while it joins), a node that fell
    back in the window, and a node whose workers are an earlier fault's victims still on their way out (a
    partitioned node's fenced worker, exiting while the others train without it) are not survivors: the
    fallback check judges those."""
    if not hot:
        return not rounds and not fallbacks, {"hot_rounds": len(rounds), "fallbacks": len(fallbacks)}
    fired = [f for f in records if f.fired_at is not None]
    kept: list[str] = []
    broken: list[Any] = []
    skipped: dict[str, str] = {}
    for f in fired:
        assert f.fired_at is not None
        if f.kind not in HOT_HANDLED:
            continue
        if f.resumed_at is None:
            skipped[f.label] = "the job did not train in a later round"
            continue
        start, end = f.fired_at, f.resumed_at
        # nodes another fault hit meanwhile (a kill of a joiner, a hang) are not survivors of this one
        hit = {
            o.fault.node
            for o in fired
            if o.fault.node is not None and start - 1.0 <= (o.fired_at or 0) <= end
        }
        window = [pids for t, pids in samples if start - 1.0 <= t <= start]
        after = next((pids for t, pids in samples if t >= end), None)
        if not window or after is None:
            skipped[f.label] = "no pid sample before or after"
            continue
        fell_back = {n for t, n, _ in fallbacks if start <= t <= end + 1.0}
        victims = {pid for o in fired if (o.fired_at or 0) < start for pid in o.extra.get("pids", ())}
        survivors = {
            n: p for n, p in window[-1].items()
            if p and n != f.fault.node and n not in hit | fell_back and all(w.get(n) == p for w in window)
            and not p & victims
        }  # fmt: skip
        changed = {n: sorted(p) for n, p in survivors.items() if after.get(n) != p}
        if changed:
            broken.append(
                {"fault": f.label, "before": changed, "after": {n: sorted(after.get(n, ())) for n in changed}}
            )
        elif survivors:
            kept.append(f.label)
        else:
            skipped[f.label] = f"no node trained steadily before it (fell back: {sorted(fell_back)})"
    unexplained = []
    for when, node, rec in fallbacks:
        reason = str(rec.get("reason", ""))
        cause = next((c for marker, c in FALLBACK_CAUSES.items() if marker in reason), None)
        if cause is None or not any(_causes(f, cause, node, when, fired) for f in fired):
            unexplained.append({"node": node, "reason": reason[:200]})
    detail = {
        "kept": kept,
        "broken": broken,
        "skipped": skipped,
        "fallbacks": [str(r.get("reason", ""))[:80] for _, _, r in fallbacks],
        "unexplained": unexplained,
        "hot_rounds": len(rounds),
    }
    return not broken and not unexplained, detail


def _causes(
    f: FaultRecord,
    cause: tuple[tuple[str, bool | None], ...],
    node: int,
    when: float,
    fired: list[FaultRecord],
) -> bool:
    """Whether fault ``f`` explains a fallback on ``node`` at ``when``: a kind that requires it, on the
    right node, at most :data:`FALLBACK_WINDOW_S` before (a hung node: after it was resumed)."""
    where = dict(cause)
    if f.kind not in where or f.fired_at is None or f.fired_at > when:
        return False
    same_node = where[f.kind]
    if same_node is not None and f.fault.node is not None and (f.fault.node == node) != same_node:
        return False
    since = f.fired_at
    if f.kind == "hang-node":
        resumed = [o.fired_at for o in fired if o.kind == "resume-node" and o.fault.node == f.fault.node]
        since = min((t for t in resumed if t is not None and t >= f.fired_at), default=when)
    return when - since <= FALLBACK_WINDOW_S


def partitions_held(
    job: LocalJob, records: list[FaultRecord], ttl: float, events: list[dict[str, Any]]
) -> tuple[bool, list[Any]]:
    """Each partitioned node's workers were gone within 2 TTL + 2.5 s of the cut (the others re-form a TTL and
    a round close after the cut; the fence then needs TTL + grace of stall, and its SIGKILL grace), the others
    trained at a smaller world within TTL + 8 s (unless another node lost meanwhile left fewer than
    ``min_nodes``, :func:`_short_of_min_nodes`), the node came back after the heal or ended with the job
    (exit 0), and its agent printed no traceback. A cut only silences the node's etcd traffic, so when the
    job trained its last step before the node's lease ran out (an etcd restart meanwhile renews every lease)
    no round forms without it while there is training left: its workers trained to the end of the run with
    the others (``finished_first``; a world may still form after that to write the final checkpoint)."""
    out, ok = [], True
    for f in (r for r in records if r.kind == "partition-etcd"):
        node = job.nodes[f.fault.node] if f.fault.node is not None else None
        gone = f.extra.get("workers_gone_s")
        reformed = None if f.resumed_at is None or f.fired_at is None else f.resumed_at - f.fired_at
        log = Path(node.log_path).read_text(errors="replace") if node else ""
        fact = {
            "workers_gone_s": gone,
            "reformed_s": reformed,
            "exit_code": node.proc.returncode if node else None,
            # the agent's lines (a worker whose peers reset its collective prints torch's error as "[rankN]")
            "traceback": any("Traceback" in ln for ln in log.splitlines() if not ln.startswith("[rank")),
            "rejoined": "reason=rejoin" in log or '"reason": "rejoin"' in log,
            "finished_first": reformed is None
            and ('"event": "training_done"' in log or _trained_to_end(events, f.fired_round)),
        }
        short = _short_of_min_nodes(f, records, events, ttl)
        fact["short_of_min_nodes"] = short
        fenced_in_time = (
            isinstance(gone, float) and gone <= 2 * ttl + 2.5
            and reformed is not None and (reformed <= ttl + 8.0 or short)
        )  # fmt: skip
        ok = ok and (
            (fact["finished_first"] or fenced_in_time) and fact["exit_code"] == 0 and not fact["traceback"]
        )
        out.append(fact)
    return ok, out


#: Faults that take a node out of the job until it comes back by itself (or never).
NODE_LOSSES = ("kill-node", "kill-during-checkpoint", "preempt-node", "hang-node", "partition-etcd")


def _short_of_min_nodes(
    f: FaultRecord, records: list[FaultRecord], events: list[dict[str, Any]], ttl: float
) -> bool:
    """Whether the nodes left after the cut of ``f`` were fewer than the run's ``min_nodes`` until the others
    trained again: another node lost from a lease before the cut to the others' resumption (a kill, a hang,
    a second cut) leaves no round to form without the cut node, and the others wait until it heals or a new
    node joins (the re-formation's time is then the heal's, not the fence's)."""
    if f.fired_at is None:
        return False
    steps = [e for e in events if e.get("event") == "step" and e.get("round") == f.fired_round]
    world = max((int(e["world_size"]) for e in steps), default=None)
    if world is None:
        return False
    until = f.resumed_at if f.resumed_at is not None else float("inf")
    lost = {
        o.fault.node
        for o in records
        if o.kind in NODE_LOSSES and o is not f and o.fault.node != f.fault.node
        and o.fired_at is not None and f.fired_at - ttl <= o.fired_at <= until
    }  # fmt: skip
    return world - 1 - len(lost) < SPEC.min_nodes


def _trained_to_end(events: list[dict[str, Any]], round_: int | None) -> bool:
    """Whether the world of rendezvous round ``round_`` trained the run's last step."""
    return any(
        e.get("event") == "step" and e.get("step") == SPEC.steps and e.get("round") == round_ for e in events
    )


def _running(p: Any) -> bool:
    try:
        return bool(p.is_running()) and p.status() != "zombie"
    except Exception:
        return False
