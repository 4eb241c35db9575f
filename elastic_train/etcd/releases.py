"""Which etcd releases a job's etcd should run: etcd's own production minimum per minor version.

Older patch releases of 3.4 and 3.5 lose data in crashes (docs/operating.md, *Which etcd*): a single-member
etcd before 3.5.5 / 3.4.21 can answer a write before it is in its log (etcd issue #14370), and 3.5.0-3.5.2
killed under load can come back with a committed transaction missing on some members.
"""

from __future__ import annotations

import re

#: etcd's minimum recommended release for production, by (major, minor) (etcd's CHANGELOG).
PRODUCTION_MINIMUM: dict[tuple[int, int], tuple[int, int, int]] = {(3, 4): (3, 4, 22), (3, 5): (3, 5, 6)}

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


def below_production_minimum(version: str) -> str | None:
    """The minimum release of ``version``'s line when ``version`` is older (``"3.5.6"`` for ``"3.5.1"``);
    None when it is not, or when the line or the text is not one this module knows."""
    m = _VERSION.match(version.strip())
    if not m:
        return None
    major, minor, patch = (int(g) for g in m.groups())
    minimum = PRODUCTION_MINIMUM.get((major, minor))
    if minimum is None or (major, minor, patch) >= minimum:
        return None
    return ".".join(map(str, minimum))


def release_warning(version: str, where: str) -> str | None:
    """One line for an operator when the etcd at ``where`` runs a release below the production minimum."""
    minimum = below_production_minimum(version)
    if minimum is None:
        return None
    return (
        f"etcd {version} at {where} is older than {minimum}, etcd's minimum for production: it can lose "
        "acknowledged writes in a crash (docs/operating.md, Which etcd)"
    )
