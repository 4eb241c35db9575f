"""The ``--nodes MIN:MAX`` option of ``run``; the options every command shares with the worker are
:mod:`elastic_train.config.options`."""

from __future__ import annotations

from typing import Any

from elastic_train.errors import ConfigError


def parse_nodes(text: str) -> tuple[int, int]:
    """``"2:4"`` → (2, 4); ``"3"`` → (3, 3).

    Raises:
        ConfigError: not N or MIN:MAX with 1 <= MIN <= MAX.
    """
    lo, sep, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ConfigError(f"--nodes {text!r}: expected N or MIN:MAX") from None
    if not 1 <= low <= high:
        raise ConfigError(f"--nodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def node_overrides(nodes: str | None) -> dict[str, Any]:
    """``rendezvous.min_nodes``/``max_nodes`` of ``--nodes MIN:MAX`` (none without it).

    Raises:
        ConfigError: see :func:`parse_nodes`.
    """
    if not nodes:
        return {}
    low, high = parse_nodes(nodes)
    return {"rendezvous.min_nodes": low, "rendezvous.max_nodes": high}
