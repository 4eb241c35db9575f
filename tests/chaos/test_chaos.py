"""Chaos: real jobs (torchrun agents on etcd3, loopback) under seeded random faults, checked for invariants.

Each seed runs one job through :class:`~elastic_train.launch.local.LocalJob` with a plan from
:func:`tests.chaos.plan.make_plan` and asserts: the job finishes; every sample of each epoch trained exactly
once (audit files); no resume ever came from a corrupted checkpoint; every committed checkpoint verifies
(the deliberately corrupted ones are reported by verify); final weights equal a fault-free run within 1e-5
relative; no process of the job survives it; no shared-memory snapshot is left behind; a node started with the
job's run id but another checkpoint URL or node range is refused (exit 2, one line naming the run) and
writes nothing; a node cut off from etcd (``partition-etcd``) has its workers stopped within TTL + 1.5 s, the
others train without it within TTL + 8 s, it comes back and ends with the job without a traceback, and no
checkpoint of a world that is no longer current is ever the newest.

``make test`` runs seed 0; ``make chaos SEEDS=20`` runs seeds 0..19 and prints a table.
"""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.codec import tensor_at, unflatten
from elastic_train.checkpoint.memory import snapshot_files
from elastic_train.checkpoint.storage import open_storage
from elastic_train.config import load_job_config
from elastic_train.launch.faults import COLLISION_KINDS, Fault, FaultRecord
from elastic_train.launch.local import LocalJob, LocalOptions, Node
from elastic_train.train.audit import check_exactly_once
from elastic_train.train.events import read_events
from tests.chaos.chaos_task import ENV_FLAG
from tests.chaos.plan import PlanSpec, etcd_members, make_plan

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
SPEC = PlanSpec(steps=90, initial_nodes=3, min_nodes=2, max_nodes=4, faults=5, checkpoint_every=10)
TRAIN_SEED = 1234
OUTAGE_SECONDS = 3.0
INTRUDER_WAIT = 3.0
#: The longest a partition-etcd fault cuts a node off from etcd (it heals once the others trained without it
#: for 2 s, and the node rejoins, or ends with the job if the job ended meanwhile).
PARTITION_SECONDS = 12.0


def overrides(tmp: Path, run_id: str, ckpt_url: str, max_nodes: int) -> dict[str, Any]:
    return {
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


def corrupt_newest(ckpt_root: str, run_id: str, fault: FaultRecord) -> None:
    """Flip one byte in the middle of a share file of the newest committed checkpoint."""
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
    with open(path, "r+b") as f:
        f.seek(share["size"] // 2)
        byte = f.read(1)
        f.seek(share["size"] // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    fault.extra.update(step=entry.step, file=share["name"])


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

    def corrupt(fault: FaultRecord, _node: Node | None) -> None:
        corrupt_newest(ckpt_url, run_id, fault)

    actions = {
        "kill-during-checkpoint": kill_during_checkpoint,
        "storage-outage": storage_outage,
        "corrupt-checkpoint": corrupt,
    }
    ov = overrides(tmp_path, run_id, ckpt_url, SPEC.max_nodes)
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
    summary = job.run()
    flag.unlink(missing_ok=True)

    inv: dict[str, bool] = {}
    detail: dict[str, Any] = {}
    inv["finished"] = summary.succeeded and summary.completed_steps == SPEC.steps
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

    inv["partition_fenced"], detail["partitions"] = partitions_held(job, records, cfg.rendezvous.lease_ttl)
    newest = durable.newest_valid(storage, run_path)
    # where each world started: the lineage record, and each valid manifest's own (round, base) (a lineage
    # write can fail in a storage outage)
    entries = [e for e in durable.list_entries(storage, run_path) if e.valid]
    known = {(e.round, e.base) for e in entries if e.round is not None and e.base is not None}
    starts = sorted(set(durable.read_lineage(storage, run_path)) | known)
    # the newest checkpoint is the final one, of the last world that trained a step (worlds that formed at
    # the end, from the final state, train none)
    last = max((r for r, base in starts if newest is not None and base < newest.step), default=None)
    inv["no_stale_newest"] = newest is not None and newest.step == SPEC.steps and newest.round == last
    detail["newest"] = (newest.path if newest else None, starts[-3:])

    inv["no_orphans"] = not [p.pid for p in job.known_procs.values() if _running(p)]
    inv["no_shm_leak"] = not snapshot_files(cfg.checkpoint.memory_dir, run_id)

    chaos_results.append(
        {
            "seed": chaos_seed,
            "etcd_members": etcd_members(chaos_seed),
            "faults": [f.to_json() for f in records],
            "wall_s": summary.wall_s,
            "invariants": inv,
        }
    )
    failed = [k for k, ok in inv.items() if not ok]
    assert not failed, (
        f"seed {chaos_seed}: invariants failed: {failed}\nplan: {[f.label for f in plan]}\n"
        f"detail: {json.dumps(detail, default=str)[:2000]}\nlogs: {job.opts.workdir}"
    )


def partitions_held(job: LocalJob, records: list[FaultRecord], ttl: float) -> tuple[bool, list[Any]]:
    """Each partitioned node's workers were gone within 2 TTL + 2.5 s of the cut (the others re-form a TTL and
    a round close after the cut; the fence then needs TTL + grace of stall, and its SIGKILL grace), the others
    trained at a smaller world within TTL + 8 s, the node came back after the heal or ended with the job
    (exit 0), and its agent printed no traceback."""
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
        }
        ok = ok and (
            isinstance(gone, float) and gone <= 2 * ttl + 2.5
            and reformed is not None and reformed <= ttl + 8.0
            and fact["exit_code"] == 0 and not fact["traceback"]
        )  # fmt: skip
        out.append(fact)
    return ok, out


def _running(p: Any) -> bool:
    try:
        return bool(p.is_running()) and p.status() != "zombie"
    except Exception:
        return False
