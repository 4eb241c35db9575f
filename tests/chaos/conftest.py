"""Chaos suite options: ``--chaos-seeds N`` (seeds 0..N-1) or ``--chaos-seeds 3,7,11``; a table at the end."""

from __future__ import annotations

from typing import Any

import pytest

#: Seeds run by a plain ``make test`` (CI): seed 0; ``make chaos SEEDS=20`` runs seeds 0..19.
DEFAULT_SEEDS = "1"

RESULTS: list[dict[str, Any]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--chaos-seeds", default=DEFAULT_SEEDS, help="N (seeds 0..N-1) or a comma list")


def seeds_from(text: str) -> list[int]:
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    return list(range(int(text)))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chaos_seed" in metafunc.fixturenames:
        metafunc.parametrize("chaos_seed", seeds_from(metafunc.config.getoption("--chaos-seeds")))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not RESULTS:
        return
    from tests.chaos.report import render

    terminalreporter.write_sep("=", "chaos summary")
    terminalreporter.write_line(render(RESULTS))
