"""The whole job configuration (job.yaml) and how it is loaded.

Precedence, lowest first: dataclass defaults, the YAML file, environment variables named in
:data:`ENV_OVERRIDES`, command-line options (the dedicated ones, then ``--set``: see
:mod:`elastic_train.config.options`). Every layer is validated by the same strict loader.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.config.loader import MAX_CONFIG_BYTES, apply_overrides, from_dict, safe_load_bounded
from elastic_train.errors import ConfigError
from elastic_train.log import LoggingConfig
from elastic_train.rendezvous.config import RendezvousConfig
from elastic_train.train.config import TrainConfig

#: Environment variables that override single config keys (useful in Kubernetes manifests).
ENV_OVERRIDES: dict[str, str] = {
    "ELASTIC_TRAIN_ENDPOINT": "rendezvous.endpoint",
    "ELASTIC_TRAIN_RUN_ID": "rendezvous.run_id",
    "ELASTIC_TRAIN_CHECKPOINT_URL": "checkpoint.url",
}


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """Everything a job needs, one section per component."""

    rendezvous: RendezvousConfig = field(default_factory=RendezvousConfig)
    """Where and how agents meet (etcd endpoint, node counts, liveness, failure budget, security)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Task, steps, global batch, seed, audit."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Durable and in-memory checkpoint tiers."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Log level and format."""


def read_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping from ``path`` (at most :data:`MAX_CONFIG_BYTES`, aliases bounded).

    Raises:
        ConfigError: the file is missing, unreadable, too large, not YAML, or not a mapping.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"{path}: refused, larger than {MAX_CONFIG_BYTES // 1024} KiB (not a job config?)"
            )
        data = safe_load_bounded(raw.decode("utf-8"), path)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    except IsADirectoryError as exc:
        raise ConfigError(f"{path}: is a directory, not a config file") from exc
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such config file") from exc
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: malformed YAML{where}: {problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def load_job_config(
    path: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> JobConfig:
    """Load a job config from YAML, environment and explicit overrides.

    Args:
        path: YAML file; ``None`` starts from the defaults.
        overrides: dotted key paths (``"checkpoint.every_steps"``) to values, applied last.
        environ: environment to read :data:`ENV_OVERRIDES` from (default ``os.environ``).

    Raises:
        ConfigError: one line naming the key path, the bad value and what is allowed.
    """
    data = read_yaml(path) if path else {}
    env = os.environ if environ is None else environ
    layered: dict[str, Any] = {dotted: env[name] for name, dotted in ENV_OVERRIDES.items() if env.get(name)}
    layered.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return from_dict(JobConfig, apply_overrides(data, layered))
