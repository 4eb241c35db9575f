"""Render the kustomize overlays, validate them against Kubernetes schemas, and check what schemas miss.

* :func:`render` runs ``kubectl kustomize`` (offline) and returns the objects.
* :func:`schema_errors` validates one object strictly (no unknown fields) against the OpenAPI-derived JSON
  schemas bundled by ``kubernetes-validate``, and returns *every* error, not just the first. The bundled
  schemas carry types and fields only, so the API server's own rules on values that any manifest can break
  (names and label syntax, quantities, enumerations: :data:`REFINEMENTS`) are added to those schemas as
  JSON-schema constraints, and jsonschema checks them with the rest.
* :func:`structural_errors` checks the whole render for what this project relies on and no schema can see:
  the training command agrees with the Job (node counts, etcd endpoint, run id, job config), references
  resolve, probes, etcd wiring, security settings hold, NetworkPolicies select the right pods.
* :func:`manifest_errors` is both, over a whole render: what the tests hold every overlay to.

Every check returns a list of one-line messages (empty: fine) so a test can report all problems at once.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("cpu-demo", "gpu", "s3", "etcd-ha", "production", "two-jobs", "own-script")

#: Kubernetes versions every object must validate against: the oldest supported and the newest bundled.
MIN_KUBERNETES = "1.33"

#: The project image's name (any registry, any tag): its containers run as the Dockerfile's numeric
#: USER and group (see :func:`check_image_user`), so files on shared volumes have one owner.
IMAGE_NAME = "elastic-train"

#: Labels the Job controller puts on the pods it creates (value: the Job's name, the Job's UID).
JOB_NAME_LABELS = ("batch.kubernetes.io/job-name", "job-name")
JOB_UID_LABELS = ("batch.kubernetes.io/controller-uid", "controller-uid")

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*"
_QUANTITY = r"\+?(\d+(\.\d*)?|\.\d+)(?P<suffix>[KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?"
DNS1123_LABEL = re.compile(rf"^{_DNS1123_LABEL}$")
QUANTITY = re.compile(rf"^{_QUANTITY}$")
ENV_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")
IMAGE_PINNED = re.compile(r"^[^:@\s]+(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@sha256:[0-9a-f]{64})?$")

SUFFIX_FACTORS = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
}  # fmt: skip


def _matching(title: str, pattern: str, max_length: int | None = None) -> dict[str, Any]:
    """A string constraint; ``title`` names what the value should be in the error message."""
    then: dict[str, Any] = {"pattern": f"^{pattern}$", "title": title}
    if max_length is not None:
        then["maxLength"] = max_length
    return {"if": {"type": "string"}, "then": then}


def _one_of(*values: str) -> dict[str, Any]:
    return {"if": {"type": "string"}, "then": {"enum": list(values)}}


_CORE, _META, _BATCH = "io.k8s.api.core.v1.", "io.k8s.apimachinery.pkg.apis.meta.v1.", "io.k8s.api.batch.v1."
_LABEL_KEY = rf"({_DNS1123_SUBDOMAIN}/)?([A-Za-z0-9][-A-Za-z0-9_.]{{0,61}})?[A-Za-z0-9]"
_LABEL_VALUE = r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
_IANA_SVC_NAME = r"(?=.{1,15}$)(?=.*[a-z])[a-z0-9]+(-[a-z0-9]+)*"

#: The API server's rules on values, which the bundled schemas do not carry, as JSON-schema constraints:
#: (definition, property, constraint); ``property[]`` constrains each item of a list property.
REFINEMENTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    (_META + "ObjectMeta", "name", _matching("a DNS-1123 subdomain", _DNS1123_SUBDOMAIN, 253)),
    (_META + "ObjectMeta", "labels", {
        "propertyNames": {"pattern": f"^{_LABEL_KEY}$", "title": "a label key"},
        "additionalProperties": _matching("a label value", _LABEL_VALUE, 63),
    }),
    (_CORE + "Container", "name", _matching("a DNS-1123 label", _DNS1123_LABEL, 63)),
    (_CORE + "Volume", "name", _matching("a DNS-1123 label", _DNS1123_LABEL, 63)),
    (_CORE + "PodSpec", "subdomain", _matching("a DNS-1123 label", _DNS1123_LABEL, 63)),
    (_CORE + "ContainerPort", "name", _matching("an IANA service name", _IANA_SVC_NAME)),
    (_CORE + "Container", "imagePullPolicy", _one_of("Always", "IfNotPresent", "Never")),
    (_CORE + "PodSpec", "restartPolicy", _one_of("Always", "OnFailure", "Never")),
    (_CORE + "ContainerPort", "protocol", _one_of("TCP", "UDP", "SCTP")),
    (_CORE + "ServicePort", "protocol", _one_of("TCP", "UDP", "SCTP")),
    ("io.k8s.api.networking.v1.NetworkPolicyPort", "protocol", _one_of("TCP", "UDP", "SCTP")),
    (_CORE + "ServiceSpec", "type", _one_of("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")),
    (_CORE + "SeccompProfile", "type", _one_of("RuntimeDefault", "Localhost", "Unconfined")),
    (_CORE + "EmptyDirVolumeSource", "medium", _one_of("", "Memory")),
    (_CORE + "Toleration", "operator", _one_of("Exists", "Equal")),
    (_CORE + "Toleration", "effect", _one_of("NoSchedule", "PreferNoSchedule", "NoExecute")),
    (_CORE + "TopologySpreadConstraint", "whenUnsatisfiable", _one_of("DoNotSchedule", "ScheduleAnyway")),
    (_CORE + "PersistentVolumeClaimSpec", "accessModes[]",
     _one_of("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod")),
    ("io.k8s.api.networking.v1.NetworkPolicySpec", "policyTypes[]", _one_of("Ingress", "Egress")),
    ("io.k8s.api.apps.v1.StatefulSetSpec", "podManagementPolicy", _one_of("OrderedReady", "Parallel")),
    (_BATCH + "JobSpec", "completionMode", _one_of("NonIndexed", "Indexed")),
    (_BATCH + "JobSpec", "podReplacementPolicy", _one_of("TerminatingOrFailed", "Failed")),
    (_BATCH + "PodFailurePolicyRule", "action", _one_of("FailJob", "FailIndex", "Ignore", "Count")),
    (_BATCH + "PodFailurePolicyOnExitCodesRequirement", "operator", _one_of("In", "NotIn")),
)  # fmt: skip

#: A quantity (``500m``, ``2Gi``, ``4``): the API server refuses others, and negative ones where it counts.
QUANTITY_SCHEMA = {
    "allOf": [
        _matching("a Kubernetes quantity", _QUANTITY),
        {"if": {"type": "number"}, "then": {"minimum": 0}},
    ]
}

# --------------------------------------------------------------------------------------------- rendering


class RenderError(Exception):
    """kubectl kustomize failed."""


def render(path: str | Path, kubectl: str = "kubectl") -> list[dict[str, Any]]:
    """Objects of ``kubectl kustomize PATH`` (no cluster needed)."""
    proc = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RenderError(f"kubectl kustomize {path} failed: {proc.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def ident(obj: dict[str, Any]) -> str:
    return f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"


# ------------------------------------------------------------------------------------- schema validation


def bundled_versions() -> list[str]:
    from kubernetes_validate import utils

    return [utils.major_minor(v) for v in utils.all_versions()]


def validation_versions() -> list[str]:
    """The minimum supported version and the newest one kubernetes-validate bundles."""
    newest = bundled_versions()[-1]
    return sorted({MIN_KUBERNETES, newest}, key=lambda v: tuple(map(int, v.split("."))))


@functools.cache
def _validator(kind: str, api_version: str, version: str) -> Any:
    import jsonschema
    import referencing
    from kubernetes_validate import utils

    matching = [v for v in utils.all_versions() if utils.major_minor(v) == version]
    if not matching:
        raise ValueError(f"kubernetes-validate bundles no schemas for Kubernetes {version}")
    schema_dir = f"kubernetes-json-schema/v{matching[-1]}-local-strict"
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    try:
        schema = utils.schema_contents(f"{schema_dir}/{kind.lower()}-{group_version}.json", version)
    except FileNotFoundError:
        return None
    defs = _refined_definitions(schema_dir, version)
    # The same registry kubernetes-validate builds (its schemas carry their own ids).
    registry = referencing.Resource.from_contents(schema) @ referencing.Registry()
    registry = referencing.Resource.from_contents(defs) @ registry
    return jsonschema.validators.Draft202012Validator(schema, registry=registry)


@functools.cache
def _refined_definitions(schema_dir: str, version: str) -> dict[str, Any]:
    """The bundled ``_definitions.json`` with :data:`REFINEMENTS` and :data:`QUANTITY_SCHEMA` added."""
    from kubernetes_validate import utils

    defs = copy.deepcopy(utils.schema_contents(f"{schema_dir}/_definitions.json", version))
    by_name = defs["$defs"]
    for definition, prop, constraint in REFINEMENTS:
        target = by_name[definition]["properties"][prop.removesuffix("[]")]
        if prop.endswith("[]"):
            target = target["items"]
        target.setdefault("allOf", []).append(constraint)
    by_name["io.k8s.apimachinery.pkg.api.resource.Quantity"].setdefault("allOf", []).append(QUANTITY_SCHEMA)
    return defs


#: Strict schemas of the custom resources the manifests use (kubernetes-validate bundles none): the fields of
#: prometheus-operator's PodMonitor (monitoring.coreos.com/v1) that k8s/ uses, as its CRD types them.
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
CRD_SCHEMAS: dict[tuple[str, str], dict[str, Any]] = {
    ("monitoring.coreos.com/v1", "PodMonitor"): {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": "PodMonitor"},
            "metadata": {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "pattern": f"^{_DNS1123_SUBDOMAIN}$"},
                    "namespace": {"type": "string"},
                    "labels": _STR_MAP,
                    "annotations": _STR_MAP,
                },
            },
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints"],
                "additionalProperties": False,
                "properties": {
                    "jobLabel": {"type": "string"},
                    "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": _STR_MAP},
                    },
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "scheme": {"enum": ["http", "https"]},
                                "interval": {"type": "string", "pattern": r"^(0|(\d+(ms|s|m|h))+)$"},
                                "scrapeTimeout": {"type": "string", "pattern": r"^(0|(\d+(ms|s|m|h))+)$"},
                                "honorLabels": {"type": "boolean"},
                            },
                        },
                    },
                },
            },
        },
    },
}


def schema_errors(obj: dict[str, Any], version: str) -> list[str]:
    """Every strict-schema error of ``obj`` for Kubernetes ``version`` (a missing schema is an error too)."""
    crd = CRD_SCHEMAS.get((str(obj.get("apiVersion")), str(obj.get("kind"))))
    if crd is not None:
        import jsonschema

        return [
            f"{ident(obj)} [crd] {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in jsonschema.Draft202012Validator(crd).iter_errors(obj)
        ]
    validator = _validator(str(obj.get("kind")), str(obj.get("apiVersion")), version)
    if validator is None:
        return [
            f"{ident(obj)}: no schema for {obj.get('apiVersion')} {obj.get('kind')} in Kubernetes {version}"
        ]
    out = []
    for err in sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in err.absolute_path) or "(root)"
        title = err.schema.get("title") if isinstance(err.schema, dict) else None
        message = f"{err.instance!r} is not {title}" if title else err.message
        out.append(f"{ident(obj)} [k8s {version}] {where}: {message}")
    return out


def manifest_errors(objs: list[dict[str, Any]], dockerfile: Path | None = REPO / "Dockerfile") -> list[str]:
    """Every schema error (each of :func:`validation_versions`) and every structural error of a render."""
    errors = [e for v in validation_versions() for obj in objs for e in schema_errors(obj, v)]
    return errors + structural_errors(objs, dockerfile)


# --------------------------------------------------------------------------------------------- helpers


def parse_quantity(text: Any) -> float | None:
    """Value of a Kubernetes quantity (``"500m"``, ``"2Gi"``, ``4``), or ``None`` if it is not one."""
    if isinstance(text, bool):
        return None
    if isinstance(text, int | float):
        return float(text)
    m = QUANTITY.match(str(text))
    if not m:
        return None
    number = str(text)[: m.start("suffix")] if m.group("suffix") else str(text)
    suffix = m.group("suffix") or ""
    if suffix[:1] in ("e", "E"):
        return float(number) * 10 ** int(suffix[1:])
    return float(number) * SUFFIX_FACTORS[suffix]


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Whether a ``matchLabels`` selector matches ``labels`` (matchExpressions are not used here)."""
    if not selector:
        return True
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


@dataclass
class Workload:
    """A pod template and where it came from."""

    owner: dict[str, Any]
    template: dict[str, Any]

    @property
    def name(self) -> str:
        return ident(self.owner)

    @property
    def spec(self) -> dict[str, Any]:
        return self.template.get("spec") or {}

    @property
    def labels(self) -> dict[str, str]:
        labels = dict((self.template.get("metadata") or {}).get("labels") or {})
        if self.owner["kind"] == "Job":
            for key in JOB_NAME_LABELS:
                labels[key] = self.owner["metadata"]["name"]
            for key in JOB_UID_LABELS:
                labels[key] = "00000000-0000-0000-0000-000000000000"
        return labels

    def containers(self, init: bool = True) -> list[dict[str, Any]]:
        return list(self.spec.get("initContainers") or []) * init + list(self.spec.get("containers") or [])


def workloads(objs: list[dict[str, Any]]) -> list[Workload]:
    out = []
    for obj in objs:
        spec = obj.get("spec") or {}
        if obj.get("kind") in ("Job", "StatefulSet", "Deployment", "DaemonSet", "ReplicaSet"):
            out.append(Workload(obj, spec.get("template") or {}))
        elif obj.get("kind") == "CronJob":
            out.append(
                Workload(obj, ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {})
            )
    return out


def find(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objs if o.get("kind") == kind and (name is None or o["metadata"].get("name") == name)]


def env_map(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env") or []}


def expand(text: str, values: dict[str, str]) -> tuple[str, list[str]]:
    """Kubernetes ``$(VAR)`` expansion; returns the result and the names that were not defined."""
    missing: list[str] = []

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        if name in values:
            return values[name]
        missing.append(name)
        return m.group(0)

    return ENV_REF.sub(sub, text), missing


def option(args: list[str], name: str) -> str | None:
    """Value of ``--name=V`` or ``--name V`` in ``args`` (the last one wins)."""
    value = None
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        elif arg == name and i + 1 < len(args):
            value = args[i + 1]
    return value


def is_training(container: dict[str, Any]) -> bool:
    argv = list(container.get("command") or []) + list(container.get("args") or [])
    return bool(argv) and Path(argv[0]).name == "elastic-train" and "run" in argv[1:2]


def image_name(image: str) -> str:
    return image.split("@")[0].rsplit(":", 1)[0] if ":" in image.split("/")[-1] else image.split("@")[0]


def secret_or_configmap_data(obj: dict[str, Any]) -> dict[str, str]:
    """Decoded data of a ConfigMap or Secret."""
    data = dict(obj.get("data") or {})
    if obj["kind"] == "Secret":
        data = {k: base64.b64decode(v).decode() for k, v in data.items()}
        data.update(obj.get("stringData") or {})
    return data


# ---------------------------------------------------------------------------------------- the checks


def structural_errors(objs: list[dict[str, Any]], dockerfile: Path | None = REPO / "Dockerfile") -> list[str]:
    """Everything the schemas miss, over a whole render."""
    errors: list[str] = []
    for check in (
        check_namespaces,
        check_names,
        check_requests,
        check_references,
        check_env_expansion,
        check_security,
        check_images,
        check_services,
        check_jobs,
        check_training_command,
        check_etcd,
        check_network_policies,
        check_monitors,
    ):
        errors.extend(check(objs))
    if dockerfile is not None:
        errors.extend(check_image_user(objs, dockerfile))
    return errors


def check_namespaces(objs: list[dict[str, Any]]) -> list[str]:
    """One job, one namespace: every namespaced object of the render in the same one (or all unset)."""
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PriorityClass", "StorageClass"}
    spaces: dict[str | None, list[str]] = {}
    for obj in objs:
        if obj.get("kind") not in cluster_scoped:
            spaces.setdefault((obj.get("metadata") or {}).get("namespace"), []).append(ident(obj))
    if len(spaces) <= 1:
        return []
    return [f"objects are spread over namespaces {sorted(map(str, spaces))}: {spaces}"]


def check_names(objs: list[dict[str, Any]]) -> list[str]:
    """Name rules that depend on the kind or on siblings (the schemas check every name's own syntax)."""
    errors = []
    for obj in objs:
        name = str((obj.get("metadata") or {}).get("name", ""))
        if obj.get("kind") in ("Service", "Namespace", "Job", "StatefulSet") and not (
            DNS1123_LABEL.match(name) and len(name) <= 63
        ):
            errors.append(f"{ident(obj)}: name {name!r} is not a DNS-1123 label")
        if obj.get("kind") == "StatefulSet" and len(name) > 52:
            errors.append(f"{ident(obj)}: StatefulSet names longer than 52 characters break pod labels")
    for w in workloads(objs):
        names = [c.get("name", "") for c in w.containers()]
        if len(set(names)) != len(names):
            errors.append(f"{w.name}: duplicate container names {names}")
    return errors


def check_requests(objs: list[dict[str, Any]]) -> list[str]:
    """No container requests more of a resource than its limit."""
    errors = []
    for w in workloads(objs):
        for c in w.containers():
            res = c.get("resources") or {}
            for name, limit in (res.get("limits") or {}).items():
                request = (res.get("requests") or {}).get(name)
                lq, rq = parse_quantity(limit), parse_quantity(request) if request is not None else None
                if lq is not None and rq is not None and rq > lq:
                    errors.append(
                        f"{w.name}: container {c['name']} requests {name}={request} above its limit"
                    )
    return errors


def _volume_refs(w: Workload) -> Iterator[tuple[str, str, list[str], bool]]:
    """(kind, name, keys, optional) of ConfigMaps/Secrets a pod template uses."""
    for vol in w.spec.get("volumes") or []:
        if "configMap" in vol:
            cm = vol["configMap"]
            yield (
                "ConfigMap",
                cm.get("name", ""),
                [i["key"] for i in cm.get("items") or []],
                cm.get("optional", False),
            )
        if "secret" in vol:
            s = vol["secret"]
            yield (
                "Secret",
                s.get("secretName", ""),
                [i["key"] for i in s.get("items") or []],
                s.get("optional", False),
            )
        for src in (vol.get("projected") or {}).get("sources") or []:
            for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
                if key in src:
                    ref = src[key]
                    keys = [i["key"] for i in ref.get("items") or []]
                    yield kind, ref.get("name", ""), keys, ref.get("optional", False)
    for c in w.containers():
        for e in c.get("env") or []:
            vf = e.get("valueFrom") or {}
            for kind, key in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                if key in vf:
                    ref = vf[key]
                    yield kind, ref.get("name", ""), [ref.get("key", "")], ref.get("optional", False)
        for ef in c.get("envFrom") or []:
            for kind, key in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if key in ef:
                    yield kind, ef[key].get("name", ""), [], ef[key].get("optional", False)


def check_references(objs: list[dict[str, Any]]) -> list[str]:
    errors = []
    for w in workloads(objs):
        ns = w.owner["metadata"].get("namespace")
        for kind, name, keys, optional in _volume_refs(w):
            found = [o for o in find(objs, kind, name) if o["metadata"].get("namespace") == ns]
            if not found:
                if not optional:
                    errors.append(f"{w.name}: refers to {kind} {name!r}, which is not in the render")
                continue
            data = secret_or_configmap_data(found[0])
            for key in keys:
                if key not in data:
                    errors.append(f"{w.name}: {kind} {name!r} has no key {key!r}")
        claim_templates = {
            t["metadata"]["name"] for t in (w.owner.get("spec") or {}).get("volumeClaimTemplates") or []
        }
        volumes = {v["name"]: v for v in w.spec.get("volumes") or []}
        for vol in volumes.values():
            claim = (vol.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and not [p for p in find(objs, "PersistentVolumeClaim", claim)]:
                errors.append(
                    f"{w.name}: volume {vol['name']} uses PVC {claim!r}, which is not in the render"
                )
        for c in w.containers():
            paths = []
            for m in c.get("volumeMounts") or []:
                if m["name"] not in volumes and m["name"] not in claim_templates:
                    errors.append(f"{w.name}: container {c['name']} mounts undefined volume {m['name']!r}")
                paths.append(m["mountPath"])
            if len(paths) != len(set(paths)):
                errors.append(f"{w.name}: container {c['name']} mounts two volumes at one path")
            port_names = {p.get("name") for p in c.get("ports") or []}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                p = c.get(probe) or {}
                for handler in ("httpGet", "tcpSocket", "grpc"):
                    port = (p.get(handler) or {}).get("port")
                    if isinstance(port, str) and port not in port_names:
                        errors.append(f"{w.name}: {c['name']} {probe} uses unknown port name {port!r}")
        sa = w.spec.get("serviceAccountName")
        if sa and sa != "default" and not find(objs, "ServiceAccount", sa):
            errors.append(f"{w.name}: ServiceAccount {sa!r} is not in the render")
    return errors


def check_env_expansion(objs: list[dict[str, Any]]) -> list[str]:
    """``$(VAR)`` in env values must name a variable defined *earlier*; in command/args, any defined one."""
    errors = []
    for w in workloads(objs):
        for c in w.containers():
            seen: set[str] = set()
            for e in c.get("env") or []:
                value = e.get("value")
                if isinstance(value, str):
                    _, missing = expand(value, {n: "" for n in seen})
                    for name in missing:
                        errors.append(
                            f"{w.name}: container {c['name']} env {e['name']} uses $({name}) "
                            "before it is defined (Kubernetes leaves it unexpanded)"
                        )
                seen.add(e["name"])
            for field in ("command", "args"):
                for arg in c.get(field) or []:
                    _, missing = expand(str(arg), {n: "" for n in seen})
                    for name in missing:
                        errors.append(f"{w.name}: container {c['name']} {field} uses undefined $({name})")
    return errors


def check_security(objs: list[dict[str, Any]]) -> list[str]:
    """The restricted Pod Security Standard, a read-only root fs and resources on every container."""
    errors = []
    for w in workloads(objs):
        pod = w.spec.get("securityContext") or {}
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if w.spec.get(flag):
                errors.append(f"{w.name}: {flag} is set")
        for vol in w.spec.get("volumes") or []:
            if "hostPath" in vol:
                errors.append(f"{w.name}: volume {vol['name']} is a hostPath")
        for c in w.containers():
            sc = c.get("securityContext") or {}
            where = f"{w.name}: container {c['name']}"
            if not sc.get("runAsNonRoot", pod.get("runAsNonRoot")):
                errors.append(f"{where}: runAsNonRoot is not true")
            if sc.get("runAsUser", pod.get("runAsUser")) == 0:
                errors.append(f"{where}: runs as uid 0")
            if sc.get("allowPrivilegeEscalation") is not False:
                errors.append(f"{where}: allowPrivilegeEscalation is not false")
            if sc.get("privileged"):
                errors.append(f"{where}: privileged")
            if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
                errors.append(f"{where}: capabilities do not drop ALL")
            if ((sc.get("capabilities") or {}).get("add") or []) not in ([], ["NET_BIND_SERVICE"]):
                errors.append(f"{where}: adds capabilities")
            seccomp = (sc.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
            if seccomp not in ("RuntimeDefault", "Localhost"):
                errors.append(f"{where}: seccompProfile is not RuntimeDefault/Localhost")
            if sc.get("readOnlyRootFilesystem") is not True:
                errors.append(f"{where}: readOnlyRootFilesystem is not true")
            res = c.get("resources") or {}
            for kind, name in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
                if name not in (res.get(kind) or {}):
                    errors.append(f"{where}: no resources.{kind}.{name}")
    return errors


def check_images(objs: list[dict[str, Any]]) -> list[str]:
    errors = []
    for w in workloads(objs):
        for c in w.containers():
            image = str(c.get("image", ""))
            tag = image.split("@")[0].split("/")[-1].partition(":")[2]
            if not IMAGE_PINNED.match(image) or not (tag or "@sha256:" in image) or tag == "latest":
                errors.append(
                    f"{w.name}: container {c['name']} image {image!r} is not pinned to a tag or digest"
                )
    return errors


def check_services(objs: list[dict[str, Any]]) -> list[str]:
    errors = []
    ws = workloads(objs)
    for svc in find(objs, "Service"):
        spec = svc.get("spec") or {}
        selector = spec.get("selector")
        if not selector:
            continue
        targets = [w for w in ws if selects({"matchLabels": selector}, w.labels)]
        if not targets:
            errors.append(f"{ident(svc)}: selector {selector} matches no pod template in the render")
            continue
        ports = {
            p.get("name"): p for w in targets for c in w.containers(init=False) for p in c.get("ports") or []
        }
        numbers = {p.get("containerPort") for p in ports.values()}
        for p in spec.get("ports") or []:
            target = p.get("targetPort", p.get("port"))
            if (isinstance(target, str) and target not in ports) or (
                isinstance(target, int) and target not in numbers
            ):
                errors.append(
                    f"{ident(svc)}: port {p.get('name')} targets {target!r}, which no selected container has"
                )
    for w in ws:
        sel = (w.owner.get("spec") or {}).get("selector")
        if sel and w.owner["kind"] != "Job" and not selects(sel, w.labels):
            errors.append(f"{w.name}: selector does not match its own pod template labels")
        sub = w.spec.get("subdomain")
        if sub:
            svc = find(objs, "Service", sub)
            if not svc:
                errors.append(f"{w.name}: subdomain {sub!r} has no Service of that name")
            elif (svc[0].get("spec") or {}).get("clusterIP") != "None":
                errors.append(f"{w.name}: subdomain Service {sub!r} is not headless")
            elif not selects({"matchLabels": svc[0]["spec"].get("selector") or {}}, w.labels):
                errors.append(f"{w.name}: subdomain Service {sub!r} does not select its pods")
    for pdb in find(objs, "PodDisruptionBudget"):
        if not [w for w in ws if selects(pdb["spec"].get("selector"), w.labels)]:
            errors.append(f"{ident(pdb)}: selects no pod template")
    return errors


def check_jobs(objs: list[dict[str, Any]]) -> list[str]:
    errors = []
    for job in find(objs, "Job"):
        spec = job.get("spec") or {}
        where = ident(job)
        indexed = spec.get("completionMode") == "Indexed"
        completions, parallelism = spec.get("completions"), spec.get("parallelism", 1)
        if indexed and completions is None:
            errors.append(f"{where}: an Indexed Job needs completions")
        for field in ("backoffLimitPerIndex", "maxFailedIndexes", "successPolicy"):
            if field in spec and not indexed:
                errors.append(f"{where}: {field} needs completionMode Indexed")
        if "maxFailedIndexes" in spec and "backoffLimitPerIndex" not in spec:
            errors.append(f"{where}: maxFailedIndexes needs backoffLimitPerIndex")
        if completions is not None and spec.get("maxFailedIndexes", 0) > completions:
            errors.append(f"{where}: maxFailedIndexes exceeds completions")
        template_spec = (spec.get("template") or {}).get("spec") or {}
        pfp = spec.get("podFailurePolicy")
        if pfp:
            if template_spec.get("restartPolicy") != "Never":
                errors.append(f"{where}: podFailurePolicy requires restartPolicy Never")
            names = {c["name"] for c in template_spec.get("containers") or []}
            rules = pfp.get("rules") or []
            for rule in rules:
                exit_rule = rule.get("onExitCodes") or {}
                if exit_rule.get("containerName") and exit_rule["containerName"] not in names:
                    errors.append(
                        f"{where}: podFailurePolicy names unknown container {exit_rule['containerName']!r}"
                    )
                if rule.get("action") == "FailIndex" and "backoffLimitPerIndex" not in spec:
                    errors.append(f"{where}: FailIndex needs backoffLimitPerIndex")
            disruption_ignored = any(
                r.get("action") == "Ignore"
                and any(
                    c.get("type") == "DisruptionTarget" and c.get("status", "True") == "True"
                    for c in r.get("onPodConditions") or []
                )
                for r in rules
            )
            if not disruption_ignored:
                errors.append(
                    f"{where}: podFailurePolicy does not ignore DisruptionTarget (preemptions count)"
                )
        else:
            errors.append(f"{where}: no podFailurePolicy (preemptions would count against the backoff limit)")
        for rule in (spec.get("successPolicy") or {}).get("rules") or []:
            if completions is not None and rule.get("succeededCount", 0) > completions:
                errors.append(f"{where}: successPolicy succeededCount exceeds completions")
        if indexed and completions is not None and parallelism != completions:
            errors.append(f"{where}: parallelism {parallelism} != completions {completions}")
    return errors


@dataclass
class TrainingCommand:
    """The training container's ``elastic-train run`` invocation with Kubernetes' expansion applied."""

    workload: Workload
    container: dict[str, Any]
    argv: list[str]
    unresolved: dict[str, str]  # variable -> its valueFrom source ("fieldRef:...", "secret:NAME/KEY", ...)


def _value_source(entry: dict[str, Any]) -> str:
    vf = entry.get("valueFrom") or {}
    if "fieldRef" in vf:
        return "fieldRef:" + vf["fieldRef"].get("fieldPath", "")
    if "secretKeyRef" in vf:
        return f"secret:{vf['secretKeyRef'].get('name')}/{vf['secretKeyRef'].get('key')}"
    if "configMapKeyRef" in vf:
        return f"configmap:{vf['configMapKeyRef'].get('name')}/{vf['configMapKeyRef'].get('key')}"
    return "resourceFieldRef"


def training_commands(objs: list[dict[str, Any]]) -> list[TrainingCommand]:
    out = []
    for w in workloads(objs):
        for c in w.containers(init=False):
            if not is_training(c):
                continue
            literal = {e["name"]: str(e["value"]) for e in c.get("env") or [] if "value" in e}
            unresolved = {e["name"]: _value_source(e) for e in c.get("env") or [] if "valueFrom" in e}
            values = dict(literal)
            for name, source in unresolved.items():
                values[name] = f"<{source}>"
            argv = [
                expand(str(a), values)[0] for a in list(c.get("command") or []) + list(c.get("args") or [])
            ]
            out.append(TrainingCommand(w, c, argv, unresolved))
    return out


def _job_config_text(objs: list[dict[str, Any]], tc: TrainingCommand, path: str) -> str | None:
    mounts = tc.container.get("volumeMounts") or []
    volumes = {v["name"]: v for v in tc.workload.spec.get("volumes") or []}
    for m in mounts:
        prefix = m["mountPath"].rstrip("/") + "/"
        if path.startswith(prefix) and "configMap" in volumes.get(m["name"], {}):
            cm_name = volumes[m["name"]]["configMap"]["name"]
            rel = path[len(prefix) :]
            items = volumes[m["name"]]["configMap"].get("items")
            key = next((i["key"] for i in items if i["path"] == rel), None) if items else rel
            for cm in find(objs, "ConfigMap", cm_name):
                if key in (cm.get("data") or {}):
                    return str(cm["data"][key])
    return None


def check_training_command(objs: list[dict[str, Any]]) -> list[str]:
    from elastic_train.config.job import ENV_OVERRIDES, JobConfig
    from elastic_train.config.loader import apply_overrides, from_dict, parse_override
    from elastic_train.errors import ConfigError

    errors = []
    commands = training_commands(objs)
    if not [w for w in workloads(objs) if w.owner["kind"] == "Job"]:
        return errors
    if not commands:
        return ["no Job runs `elastic-train run`"]
    for tc in commands:
        job = tc.workload.owner
        where = f"{tc.workload.name} container {tc.container['name']}"
        if job["kind"] != "Job":
            errors.append(f"{where}: elastic-train run belongs in an Indexed Job")
            continue
        spec = job["spec"]
        args = tc.argv[2:]
        # --nodes MIN:MAX against the Job's shape.
        nodes = option(args, "--nodes")
        low = high = None
        if nodes is None or not re.fullmatch(r"\d+(:\d+)?", nodes):
            errors.append(f"{where}: --nodes is {nodes!r}, expected MIN:MAX")
        else:
            lo, _, hi = nodes.partition(":")
            low, high = int(lo), int(hi or lo)
            if not 1 <= low <= high:
                errors.append(f"{where}: --nodes {nodes}: need 1 <= MIN <= MAX")
            errors.extend(size_errors(spec, low, high, where))
            for pdb in find(objs, "PodDisruptionBudget"):
                if selects(pdb["spec"].get("selector"), tc.workload.labels):
                    floor = pdb["spec"].get("minAvailable")
                    if floor != low:
                        errors.append(
                            f"{ident(pdb)}: minAvailable {floor!r} != MIN nodes {low} (drains would take the "
                            "job below MIN, or be blocked above it)"
                        )
            for rule in (spec.get("successPolicy") or {}).get("rules") or []:
                count = rule.get("succeededCount")
                if count is not None and not 1 <= count <= low:
                    errors.append(f"{where}: successPolicy succeededCount {count} not in 1..MIN ({low})")
        # --endpoint: the etcd client Service, its port.
        endpoint = option(args, "--endpoint")
        if endpoint is None:
            errors.append(f"{where}: no --endpoint")
        else:
            errors.extend(_check_endpoint(objs, job, where, endpoint))
        # --run-id: the Job's name and UID, from the labels the Job controller sets.
        run_id = option(args, "--run-id")
        job_name = job["metadata"]["name"]
        if run_id not in RUN_ID_SOURCES:
            errors.append(
                f"{where}: --run-id {run_id!r} is not the Job's name and UID ({RUN_ID_FORM}): a re-applied "
                "Job would find its finished run and be refused"
            )
        local_addr = option(args, "--local-addr")
        if local_addr is not None and local_addr != "<fieldRef:status.podIP>":
            errors.append(f"{where}: --local-addr {local_addr!r} should be the pod IP (status.podIP)")
        # The job config: present, and valid under the project's strict loader with the CLI's overrides.
        config_path = tc.argv[2] if len(tc.argv) > 2 and not tc.argv[2].startswith("-") else None
        if config_path is None:
            errors.append(f"{where}: no job config file argument")
            continue
        text = _job_config_text(objs, tc, config_path)
        if text is None:
            errors.append(f"{where}: {config_path} is not a key of a mounted ConfigMap in the render")
            continue
        data = yaml.safe_load(text) or {}
        overrides: dict[str, Any] = {}
        env = {e["name"]: e for e in tc.container.get("env") or []}
        for var, key in ENV_OVERRIDES.items():
            if var in env and "value" in env[var]:
                overrides[key] = env[var]["value"]
        if low is not None:
            overrides["rendezvous.min_nodes"], overrides["rendezvous.max_nodes"] = low, high
        if endpoint:
            overrides["rendezvous.endpoint"] = endpoint
        overrides["rendezvous.run_id"] = f"{job_name}-00000000-0000-0000-0000-000000000000"
        for i, arg in enumerate(args):
            if arg == "--set" and i + 1 < len(args):
                key, value = parse_override(args[i + 1])
                overrides[key] = value
        try:
            cfg = from_dict(JobConfig, apply_overrides(data, overrides))
        except ConfigError as exc:
            errors.append(f"{where}: job config {config_path}: {exc}")
            continue
        errors.extend(_check_config_vs_pod(objs, tc, cfg, where))
    return errors


#: The form of a training pod's ``--run-id`` (``$(JOB_NAME)-$(JOB_UID)``, both from the pod's labels).
RUN_ID_FORM = "$(JOB_NAME)-$(JOB_UID) from the labels batch.kubernetes.io/job-name and controller-uid"
RUN_ID_SOURCES = {
    f"<fieldRef:metadata.labels['{name}']>-<fieldRef:metadata.labels['{uid}']>"
    for name in JOB_NAME_LABELS
    for uid in JOB_UID_LABELS
}


def size_errors(spec: dict[str, Any], low: int, high: int, where: str) -> list[str]:
    """The Job's size (parallelism = completions) against ``--nodes LOW:HIGH``: what an in-place resize
    (docs/kubernetes.md) must keep too."""
    errors = []
    parallelism, completions = spec.get("parallelism"), spec.get("completions")
    if not isinstance(completions, int) or not low <= completions <= high:
        errors.append(f"{where}: Job completions {completions} not in --nodes {low}:{high}")
    if parallelism != completions:
        errors.append(f"{where}: Job parallelism {parallelism} != completions {completions}")
    if isinstance(completions, int) and spec.get("maxFailedIndexes", 0) > completions - low:
        errors.append(
            f"{where}: maxFailedIndexes {spec.get('maxFailedIndexes')} > completions - MIN = "
            f"{completions - low} (the Job would keep running with fewer than MIN nodes possible)"
        )
    return errors


def _check_endpoint(objs: list[dict[str, Any]], job: dict[str, Any], where: str, endpoint: str) -> list[str]:
    errors = []
    ns = job["metadata"].get("namespace")
    etcd_pods = [w for w in workloads(objs) if any(c["name"] == "etcd" for c in w.containers(init=False))]
    for ep in endpoint.split(","):
        host, _, port = ep.strip().rpartition(":")
        parts = host.split(".")
        svc_name = parts[0]
        if len(parts) > 1 and ns and parts[1] != ns:
            errors.append(f"{where}: --endpoint {ep} names namespace {parts[1]!r}, the Job is in {ns!r}")
        if len(parts) > 2 and ".".join(parts[2:]) not in ("svc", "svc.cluster.local"):
            errors.append(f"{where}: --endpoint {ep} is not a Service DNS name")
        svcs = find(objs, "Service", svc_name)
        if not svcs:
            errors.append(f"{where}: --endpoint host {host!r} is not a Service in the render")
            continue
        svc = svcs[0]
        ports = {p.get("port"): p for p in svc["spec"].get("ports") or []}
        if not port.isdigit() or int(port) not in ports:
            errors.append(f"{where}: --endpoint port {port!r} is not a port of Service {svc_name}")
        if svc["spec"].get("clusterIP") == "None":
            errors.append(f"{where}: --endpoint {host} is the headless peer Service; use the client Service")
        selected = [
            w for w in etcd_pods if selects({"matchLabels": svc["spec"].get("selector") or {}}, w.labels)
        ]
        if not selected:
            errors.append(f"{where}: --endpoint Service {svc_name} does not select the etcd pods")
        elif port.isdigit() and int(port) in ports:
            target = ports[int(port)].get("targetPort", int(port))
            etcd_ports = {
                p.get("name"): p.get("containerPort")
                for c in selected[0].containers()
                for p in c.get("ports") or []
            }
            number = etcd_ports.get(target) if isinstance(target, str) else target
            if number != 2379 and number not in _etcd_client_ports(selected[0]):
                errors.append(f"{where}: --endpoint {ep} reaches etcd port {number}, not its client port")
    return errors


def _etcd_client_ports(w: Workload) -> set[int]:
    ports = set()
    for c in w.containers(init=False):
        if c["name"] != "etcd":
            continue
        urls = str(env_map(c).get("ETCD_LISTEN_CLIENT_URLS", {}).get("value", ""))
        ports.update(int(p) for p in re.findall(r":(\d+)", urls))
    return ports


def _check_config_vs_pod(objs: list[dict[str, Any]], tc: TrainingCommand, cfg: Any, where: str) -> list[str]:
    errors = []
    env = env_map(tc.container)
    res = tc.container.get("resources") or {}
    gpus = (res.get("limits") or {}).get("nvidia.com/gpu")
    nproc = cfg.rendezvous.nproc_per_node
    if gpus is not None:
        if int(parse_quantity(gpus) or 0) != nproc:
            errors.append(f"{where}: nproc_per_node {nproc} != nvidia.com/gpu limit {gpus}")
        if cfg.train.backend == "gloo":
            errors.append(f"{where}: GPU pods train with backend gloo; use nccl or auto")
    elif cfg.train.backend == "nccl":
        errors.append(f"{where}: backend nccl without nvidia.com/gpu resources")
    # etcd credentials: the password variable comes from the Secret the etcd auth sidecar uses.
    if cfg.rendezvous.user:
        pw = env.get(cfg.rendezvous.password_env)
        if pw is None and not cfg.rendezvous.password_file:
            errors.append(f"{where}: rendezvous.user is set but {cfg.rendezvous.password_env} is not")
        own = [c for c in tc.workload.containers() if "wait" in (c.get("args") or [])]
        ensures = [c for w in workloads(objs) for c in w.containers() if "ensure" in (c.get("args") or [])]
        for c in own:
            user = option(list(c.get("args") or []), "--user")
            if user != cfg.rendezvous.user:
                errors.append(f"{where}: etcd user {cfg.rendezvous.user!r} != {c['name']} --user {user!r}")
        mine = [c for c in ensures if option(list(c.get("args") or []), "--user") == cfg.rendezvous.user]
        if ensures and not mine:
            users = [option(list(c.get("args") or []), "--user") for c in ensures]
            errors.append(
                f"{where}: etcd user {cfg.rendezvous.user!r} is created by no auth sidecar ({users})"
            )
        for c in own + mine:
            sidecar_pw = env_map(c).get("ETCD_TRAINING_PASSWORD")
            if pw is not None and sidecar_pw is not None and _value_source(pw) != _value_source(sidecar_pw):
                errors.append(f"{where}: {cfg.rendezvous.password_env} and {c['name']} use different Secrets")
        keys = f"/elastic_train/{tc.workload.owner['metadata']['name']}-"
        for c in mine:
            prefix = option(list(c.get("args") or []), "--prefix") or ""
            if not keys.startswith(prefix):
                errors.append(
                    f"{where}: {c['name']} --prefix {prefix!r} does not cover this job's keys {keys}..."
                )
    # Checkpoints: a local path must be on a ReadWriteMany PVC shared by all pods.
    url = cfg.checkpoint.url
    if "://" not in url:
        volumes = {v["name"]: v for v in tc.workload.spec.get("volumes") or []}
        mount = next(
            (
                m
                for m in tc.container.get("volumeMounts") or []
                if (url.rstrip("/") + "/").startswith(m["mountPath"].rstrip("/") + "/")
            ),
            None,
        )
        claim = (
            (volumes.get(mount["name"], {}) if mount else {})
            .get("persistentVolumeClaim", {})
            .get("claimName")
        )
        if not url.startswith("/") or claim is None:
            errors.append(f"{where}: checkpoint URL {url!r} is not on a mounted PersistentVolumeClaim")
        else:
            for pvc in find(objs, "PersistentVolumeClaim", claim):
                if "ReadWriteMany" not in (pvc["spec"].get("accessModes") or []):
                    errors.append(f"{where}: checkpoint PVC {claim} is not ReadWriteMany")
    elif url.startswith("s3://") and not (
        {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)
        or tc.workload.spec.get("serviceAccountName")
    ):
        errors.append(f"{where}: s3 checkpoints without credentials or a service account")
    # Writable paths: /tmp and /dev/shm are emptyDirs, /dev/shm memory-backed and within the memory limit.
    volumes = {v["name"]: v for v in tc.workload.spec.get("volumes") or []}
    mounts = {m["mountPath"]: volumes.get(m["name"], {}) for m in tc.container.get("volumeMounts") or []}
    if "emptyDir" not in mounts.get("/tmp", {}):
        errors.append(f"{where}: /tmp is not an emptyDir (the root filesystem is read-only)")
    shm = mounts.get("/dev/shm", {}).get("emptyDir")
    if shm is None or shm.get("medium") != "Memory":
        errors.append(f"{where}: /dev/shm is not a memory-backed emptyDir")
    else:
        limit = parse_quantity((res.get("limits") or {}).get("memory"))
        size = parse_quantity(shm.get("sizeLimit"))
        if size is None:
            errors.append(f"{where}: /dev/shm emptyDir has no sizeLimit")
        elif limit is not None and size >= limit:
            errors.append(f"{where}: /dev/shm sizeLimit is not below the memory limit")
    if env.get("GLOO_SOCKET_IFNAME", {}).get("value") == "lo":
        errors.append(f"{where}: GLOO_SOCKET_IFNAME=lo inside a pod cannot reach other pods")
    errors.extend(_check_metrics(objs, tc, cfg.rendezvous.metrics_port, where))
    return errors


def _check_metrics(
    objs: list[dict[str, Any]], tc: TrainingCommand, port: int | None, where: str
) -> list[str]:
    """The agent's metrics port (rendezvous.metrics_port), the container's port named ``metrics``, the scrape
    annotations and a NetworkPolicy rule that lets scrapers in all agree."""
    errors = []
    ports = {p.get("name"): p.get("containerPort") for p in tc.container.get("ports") or []}
    annotations = (tc.workload.template.get("metadata") or {}).get("annotations") or {}
    scraped = annotations.get("prometheus.io/scrape") == "true"
    if port is None:
        if "metrics" in ports or scraped:
            errors.append(f"{where}: the pod announces metrics but rendezvous.metrics_port is not set")
        return errors
    if ports.get("metrics") != port:
        errors.append(
            f"{where}: rendezvous.metrics_port {port} is not the container's port named metrics "
            f"({ports.get('metrics')})"
        )
    if scraped and annotations.get("prometheus.io/port") != str(port):
        errors.append(f"{where}: prometheus.io/port {annotations.get('prometheus.io/port')!r} != {port}")
    admitted = False
    for p in find(objs, "NetworkPolicy"):
        if not selects(p["spec"].get("podSelector"), tc.workload.labels):
            continue
        for rule in p["spec"].get("ingress") or []:
            numbers = {x.get("port") for x in rule.get("ports") or []}
            peers = rule.get("from")
            # a scraper runs elsewhere (its own namespace): the job's own pods alone do not count
            beyond = not peers or any("namespaceSelector" in x or "ipBlock" in x for x in peers)
            if (not rule.get("ports") or numbers & {port, "metrics"}) and beyond:
                admitted = True
    policed = any(
        selects(p["spec"].get("podSelector"), tc.workload.labels) for p in find(objs, "NetworkPolicy")
    )
    if policed and not admitted:
        errors.append(f"{where}: no NetworkPolicy rule admits scrapes of the metrics port {port}")
    return errors


def check_monitors(objs: list[dict[str, Any]]) -> list[str]:
    """A PodMonitor (prometheus-operator) selects the training pods and names a port they have."""
    errors = []
    ws = workloads(objs)
    for pm in find(objs, "PodMonitor"):
        spec = pm.get("spec") or {}
        selected = [w for w in ws if selects(spec.get("selector"), w.labels)]
        if not selected:
            errors.append(f"{ident(pm)}: selects no pod template in the render")
        names = {
            p.get("name") for w in selected for c in w.containers(init=False) for p in c.get("ports") or []
        }
        for ep in spec.get("podMetricsEndpoints") or []:
            if selected and ep.get("port") not in names:
                errors.append(f"{ident(pm)}: port {ep.get('port')!r} is not a port of the pods it selects")
    return errors


def check_etcd(objs: list[dict[str, Any]]) -> list[str]:
    errors = []
    for sts in find(objs, "StatefulSet"):
        w = workloads([sts])[0]
        etcd = [c for c in w.containers(init=False) if c["name"] == "etcd"]
        if not etcd:
            continue
        where = ident(sts)
        spec = sts["spec"]
        replicas = spec.get("replicas", 1)
        name = sts["metadata"]["name"]
        peer = find(objs, "Service", spec.get("serviceName", ""))
        if not peer or peer[0]["spec"].get("clusterIP") != "None":
            errors.append(
                f"{where}: serviceName {spec.get('serviceName')!r} is not a headless Service in the render"
            )
        elif not peer[0]["spec"].get("publishNotReadyAddresses"):
            errors.append(
                f"{where}: peer Service must publish not-ready addresses (members find each other first)"
            )
        if replicas > 1 and spec.get("podManagementPolicy") != "Parallel":
            errors.append(f"{where}: {replicas} members need podManagementPolicy Parallel to form a quorum")
        if replicas % 2 == 0:
            errors.append(f"{where}: an even number of etcd members ({replicas}) adds no fault tolerance")
        env = env_map(etcd[0])
        cluster = str(env.get("ETCD_INITIAL_CLUSTER", {}).get("value", ""))
        members = [m.split("=", 1)[0] for m in cluster.split(",") if m]
        expected = [f"{name}-{i}" for i in range(replicas)]
        if members != expected:
            errors.append(f"{where}: ETCD_INITIAL_CLUSTER members {members} != pods {expected}")
        for m in cluster.split(","):
            if m and f".{spec.get('serviceName')}." not in m:
                errors.append(f"{where}: initial cluster URL {m!r} does not use the peer Service")
        mounts = {m["name"] for m in etcd[0].get("volumeMounts") or []}
        claims = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or []}
        if not claims & mounts:
            errors.append(f"{where}: etcd data is not on a PersistentVolumeClaim template")
        for probe in ("readinessProbe", "livenessProbe"):
            if probe not in etcd[0]:
                errors.append(f"{where}: etcd has no {probe}")
        if not any("ensure" in (c.get("args") or []) for c in w.containers()):
            errors.append(f"{where}: nothing enables etcd auth (the ensure sidecar is missing)")
    return errors


def check_network_policies(objs: list[dict[str, Any]]) -> list[str]:
    """etcd's client port admits this job's training pods only; the training pods are selected by a policy."""
    errors = []
    ws = workloads(objs)
    training = [tc.workload for tc in training_commands(objs)]
    etcd = [w for w in ws if any(c["name"] == "etcd" for c in w.containers(init=False))]
    policies = find(objs, "NetworkPolicy")
    for e in etcd:
        covering = [p for p in policies if selects(p["spec"].get("podSelector"), e.labels)]
        if not covering:
            errors.append(f"{e.name}: no NetworkPolicy selects the etcd pods")
            continue
        client_ok = False
        for p in covering:
            if "Ingress" not in (p["spec"].get("policyTypes") or ["Ingress"]):
                continue
            for rule in p["spec"].get("ingress") or []:
                ports = {x.get("port") for x in rule.get("ports") or []}
                if rule.get("ports") and not ports & {2379, "client"}:
                    continue
                peers = rule.get("from")
                if not peers:
                    errors.append(f"{ident(p)}: admits etcd client traffic from anywhere")
                    continue
                for peer in peers:
                    if "ipBlock" in peer or "podSelector" not in peer:
                        errors.append(f"{ident(p)}: admits etcd client traffic from outside this job's pods")
                        continue
                    sel = peer["podSelector"]
                    matched = [w for w in ws if selects(sel, w.labels)]
                    if not matched:
                        errors.append(f"{ident(p)}: an etcd client rule selects no pods in the render")
                    extra = [w.name for w in matched if w not in training and w not in etcd]
                    if extra:
                        errors.append(f"{ident(p)}: etcd client rule also admits {extra}")
                    if any(w in training for w in matched):
                        client_ok = True
        if not client_ok and training:
            errors.append(f"{e.name}: no NetworkPolicy rule admits the training pods to etcd's client port")
    for t in training:
        if not [p for p in policies if selects(p["spec"].get("podSelector"), t.labels)]:
            errors.append(f"{t.name}: no NetworkPolicy selects the training pods")
    for p in policies:
        if not [w for w in ws if selects(p["spec"].get("podSelector"), w.labels)]:
            errors.append(f"{ident(p)}: podSelector selects no pods in the render")
    return errors


def dockerfile_user(dockerfile: Path) -> tuple[int | None, int | None]:
    """uid, gid of the last USER instruction (numeric only)."""
    uid = gid = None
    for line in dockerfile.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if len(words) == 2 and words[0].upper() == "USER":
            u, _, g = words[1].partition(":")
            uid = int(u) if u.isdigit() else None
            gid = int(g) if g.isdigit() else None
    return uid, gid


def check_image_user(objs: list[dict[str, Any]], dockerfile: Path) -> list[str]:
    """Pods running the project image run as the Dockerfile's numeric USER (so file ownership agrees)."""
    if not dockerfile.exists():
        return [f"{dockerfile} is missing"]
    uid, gid = dockerfile_user(dockerfile)
    if uid is None or uid == 0:
        return [f"{dockerfile.name}: the last USER is not a numeric non-root uid"]
    errors = []
    for w in workloads(objs):
        pod = w.spec.get("securityContext") or {}
        for c in w.containers():
            if not image_name(str(c.get("image", ""))).endswith("/" + IMAGE_NAME):
                continue
            sc = c.get("securityContext") or {}
            if sc.get("runAsUser", pod.get("runAsUser")) != uid:
                errors.append(f"{w.name}: container {c['name']} runAsUser != Dockerfile USER {uid}")
            if gid is not None and sc.get("runAsGroup", pod.get("runAsGroup")) != gid:
                errors.append(f"{w.name}: container {c['name']} runAsGroup != Dockerfile group {gid}")
    return errors


def patched(objs: list[dict[str, Any]], kind: str, name: str, edit: Any) -> list[dict[str, Any]]:
    """A deep copy of ``objs`` with ``edit(obj)`` applied to the named object (for negative tests)."""
    out = copy.deepcopy(objs)
    for obj in find(out, kind, name):
        edit(obj)
    return out


def dump(objs: list[dict[str, Any]]) -> str:
    return json.dumps(objs, indent=1)
