"""Exception roots shared by every subsystem.

Each subsystem defines its own family under :class:`ElasticTrainError` (``RendezvousError``,
``CheckpointError``, ``EtcdError`` …) so the CLI can turn any of them into one clear line.
"""

from __future__ import annotations


class ElasticTrainError(Exception):
    """Base of every error elastic_train raises on purpose; its message is meant for the user."""

    #: Process exit code the CLI uses for this error.
    exit_code: int = 1


class ConfigError(ElasticTrainError, ValueError):
    """A configuration value, file or command-line option is invalid (a user mistake)."""

    exit_code = 2
