"""structlog set-up, done once per process at the entry point.

JSON lines when stderr is not a terminal (machines read them), a readable console renderer when it is.
Each line is one ``write``: an agent and its workers share a node's stderr (a pod's log, a file), and a line
written as its text and then its newline can be cut in two by another process's line in between.
Context such as ``run_id``, ``node``, ``rank``, ``world_size`` and ``round`` is bound with
:func:`bind_context` and appears in every later event of the process.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

import structlog

#: Environment override for the log level (``debug``, ``info``, ``warning``, ``error``).
ENV_LOG_LEVEL = "ELASTIC_TRAIN_LOG_LEVEL"
#: Environment override for the output format (``auto``, ``json``, ``console``).
ENV_LOG_FORMAT = "ELASTIC_TRAIN_LOG_FORMAT"

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("auto", "json", "console")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """How a process logs."""

    level: str = "info"
    """Lowest level printed: one of debug, info, warning, error."""
    format: str = "auto"
    """auto (console on a terminal, JSON lines otherwise), json or console."""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"level: {self.level!r} is not one of {', '.join(LEVELS)}")
        if self.format not in FORMATS:
            raise ValueError(f"format: {self.format!r} is not one of {', '.join(FORMATS)}")


def configure_logging(config: LoggingConfig | None = None, *, stream: Any = None) -> None:
    """Configure structlog (and the stdlib root logger it feeds into) for this process.

    Environment variables :data:`ENV_LOG_LEVEL` and :data:`ENV_LOG_FORMAT` override the config so that
    a launcher can steer the processes it starts.
    """
    config = config or LoggingConfig()
    level_name = os.environ.get(ENV_LOG_LEVEL, config.level).lower()
    fmt = os.environ.get(ENV_LOG_FORMAT, config.format).lower()
    if level_name not in LEVELS:
        level_name = config.level
    stream = stream or sys.stderr
    if fmt not in ("json", "console"):
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    level = getattr(logging, level_name.upper())

    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any
    if fmt == "json":
        processors.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=getattr(stream, "isatty", lambda: False)())
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=stream),  # one write a line
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(level, logging.WARNING), stream=stream, force=True)


def bind_context(**fields: Any) -> None:
    """Bind fields (run_id, node, rank, world_size, round …) to every later event of this process."""
    structlog.contextvars.bind_contextvars(**fields)


def get_logger(name: str | None = None) -> Any:
    """Return a structlog logger; ``name`` is added as the ``module`` field.

    The logger stays lazy, so configuration done later at the entry point still applies to it.
    """
    return structlog.get_logger(module=name) if name else structlog.get_logger()
