"""Job configuration: component dataclasses filled strictly from YAML, CLI options and environment."""

from __future__ import annotations

from elastic_train.config.job import ENV_OVERRIDES, JobConfig, load_job_config
from elastic_train.config.loader import apply_overrides, from_dict, parse_override

__all__ = ["ENV_OVERRIDES", "JobConfig", "apply_overrides", "from_dict", "load_job_config", "parse_override"]
