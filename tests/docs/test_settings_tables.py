"""The settings the guides list are the ones the config dataclasses have, with their defaults (training.md's
table is checked by tests/unit/test_worker.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from elastic_train.checkpoint.config import CheckpointConfig
from elastic_train.rendezvous.config import RendezvousConfig
from elastic_train.straggler.config import StragglerConfig
from tests.docs.doccmds import ROOT


def section(page: str, heading: str) -> str:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert heading in text, f"docs/{page} lost its section {heading!r}"
    return text.split(heading, 1)[1].split("\n## ", 1)[0]


def shown(value: Any) -> str:
    """A default as the tables write it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def table_rows(text: str) -> dict[str, str]:
    """``key -> default`` of a settings table, rows like ``| `a` / `b` | 3 / 0 | ... |`` split in two."""
    rows: dict[str, str] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`"):
            continue
        keys = [k.strip().strip("`") for k in cells[0].split(" / ")]
        defaults = [d.strip().strip("`") for d in cells[1].split(" / ")]
        if len(defaults) != len(keys):  # one default for all, such as `lease_ttl` / 3
            defaults = [cells[1]] * len(keys)
        rows.update(zip(keys, defaults, strict=True))
    return rows


def test_checkpoints_md_lists_every_checkpoint_setting_with_its_default() -> None:
    rows = table_rows(section("checkpoints.md", "## Settings (`checkpoint:` in job.yaml)"))
    expected = {}
    for f in dataclasses.fields(CheckpointConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        expected[f.name] = shown(default)
    assert rows == expected


def test_rendezvous_md_names_every_rendezvous_setting() -> None:
    text = section("rendezvous.md", "## Settings")
    missing = [
        f.name
        for f in dataclasses.fields(RendezvousConfig)
        if f"`{f.name}`" not in text and not (f.name == "tls" and "`tls:" in text)
    ]
    assert not missing, f"docs/rendezvous.md's Settings do not name {missing}"
    rows = table_rows(text)
    for name in ("lease_ttl", "settle", "failure_budget", "identity_wait", "connect_timeout", "rpc_timeout"):
        default = getattr(RendezvousConfig(), name)
        assert rows[name].split()[0] == shown(default), (name, rows[name], default)


def test_stragglers_md_lists_every_slow_node_setting_with_its_default() -> None:
    rows = table_rows(section("stragglers.md", "## Settings (`rendezvous.straggler:` in job.yaml)"))
    expected = {f.name: shown(f.default) for f in dataclasses.fields(StragglerConfig)}
    assert rows == expected
