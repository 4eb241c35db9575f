"""Smoke run of the rendered cpu-demo manifests: their own commands, as local processes, survive a lost pod.

The etcd auth sidecar, the training pods' wait-for-etcd init container and every training pod run exactly
the command, args and environment of the rendered manifests, with Kubernetes' variable expansion applied
and only what a cluster would provide replaced by local equivalents:

* the etcd client Service (``etcd-client:2379``) → the test's etcd on loopback,
* volume mount paths → temporary directories (ConfigMaps written out, the checkpoint PVC a directory),
* downward API values → the Job name, ``127.0.0.1`` for the pod IP, ``GLOO_SOCKET_IFNAME=lo``,
* the job config (ConfigMap) → the same file with a tiny task (regression, few steps, short lease) for speed,
  and metrics on a free port (the pods share this machine's addresses).

One "pod" is killed with SIGKILL (its whole process tree) mid-run and re-created for its index, as the
Job controller would; it joins the running job through the hot path. Then the Job is resized in place from
3 to 2 nodes, as docs/kubernetes.md patches it: the Job controller sends the pod of the index that is no
longer part of it SIGTERM, and that pod leaves the run cleanly (exit 143, a leave, not a failure). The job
must finish with every remaining index exiting 0, its run having spent one failure and one leave.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import k8s_checks as k
import pytest
import yaml

from elastic_train.etcd.client import connect
from elastic_train.procs import kill_tree, tree, wait_gone
from elastic_train.rendezvous.status import read_status

pytest.importorskip("elastic_train.cli.run")
pytest.importorskip("elastic_train.rendezvous.registry")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is needed to render kustomize"),
]

VENV_BIN = Path(sys.executable).parent
#: Tiny training for speed (applied to the ConfigMap's job.yaml): steps, task, checkpoint cadence, lease.
SMOKE_CONFIG = {
    "train": {"task": "regression", "steps": 400, "global_batch": 32, "log_every": 50},
    "checkpoint": {"every_steps": 25},
    # every "pod" is a process of this machine: each agent serves its metrics on a port of its own
    "rendezvous": {"lease_ttl": 3.0, "settle": 1.0, "join_timeout": 120.0, "metrics_port": 0},
}
KILL_AT_STEP = 30
KILLED_INDEX = 1
#: Steps after the killed pod is back in the job that the job waits for its shrink by one index (whose pod
#: then gets SIGTERM).
SHRINK_AFTER = 60
#: The Job's UID as the Job controller labels its pods (the run id is the Job's name and UID).
JOB_UID = "5f0c3a9e-7d1b-4c2a-9e8f-0123456789ab"


@dataclass
class PodCommand:
    """One container of one pod, ready to run locally."""

    argv: list[str]
    env: dict[str, str]


class LocalCluster:
    """Maps what Kubernetes would provide for the rendered objects onto local resources."""

    def __init__(
        self,
        objs: list[dict[str, Any]],
        etcd_endpoint: str,
        root: Path,
        config: dict[str, Any] = SMOKE_CONFIG,
    ) -> None:
        self.objs = objs
        self.config = config
        self.etcd_endpoint = etcd_endpoint
        self.root = root
        svc = k.find(objs, "Service", "etcd-client")[0]
        self.etcd_service = f"etcd-client:{svc['spec']['ports'][0]['port']}"
        self.events = root / "events.jsonl"

    def _data(self, kind: str, name: str) -> dict[str, str]:
        obj = k.find(self.objs, kind, name)[0]
        return k.secret_or_configmap_data(obj)

    def _mounts(self, pod: str, w: k.Workload, c: dict[str, Any]) -> dict[str, str]:
        """mountPath → local directory, with ConfigMap/Secret files written out."""
        volumes = {v["name"]: v for v in w.spec.get("volumes") or []}
        out = {}
        for m in c.get("volumeMounts") or []:
            vol = volumes.get(m["name"], {})
            if "persistentVolumeClaim" in vol:
                local = self.root / "pvc" / vol["persistentVolumeClaim"]["claimName"]  # shared by all pods
            else:
                local = self.root / "pods" / pod / m["name"]  # per pod, like an emptyDir
            local.mkdir(parents=True, exist_ok=True)
            for kind, key, name_key in (
                ("ConfigMap", "configMap", "name"),
                ("Secret", "secret", "secretName"),
            ):
                if key in vol:
                    for file, text in self._data(kind, vol[key][name_key]).items():
                        if kind == "ConfigMap" and file.endswith(".yaml") and "train" in yaml.safe_load(text):
                            text = yaml.safe_dump(_merge(yaml.safe_load(text), self.config))
                        (local / file).write_text(text)
            if m["mountPath"] == "/dev/shm":
                continue  # the host's /dev/shm stands in for the pod's memory-backed emptyDir
            out[m["mountPath"]] = str(local)
        return out

    def command(self, w: k.Workload, c: dict[str, Any], index: int) -> PodCommand:
        job = w.owner["metadata"]["name"]
        pod = f"{job}-{index}"
        mounts = self._mounts(pod, w, c)
        field_values = {
            "metadata.name": f"{pod}-local",
            "metadata.namespace": w.owner["metadata"].get("namespace", "default"),
            "status.podIP": "127.0.0.1",
            **{f"metadata.labels['{key}']": job for key in k.JOB_NAME_LABELS},
            **{f"metadata.labels['{key}']": JOB_UID for key in k.JOB_UID_LABELS},
        }
        env: dict[str, str] = {}
        for ef in c.get("envFrom") or []:
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in ef:
                    env.update(self._data(kind, ef[key]["name"]))
        for e in c.get("env") or []:
            if "value" in e:
                env[e["name"]] = k.expand(str(e["value"]), env)[0]
                continue
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[e["name"]] = field_values[vf["fieldRef"]["fieldPath"]]
            elif "secretKeyRef" in vf:
                env[e["name"]] = self._data("Secret", vf["secretKeyRef"]["name"])[vf["secretKeyRef"]["key"]]
            elif "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                env[e["name"]] = self._data("ConfigMap", ref["name"])[ref["key"]]
            else:
                raise AssertionError(f"unsupported env source in {e}")
        argv = [k.expand(str(a), env)[0] for a in list(c.get("command") or []) + list(c.get("args") or [])]
        argv = [self._localize(a, mounts) for a in argv]
        env = {name: self._localize(value, mounts) for name, value in env.items()}
        exe = {"python": sys.executable, "elastic-train": str(VENV_BIN / "elastic-train")}
        argv[0] = exe.get(argv[0], argv[0])
        env.update(
            {
                # What the cluster or the image provides; loopback networking per the project's rules.
                "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                # the image's code is the code under test (a checkout on PYTHONPATH wins over the install),
                # with the tests' task module (tests.fault_task)
                "PYTHONPATH": os.pathsep.join(filter(None, [str(k.REPO), os.environ.get("PYTHONPATH")])),
                "HOSTNAME": pod,
                "ELASTIC_TRAIN_NODE_ID": pod,
                "JOB_COMPLETION_INDEX": str(index),
                "GLOO_SOCKET_IFNAME": "lo",
                "MASTER_ADDR": "127.0.0.1",
                "ELASTIC_TRAIN_EVENTS": str(self.events),
            }
        )
        return PodCommand(argv, env)

    def _localize(self, text: str, mounts: dict[str, str]) -> str:
        text = text.replace(self.etcd_service, self.etcd_endpoint)
        if not mounts:
            return text
        # One pass, longest mount first, so a local path is never rewritten again (they live under /tmp).
        alternatives = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
        return re.sub(rf"(^|[=,])({alternatives})(?=/|$)", lambda m: m.group(1) + mounts[m.group(2)], text)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _wait(predicate: Any, timeout: float, what: str, procs: dict[str, subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = {name: p.returncode for name, p in procs.items() if p.poll() not in (None, 0)}
        assert not dead, f"while waiting for {what}: pods failed {dead}"
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.2)


@pytest.mark.long
def test_cpu_demo_manifest_trains_loses_a_pod_and_finishes(
    etcd_server: Any, reaper: Any, tmp_path: Path
) -> None:
    objs = k.render(k.K8S / "overlays" / "cpu-demo")
    assert not k.structural_errors(objs)
    # The shrunk job (2 nodes) waits past step KILL_AT_STEP + 30 for the re-created pod (tests/fault_task.py)
    gate = tmp_path / "gate"
    gate.write_text(f"2 {KILL_AT_STEP + 30}")
    config = _merge(
        SMOKE_CONFIG, {"train": {"task": "tests.fault_task:build", "task_args": {"hold": str(gate)}}}
    )
    cluster = LocalCluster(objs, etcd_server.endpoint, tmp_path, config)
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(name: str, cmd: PodCommand) -> subprocess.Popen[bytes]:
        out = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        return reaper.popen(cmd.argv, env=cmd.env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)

    def tail(name: str) -> str:
        return (logs / f"{name}.log").read_text(errors="replace")[-3000:]

    # etcd: the StatefulSet's auth sidecar sets up users and enables auth, then reports ready.
    etcd = k.find(objs, "StatefulSet", "etcd")[0]
    etcd_w = k.workloads([etcd])[0]
    sidecar = next(c for c in etcd_w.containers() if c["name"] == "auth")
    sidecar_cmd = cluster.command(etcd_w, sidecar, 0)
    sidecar_cmd.argv = [a.replace("127.0.0.1:2379", etcd_server.endpoint) for a in sidecar_cmd.argv]
    sidecar_proc = start("etcd-auth", sidecar_cmd)
    ready = Path(next(a.split("=", 1)[1] for a in sidecar_cmd.argv if a.startswith("--ready-file=")))
    _wait(ready.exists, 60, "the etcd auth sidecar", {"etcd-auth": sidecar_proc})

    job = k.find(objs, "Job", "elastic-train")[0]
    w = k.workloads([job])[0]
    (init,) = w.spec["initContainers"]
    (node,) = w.spec["containers"]
    pods = job["spec"]["parallelism"]

    def run_pod(index: int, name: str) -> subprocess.Popen[bytes]:
        init_cmd = cluster.command(w, init, index)
        done = subprocess.run(init_cmd.argv, env=init_cmd.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{name} init container failed: {done.stderr[-2000:]}"
        return start(name, cluster.command(w, node, index))

    started = time.monotonic()
    procs = {f"pod-{i}": run_pod(i, f"pod-{i}") for i in range(pods)}
    try:
        _wait(
            lambda: any(e["event"] == "step" and e["step"] >= KILL_AT_STEP for e in _events(cluster.events)),
            120,
            f"step {KILL_AT_STEP}",
            procs,
        )
        victim = procs.pop(f"pod-{KILLED_INDEX}")
        pids = [p.pid for p in tree(victim.pid)]
        assert len(pids) >= 2, "a pod is the agent plus its workers"
        kill_tree(victim.pid)  # reaps the processes too, so Popen's own exit status is not meaningful
        assert wait_gone(pids, timeout=30), "the killed pod's processes are still alive"
        victim.wait(timeout=30)
        killed_at = max(e["step"] for e in _events(cluster.events) if e["event"] == "step")
        # The Job controller re-creates the failed index's pod; it waits for etcd and rejoins.
        time.sleep(SMOKE_CONFIG["rendezvous"]["lease_ttl"])
        procs[f"pod-{KILLED_INDEX}-retry"] = run_pod(KILLED_INDEX, f"pod-{KILLED_INDEX}-retry")
        _wait(
            lambda: any(
                e["event"] == "step" and e["world_size"] == pods and e["step"] > killed_at
                for e in _events(cluster.events)
            ),
            120,
            "the re-created pod back in the job",
            procs,
        )
        # ... then the whole job waits a little later for its resize
        back = max(e["step"] for e in _events(cluster.events) if e["event"] == "step")
        gate.write_text(f"{pods} {back + SHRINK_AFTER}")
        # Resized in place to pods - 1 nodes: the pod of the last index gets SIGTERM and leaves.
        shrunk = procs.pop(f"pod-{pods - 1}")
        shrunk.send_signal(signal.SIGTERM)
        assert shrunk.wait(timeout=60) == 143, tail(f"pod-{pods - 1}")
        assert "this node left the run" in tail(f"pod-{pods - 1}")
        deadline = time.monotonic() + 150
        for name, proc in procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} did not finish; log tail:\n{tail(name)}")
            assert code == 0, f"{name} exited {code}; log tail:\n{tail(name)}"
    finally:
        kill_tree(sidecar_proc.pid)
    elapsed = time.monotonic() - started

    events = _events(cluster.events)
    steps = config["train"]["steps"]
    done = [e for e in events if e["event"] == "done"]
    assert done and done[-1]["step"] == steps, events[-5:]
    assert any(e["event"] == "resumed" for e in events), "the worker group was never restarted after the kill"
    assert killed_at < steps, "the pod was killed after training had finished"
    assert any(e["event"] == "step" and e["world_size"] == pods - 1 for e in events), "never trained shrunk"
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].startswith("etcd-auth"))
    password = k.secret_or_configmap_data(secret)["training-password"]
    with connect(etcd_server.endpoint, user="elastic-train", password=password) as etcd:
        status = read_status(etcd, f"{job['metadata']['name']}-{JOB_UID}")
    assert (status.state, status.failures_used, status.leaves) == ("finished", 1, 1), status
    ckpt_root = tmp_path / "pvc" / "elastic-train-checkpoints" / f"{job['metadata']['name']}-{JOB_UID}"
    manifests = sorted(ckpt_root.glob("step-*/manifest.json"))
    assert manifests, f"no durable checkpoint under {ckpt_root}"
    assert json.loads(manifests[-1].read_text())["step"] == steps
    print(
        f"smoke run: {pods} pods, killed pod {KILLED_INDEX} at step {killed_at}, finished in {elapsed:.1f} s"
    )


def test_secret_values_reach_the_pods_decoded() -> None:
    """The smoke harness decodes Secrets like the kubelet does (guards the harness itself)."""
    objs = k.render(k.K8S / "overlays" / "cpu-demo")
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].startswith("etcd-auth"))
    raw = base64.b64decode(secret["data"]["training-password"]).decode()
    assert k.secret_or_configmap_data(secret)["training-password"] == raw
