"""Fixtures of the operator tests that run jobs: a live etcd, its client, and the job runner on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_train.etcd.client import Etcd, connect
from tests.operator.test_run_faults import Runs


@pytest.fixture
def runs(tmp_path: Path, etcd_server: Any, reaper: Any) -> Runs:
    """Jobs of ``elastic-train run`` (and torchrun) agents on the test's etcd, reaped at teardown."""
    return Runs(tmp_path, etcd_server.endpoint, reaper)


@pytest.fixture
def etcd(etcd_server: Any) -> Iterator[Etcd]:
    """A client of the test's etcd."""
    client = connect(etcd_server.endpoint)
    yield client
    client.close()
