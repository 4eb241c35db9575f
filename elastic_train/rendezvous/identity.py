"""A run's identity: the settings every node of a job must share, and how two of them differ.

A run id is a shared name, not a lock. The first node of a run writes the identity next to the run's other
keys (create-if-absent); every later node compares its own before it takes part in any round, so a node
started with another checkpoint URL or node range is turned away instead of corrupting the job.

The identity is a flat mapping of dotted setting names to JSON values, in a fixed order (the order decides
which difference a refusal names first), with a fingerprint over its canonical JSON.

- ``elastic-train run``/``local`` nodes: the job config's shared settings
  (:func:`elastic_train.launch.identity.job_settings`), passed from the launcher to the rendezvous handler
  in :data:`ENV_IDENTITY`.
- plain ``torchrun --rdzv-backend=etcd3`` nodes: what torchrun knows (:func:`torchrun_settings`).

The settings are plain values built by the caller; this module knows nothing of the job config.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_train.envvars import ENV_IDENTITY

#: Longest rendering of one value in a refusal line.
MAX_VALUE_CHARS = 80


def torchrun_settings(min_nodes: int, max_nodes: int, nproc_per_node: int | None) -> dict[str, Any]:
    """What a plain torchrun node knows of its job (``nproc_per_node`` when it could be read)."""
    out: dict[str, Any] = {"rendezvous.min_nodes": min_nodes, "rendezvous.max_nodes": max_nodes}
    if nproc_per_node is not None:
        out["rendezvous.nproc_per_node"] = nproc_per_node
    return out


def _render(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


@dataclass(frozen=True, slots=True)
class JobIdentity:
    """The shared settings of a run and their fingerprint."""

    settings: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        canonical = json.dumps(self.settings, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def encode(self, **extra: Any) -> bytes:
        """The etcd value: fingerprint, readable settings and ``extra`` facts (who wrote it, when)."""
        return json.dumps({"fingerprint": self.fingerprint, "settings": self.settings, **extra}).encode()

    @staticmethod
    def decode(raw: bytes) -> JobIdentity:
        """Parse an identity read back from etcd (untrusted).

        Raises:
            ValueError: not the JSON :meth:`encode` writes.
        """
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError("identity is not JSON") from exc
        settings = d.get("settings") if isinstance(d, dict) else None
        if not isinstance(settings, dict) or not all(isinstance(k, str) for k in settings):
            raise ValueError("identity has no settings mapping")
        return JobIdentity(settings)

    @staticmethod
    def from_json(text: str) -> JobIdentity:
        """The identity :data:`ENV_IDENTITY` carries (written by :func:`to_json`).

        Raises:
            ValueError: not a JSON mapping of setting names.
        """
        d = json.loads(text)
        if not isinstance(d, dict):
            raise ValueError(f"{ENV_IDENTITY} is not a JSON mapping")
        return JobIdentity(d)

    def to_json(self) -> str:
        return json.dumps(self.settings)

    def differences(self, mine: JobIdentity) -> list[tuple[str, str, str]]:
        """``(setting, this run's value, mine)`` for every setting that differs, this run's order first."""
        missing = "(unset)"
        out = []
        for key in [*self.settings, *(k for k in mine.settings if k not in self.settings)]:
            theirs, ours = self.settings.get(key, missing), mine.settings.get(key, missing)
            if theirs != ours:
                out.append((key, _render(theirs), _render(ours)))
        return out

    def refusal(self, run_id: str, mine: JobIdentity, most: int = 2) -> str:
        """One line: ``run R is training with K=V; this node has K=V'`` for the first ``most`` differences."""
        diffs = self.differences(mine)[:most]
        if not diffs:
            return f"run {run_id} is training with other settings (fingerprint {self.fingerprint})"
        theirs = ", ".join(f"{k}={v}" for k, v, _ in diffs)
        ours = ", ".join(f"{k}={v}" for k, _, v in diffs)
        return f"run {run_id} is training with {theirs}; this node has {ours}"


def identity_from_environ(environ: Mapping[str, str]) -> JobIdentity | None:
    """The identity the launcher left in :data:`ENV_IDENTITY`, or ``None``.

    Raises:
        ValueError: the variable is set but malformed.
    """
    raw = environ.get(ENV_IDENTITY)
    return JobIdentity.from_json(raw) if raw else None
