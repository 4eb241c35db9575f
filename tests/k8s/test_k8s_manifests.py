"""The k8s/ overlays render, validate strictly against Kubernetes schemas, and pass the project's checks."""

from __future__ import annotations

import os
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

import k8s_checks as k
import pytest

pytestmark = pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is needed to render kustomize"
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: k.render(k.K8S / "overlays" / name) for name in k.OVERLAYS}


def test_validation_covers_the_minimum_and_newest_bundled_version() -> None:
    versions = k.validation_versions()
    assert versions[0] == k.MIN_KUBERNETES
    assert versions[-1] == k.bundled_versions()[-1]


def test_base_renders() -> None:
    kinds = sorted(o["kind"] for o in k.render(k.K8S / "base"))
    expected = ["ConfigMap", "Secret", "Service", "Service", "Service", "StatefulSet", "Job"]  # job config
    expected += ["NetworkPolicy", "NetworkPolicy", "PersistentVolumeClaim"]
    assert kinds == sorted(expected)


@pytest.mark.parametrize("overlay", k.OVERLAYS)
def test_overlay_validates_strictly(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    errors = [
        e for v in k.validation_versions() for obj in rendered[overlay] for e in k.schema_errors(obj, v)
    ]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", k.OVERLAYS)
def test_overlay_passes_structural_checks(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    errors = k.structural_errors(rendered[overlay])
    assert not errors, "\n".join(errors)


def test_overlays_differ_where_they_should(rendered: dict[str, list[dict[str, Any]]]) -> None:
    def node(objs: list[dict[str, Any]]) -> dict[str, Any]:
        return k.training_commands(objs)[0].container

    gpu = node(rendered["gpu"])
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "nvidia.com/gpu" not in node(rendered["cpu-demo"])["resources"].get("limits", {})
    s3_env = {e["name"]: e for e in node(rendered["s3"])["env"]}
    assert s3_env["ELASTIC_TRAIN_CHECKPOINT_URL"]["value"].startswith("s3://")
    assert not k.find(rendered["s3"], "PersistentVolumeClaim")
    assert k.find(rendered["etcd-ha"], "StatefulSet", "etcd")[0]["spec"]["replicas"] == 3
    assert k.find(rendered["cpu-demo"], "StatefulSet", "etcd")[0]["spec"]["replicas"] == 1
    for name, objs in rendered.items():
        namespaces = {
            o["metadata"].get("namespace") for o in objs if o["kind"] not in ("Namespace", "PriorityClass")
        }
        assert len(namespaces) == 1 and None not in namespaces, name


def _job(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return k.find(objs, "Job", "elastic-train")[0]


def _node(obj: dict[str, Any]) -> dict[str, Any]:
    return obj["spec"]["template"]["spec"]["containers"][0]


def _set_arg(obj: dict[str, Any], prefix: str, value: str) -> None:
    args = _node(obj)["args"]
    args[next(i for i, a in enumerate(args) if a.startswith(prefix))] = value


def _set_env(obj: dict[str, Any], name: str, value: str) -> None:
    for e in _node(obj)["env"]:
        if e["name"] == name:
            e.clear()
            e.update(name=name, value=value)


BROKEN: dict[str, tuple[str, str, Any, str]] = {
    "parallelism": (
        "Job", "elastic-train", lambda o: o["spec"].update(parallelism=2), "parallelism 2 != completions 3",
    ),
    "size-above-max": (
        "Job", "elastic-train", lambda o: o["spec"].update(parallelism=5, completions=5),
        "completions 5 not in --nodes 2:4",
    ),
    "max-failed-indexes": (
        "Job", "elastic-train", lambda o: o["spec"].update(maxFailedIndexes=2),
        "maxFailedIndexes 2 > completions - MIN = 1",
    ),
    "metrics-port": (
        "Job", "elastic-train", lambda o: _node(o)["ports"][0].update(containerPort=9500),
        "rendezvous.metrics_port 9400 is not the container's port named metrics (9500)",
    ),
    "metrics-netpol": (
        "NetworkPolicy", "elastic-train", lambda o: o["spec"]["ingress"].pop(1),
        "admits scrapes of the metrics port",
    ),
    "min>max": (
        "Job", "elastic-train", lambda o: _set_env(o, "ELASTIC_TRAIN_NODES", "3:2"), "1 <= MIN <= MAX",
    ),
    "endpoint-port": (
        "Job", "elastic-train", lambda o: _set_arg(o, "--endpoint", "--endpoint=etcd-client:2380"),
        "is not a port of Service etcd-client",
    ),
    "endpoint-host": (
        "Job", "elastic-train", lambda o: _set_arg(o, "--endpoint", "--endpoint=etcd:2379"),
        "is not a Service in the render",
    ),
    "run-id": (
        "Job", "elastic-train", lambda o: _set_arg(o, "--run-id", "--run-id=$(JOB_NAME)"),
        "is not the Job's name and UID",
    ),
    "no-completions": ("Job", "elastic-train", lambda o: o["spec"].pop("completions"), "needs completions"),
    "quantity": (
        "Job", "elastic-train", lambda o: _node(o)["resources"]["limits"].update(memory="2GB"),
        "is not a Kubernetes quantity",
    ),
    "enum": (
        "Job", "elastic-train", lambda o: _node(o).update(imagePullPolicy="Sometimes"), "is not one of",
    ),
    "name": ("Service", "elastic-train-nodes", lambda o: o["metadata"].update(name="Nodes_1"), "DNS-1123"),
    "missing-secret": (
        "Secret", "etcd-auth", lambda o: o["metadata"].update(name="other-secret"),
        "which is not in the render",
    ),
    "missing-key": (
        "ConfigMap", "elastic-train-job", lambda o: o["data"].update({"job.yml": o["data"].pop("job.yaml")}),
        "is not a key of a mounted ConfigMap",
    ),
    "bad-config": (
        "ConfigMap", "elastic-train-job",
        lambda o: o["data"].update({"job.yaml": o["data"]["job.yaml"].replace("steps:", "stepz:")}),
        "unknown key",
    ),
    "netpol": (
        "NetworkPolicy", "etcd",
        lambda o: o["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].update(
            {"app.kubernetes.io/component": "trainer"}
        ),
        "no NetworkPolicy rule admits the training pods",
    ),
    "netpol-open": (
        "NetworkPolicy", "etcd", lambda o: o["spec"]["ingress"][0].pop("from"), "from anywhere",
    ),
    "root": (
        "StatefulSet", "etcd", lambda o: o["spec"]["template"]["spec"]["securityContext"].update(runAsUser=0),
        "runs as uid 0",
    ),
    "no-disruption-rule": (
        "Job", "elastic-train", lambda o: o["spec"]["podFailurePolicy"]["rules"].pop(0), "DisruptionTarget",
    ),
    "namespace": (
        "Service", "etcd-client", lambda o: o["metadata"].update(namespace="default"), "namespace",
    ),
    "etcd-members": ("StatefulSet", "etcd", lambda o: o["spec"].update(replicas=3), "ETCD_INITIAL_CLUSTER"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_checks_catch_a_broken_manifest(rendered: dict[str, list[dict[str, Any]]], case: str) -> None:
    kind, name, edit, expected = BROKEN[case]
    # Objects with kustomize's hash suffix are found by their generator name.
    objs = rendered["cpu-demo"]
    for obj in objs:
        if obj["kind"] == kind and re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", obj["metadata"]["name"]):
            name = obj["metadata"]["name"]
    assert not k.structural_errors(objs)
    errors = k.manifest_errors(k.patched(objs, kind, name, edit))
    assert any(expected in e for e in errors), f"{case}: expected {expected!r} in:\n" + "\n".join(errors)


def _pod_edit(path: str, value: Any) -> Any:
    """An edit that sets ``path`` (dots; a number indexes a list) below the Job's pod spec."""

    def edit(o: dict[str, Any]) -> None:
        node: Any = o["spec"]["template"]["spec"]
        *parents, last = path.split(".")
        for part in parents:
            node = node[int(part)] if part.isdigit() else node.setdefault(part, {})
        node[int(last) if last.isdigit() else last] = value

    return edit


# What the API server refuses and the bundled schemas alone would let through (k.REFINEMENTS).
REFUSED: dict[str, tuple[Any, str, str]] = {
    "label-key": (
        lambda o: o["metadata"]["labels"].update({"bad key!": "x"}), "metadata.labels", "is not a label key",
    ),
    "label-value": (
        lambda o: o["spec"]["template"]["metadata"]["labels"].update(tier="a b"),
        "spec.template.metadata.labels.tier", "'a b' is not a label value",
    ),
    "container-name": (_pod_edit("containers.0.name", "Node_1"), "containers.0.name", "DNS-1123 label"),
    "volume-name": (_pod_edit("volumes.0.name", "x" * 64), "volumes.0.name", "DNS-1123 label"),
    "port-name": (
        _pod_edit("containers.0.ports", [{"name": "a-very-long-port-name", "containerPort": 80}]),
        "containers.0.ports.0.name", "is not an IANA service name",
    ),
    "protocol": (
        _pod_edit("containers.0.ports", [{"containerPort": 80, "protocol": "HTTP"}]),
        "containers.0.ports.0.protocol", "'HTTP' is not one of",
    ),
    "restart-policy": (_pod_edit("restartPolicy", "Sometimes"), "spec.restartPolicy", "is not one of"),
    "negative-quantity": (
        _pod_edit("containers.0.resources.requests.cpu", -1), "requests.cpu", "less than the minimum",
    ),
    "signed-quantity": (
        _pod_edit("containers.0.resources.requests.cpu", "-1"), "requests.cpu",
        "is not a Kubernetes quantity",
    ),
    "medium": (
        lambda o: next(v for v in o["spec"]["template"]["spec"]["volumes"] if "emptyDir" in v)["emptyDir"]
        .update(medium="Disk"), "emptyDir.medium", "is not one of",
    ),
    "completion-mode": (
        lambda o: o["spec"].update(completionMode="Ordered"), "spec.completionMode", "is not one of",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_schemas_refuse_what_the_api_server_refuses(
    rendered: dict[str, list[dict[str, Any]]], case: str
) -> None:
    edit, where, expected = REFUSED[case]
    job = _job(k.patched(rendered["cpu-demo"], "Job", "elastic-train", edit))
    for version in k.validation_versions():
        errors = k.schema_errors(job, version)
        assert len(errors) == 1 and where in errors[0] and expected in errors[0], errors


def test_checks_catch_a_broken_overlay_rendered_by_kustomize(tmp_path: Path) -> None:
    """A real kustomize overlay on top of cpu-demo with a wrong patch: the render fails the checks."""
    (tmp_path / "kustomization.yaml").write_text(
        textwrap.dedent(
            f"""\
            apiVersion: kustomize.config.k8s.io/v1beta1
            kind: Kustomization
            resources:
              - {os.path.relpath(k.K8S / "overlays" / "cpu-demo", tmp_path)}
            patches:
              - path: patch.yaml
            """
        )
    )
    # A typical mistake: growing the Job past its --nodes range, and pointing the endpoint elsewhere.
    (tmp_path / "patch.yaml").write_text(
        textwrap.dedent(
            """\
            apiVersion: batch/v1
            kind: Job
            metadata:
              name: elastic-train
            spec:
              parallelism: 6
              completions: 6
              template:
                spec:
                  containers:
                    - name: node
                      env:
                        - name: ETCD_ENDPOINT_HOST
                          value: etcd-0.etcd-peer
                        - name: ELASTIC_TRAIN_ETCD_PASSWORD
                          valueFrom:
                            secretKeyRef:
                              name: etcd-credentials
                              key: password
            """
        )
    )
    objs = k.render(tmp_path)
    errors = k.structural_errors(objs)
    joined = "\n".join(errors)
    assert "Job completions 6 not in --nodes 2:4" in joined
    assert "refers to Secret 'etcd-credentials', which is not in the render" in joined
    assert not [e for v in k.validation_versions() for o in objs for e in k.schema_errors(o, v)]


def test_schema_validation_reports_every_error(rendered: dict[str, list[dict[str, Any]]]) -> None:
    def edit(o: dict[str, Any]) -> None:
        o["spec"]["parallelism"] = "three"
        _node(o)["bogus"] = True
        next(v for v in o["spec"]["template"]["spec"]["volumes"] if v["name"] == "dshm")["emptyDir"][
            "medium"
        ] = 7

    job = _job(k.patched(rendered["cpu-demo"], "Job", "elastic-train", edit))
    for version in k.validation_versions():
        errors = k.schema_errors(job, version)
        assert len(errors) == 3, errors
        assert all(f"[k8s {version}]" in e for e in errors)


def test_schema_validation_rejects_an_unknown_kind() -> None:
    obj = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    assert "no schema" in k.schema_errors(obj, k.MIN_KUBERNETES)[0]


def test_dockerfile_is_pinned_and_non_root() -> None:
    text = (k.REPO / "Dockerfile").read_text()
    images = re.findall(r"^ARG PYTHON_IMAGE=(\S+)$", text, re.M)
    assert images and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+(@sha256:[0-9a-f]{64})?", images[0])
    # every stage starts from the pinned base, from scratch, or from a stage before it
    stages: list[str] = []
    for words in (line.split() for line in re.findall(r"^FROM .*$", text, re.M)):
        assert words[1] in ("${PYTHON_IMAGE}", "scratch", *stages), words
        stages.append(words[3] if len(words) > 3 and words[2].upper() == "AS" else "")
    # the default target (the last stage) is the image the manifests run; with-script adds a directory
    assert re.findall(r"^FROM (\S+)", text, re.M)[-1] == "runtime" and "with-script" in stages
    assert "COPY --from=training / /opt/training/" in text
    assert "download.pytorch.org/whl/cpu" in text
    uid, gid = k.dockerfile_user(k.REPO / "Dockerfile")
    assert uid == 10001 and gid == 10001
    assert re.search(r'pip install "/src\[', text)
    ignore = (k.REPO / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:1] == ["*"] and "!elastic_train/" in ignore
    # what the training stage copies by default is in the build context
    for source in re.findall(r"^COPY (\S+) /$", text, re.M):
        assert f"!{source}" in ignore and (k.REPO / source).is_file(), source


def test_quantity_parser() -> None:
    assert k.parse_quantity("500m") == 0.5
    assert k.parse_quantity("2Gi") == 2 * 2**30
    assert k.parse_quantity("1e3") == 1000
    assert k.parse_quantity(8) == 8
    for bad in ("2GB", "1.2.3", "", "Gi", True):
        assert k.parse_quantity(bad) is None
