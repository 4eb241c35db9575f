"""Kubernetes day two, offline: docs/kubernetes.md's in-place resizes against every overlay, the overlays that
run a job for weeks (production), two jobs on one etcd and one's own script, and the Grafana dashboard
against the metrics the agents serve."""

from __future__ import annotations

import copy
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import k8s_checks as k
import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is needed to render kustomize"
)

DOC = k.REPO / "docs" / "kubernetes.md"
DASHBOARD = k.K8S / "components" / "monitoring" / "elastic-train-dashboard.json"
#: What the API server lets an in-place change of a running Job touch (the rest is immutable, or ours).
RESIZABLE = {"parallelism", "completions", "maxFailedIndexes"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: k.render(k.K8S / "overlays" / name) for name in k.OVERLAYS}


def documented_resizes() -> list[dict[str, Any]]:
    """The merge patches of docs/kubernetes.md's "Resize in place" commands."""
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Resize in place") :]
    section = section[: section.index("\n## ", 3)]
    patches = []
    for line in section.splitlines():
        if line.startswith("kubectl ") and " patch job " in line:
            argv = shlex.split(line)
            assert argv[argv.index("--type") + 1 if "--type" in argv else 0] or "--type=merge" in argv
            patches.append(json.loads(argv[argv.index("-p") + 1]))
    return patches


def merge(obj: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch (RFC 7396), as ``kubectl patch --type=merge`` applies it."""
    out = copy.deepcopy(obj)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict):
            out[key] = merge(out.get(key) or {}, value)
        else:
            out[key] = value
    return out


def update_errors(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What the API server refuses in an update of a running Indexed Job (elastic Indexed Jobs)."""
    errors = [f"spec.{f} is immutable" for f in old["spec"].keys() | new["spec"].keys() - RESIZABLE
              if f not in RESIZABLE and old["spec"].get(f) != new["spec"].get(f)]  # fmt: skip
    spec = new["spec"]
    if spec["completions"] != old["spec"]["completions"] and spec["completions"] != spec["parallelism"]:
        errors.append("spec.completions can only be modified in tandem with spec.parallelism")
    if spec.get("maxFailedIndexes", 0) > spec["completions"]:
        errors.append("spec.maxFailedIndexes must be <= completions")
    for rule in (spec.get("successPolicy") or {}).get("rules") or []:
        if rule.get("succeededCount", 0) > spec["completions"]:
            errors.append("successPolicy succeededCount must be <= completions")
    return errors


def test_the_documented_resizes_grow_and_shrink_the_demo() -> None:
    sizes = [p["spec"]["completions"] for p in documented_resizes()]
    assert sizes == [4, 2], sizes


@pytest.mark.parametrize("overlay", ["cpu-demo", "etcd-ha", "own-script"])
def test_the_documented_resizes_are_valid_updates(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    objs = rendered[overlay]
    for patch in documented_resizes():
        job = k.find(objs, "Job", "elastic-train")[0]
        resized = merge(job, patch)
        assert not update_errors(job, resized), update_errors(job, resized)
        after = [resized if o is job else o for o in objs]
        errors = k.structural_errors(after) + [
            e for v in k.validation_versions() for e in k.schema_errors(resized, v)
        ]
        assert not errors, f"{overlay} resized to {patch}:\n" + "\n".join(errors)


def test_a_resize_past_the_node_range_is_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["cpu-demo"]
    job = k.find(objs, "Job", "elastic-train")[0]
    too_big = merge(job, {"spec": {"parallelism": 5, "completions": 5}})
    assert any(
        "completions 5 not in --nodes 2:4" in e
        for e in k.structural_errors([too_big if o is job else o for o in objs])
    )
    assert update_errors(job, merge(job, {"spec": {"completions": 2}}))  # not in tandem with parallelism
    shrunk_keeping_failures = merge(job, {"spec": {"parallelism": 2, "completions": 2}})
    errors = k.structural_errors([shrunk_keeping_failures if o is job else o for o in objs])
    assert any("maxFailedIndexes 1 > completions - MIN = 0" in e for e in errors), errors


def test_production_guards_a_long_job(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["production"]
    (pdb,) = [p for p in k.find(objs, "PodDisruptionBudget") if p["metadata"]["name"] == "elastic-train"]
    assert pdb["spec"]["minAvailable"] == 2
    (pc,) = k.find(objs, "PriorityClass")
    job = k.find(objs, "Job", "elastic-train")[0]
    assert job["spec"]["template"]["spec"]["priorityClassName"] == pc["metadata"]["name"]
    assert "namespace" not in pc["metadata"] and pc["value"] > 0 and pc["globalDefault"] is False
    (pm,) = k.find(objs, "PodMonitor")
    assert pm["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    dash = k.find(objs, "ConfigMap", "elastic-train-dashboard")[0]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["elastic-train-dashboard.json"]) == json.loads(DASHBOARD.read_text())
    assert k.find(objs, "StatefulSet", "etcd")[0]["spec"]["replicas"] == 3


def test_two_jobs_share_etcd_each_with_its_own_user_and_keys(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objs = rendered["two-jobs"]
    jobs = {j["metadata"]["name"]: j for j in k.find(objs, "Job")}
    assert set(jobs) == {"elastic-train", "b-elastic-train"}
    commands = {tc.workload.owner["metadata"]["name"]: tc for tc in k.training_commands(objs)}
    assert {k.option(tc.argv[2:], "--endpoint") for tc in commands.values()} == {"etcd-client:2379"}
    sidecars = [c for c in k.find(objs, "StatefulSet", "etcd")[0]["spec"]["template"]["spec"]["containers"]
                if "ensure" in (c.get("args") or [])]  # fmt: skip
    prefixes = {k.option(c["args"], "--user"): k.option(c["args"], "--prefix") for c in sidecars}
    assert prefixes == {
        "elastic-train": "/elastic_train/elastic-train-",
        "b-elastic-train": "/elastic_train/b-elastic-train-",
    }
    for name in jobs:  # neither job's prefix covers the other's keys
        other = next(n for n in jobs if n != name)
        assert not f"/elastic_train/{other}-".startswith(prefixes[name])
    secrets = {
        name: k.env_map(tc.container)["ELASTIC_TRAIN_ETCD_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"]
        for name, tc in commands.items()
    }
    assert len(set(secrets.values())) == 2
    volumes = [v for j in jobs.values() for v in j["spec"]["template"]["spec"]["volumes"]]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v}
    assert claims == {"elastic-train-checkpoints"}
    b = jobs["b-elastic-train"]["spec"]["template"]["spec"]
    assert b["subdomain"] == "b-elastic-train-nodes" and k.find(objs, "Service", "b-elastic-train-nodes")


def test_a_second_job_whose_user_cannot_reach_its_keys_is_caught(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    def edit(o: dict[str, Any]) -> None:
        for c in o["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "auth-b":
                c["args"] = [a.replace("b-elastic-train-", "elastic-train-") for a in c["args"]]

    errors = k.structural_errors(k.patched(rendered["two-jobs"], "StatefulSet", "etcd", edit))
    assert any("does not cover this job's keys /elastic_train/b-elastic-train-" in e for e in errors), errors


def test_own_script_runs_the_script_after_entry(rendered: dict[str, list[dict[str, Any]]]) -> None:
    (tc,) = k.training_commands(rendered["own-script"])
    args = tc.argv[2:]
    entry = args[args.index("--entry") + 1 :]
    assert entry[0] == "/opt/training/own_loop.py" and "--checkpoint=$(ELASTIC_TRAIN_CHECKPOINT_URL)" in [
        a for a in tc.container["args"]
    ]
    assert k.image_name(tc.container["image"]).endswith("/my-training")
    dockerfile = (k.REPO / "Dockerfile").read_text()
    assert re.search(r"^FROM runtime AS with-script$", dockerfile, re.M)


def test_broken_production_manifests_are_caught(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objs = rendered["production"]
    pdb = k.patched(objs, "PodDisruptionBudget", "elastic-train", lambda o: o["spec"].update(minAvailable=3))
    assert any("minAvailable 3 != MIN nodes 2" in e for e in k.structural_errors(pdb))
    pm = k.patched(
        objs, "PodMonitor", "elastic-train", lambda o: o["spec"]["podMetricsEndpoints"][0].update(port="web")
    )
    assert any("port 'web' is not a port of the pods" in e for e in k.structural_errors(pm))
    bad = k.patched(objs, "PodMonitor", "elastic-train", lambda o: o["spec"].update(endpoints=[]))
    assert any(
        "[crd]" in e and "endpoints" in e for e in k.schema_errors(k.find(bad, "PodMonitor")[0], "1.33")
    )


def served_metric_names() -> set[str]:
    """Every sample name an agent serves: its event metrics and what its run observer yields at a scrape."""
    import threading

    from elastic_train.metrics import agent
    from elastic_train.node import AgentChannel
    from elastic_train.rendezvous.config import ProtocolSettings
    from elastic_train.rendezvous.observe import RunObserver
    from elastic_train.rendezvous.records import RunReader

    class View:
        cond = threading.Condition()

        def get(self, key: str) -> None:
            return None

        def under(self, group: str) -> dict[str, Any]:
            return {}

    class P:
        round, members, view = 1, ["a"], View()
        run = RunReader(view)  # type: ignore[arg-type]

    observer = RunObserver(
        lambda: P(),  # type: ignore[arg-type,return-value]
        AgentChannel("/nonexistent"),
        ProtocolSettings(run_id="r", min_nodes=1, max_nodes=1),
    )
    names = {s.name for fam in observer.collect() for s in fam.samples}
    agent.observe_recovery("leave", "hot", 1.0)
    agent.count_fence("x")
    return names | {s.name for fam in agent.REGISTRY.collect() for s in fam.samples}


def test_the_dashboard_shows_world_size_and_recoveries_from_served_metrics() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\belastic_train_[a-z_]+", e)}
    served = served_metric_names()
    assert used and used <= served, sorted(used - served)
    titles = {p["title"] for p in dash["panels"]}
    assert {"World size and round", "Recoveries by cause and path", "Recovery seconds"} <= titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:  # panels do not overlap on Grafana's 24-column grid
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in dash["panels"]
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]  # fmt: skip
    assert len(cells) == len(set(cells))


def test_the_docs_name_no_overlay_that_does_not_exist() -> None:
    text = DOC.read_text(encoding="utf-8")
    for overlay in set(re.findall(r"k8s/overlays/([a-z0-9-]+)", text)):
        assert (k.K8S / "overlays" / overlay / "kustomization.yaml").is_file(), overlay
    assert set(k.OVERLAYS) == {p.name for p in (k.K8S / "overlays").iterdir() if p.is_dir()}
    assert Path(DASHBOARD).is_file()
