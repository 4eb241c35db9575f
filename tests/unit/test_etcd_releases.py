"""etcd releases below etcd's production minimum: which, and the line an operator gets."""

from __future__ import annotations

import pytest

from elastic_train.etcd.releases import below_production_minimum, release_warning


@pytest.mark.parametrize(
    ("version", "minimum"),
    [
        ("3.5.1", "3.5.6"),
        ("3.5.5", "3.5.6"),
        ("v3.5.0", "3.5.6"),
        ("3.5.6", None),
        ("3.5.21", None),
        ("3.4.20", "3.4.22"),
        ("3.4.22", None),
        ("3.4.23", None),
        ("3.6.0", None),  # a line this table does not know: nothing claimed
        ("3.3.27", None),
        ("3.5.1-rc.0", "3.5.6"),
        ("", None),
        ("not a version", None),
    ],
)
def test_below_production_minimum(version: str, minimum: str | None) -> None:
    assert below_production_minimum(version) == minimum


def test_the_warning_names_the_release_the_member_and_where_to_read_more() -> None:
    line = release_warning("3.5.1", "127.0.0.1:2379")
    assert line is not None and "\n" not in line
    assert line.startswith("etcd 3.5.1 at 127.0.0.1:2379 is older than 3.5.6")
    assert "Which etcd" in line
    assert release_warning("3.5.21", "127.0.0.1:2379") is None
