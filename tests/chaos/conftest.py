"""Chaos suite options: ``--chaos-seeds N`` (seeds 0..N-1) or ``--chaos-seeds 3,7,11``; a table at the end."""

from __future__ import annotations

import json
from typing import Any

import pytest

#: Seeds run by a plain ``make test`` (CI): seed 0; ``make chaos SEEDS=20`` runs seeds 0..19.
DEFAULT_SEEDS = "1"

RESULTS_KEY = pytest.StashKey[list[dict[str, Any]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--chaos-seeds", default=DEFAULT_SEEDS, help="N (seeds 0..N-1) or a comma list")
    parser.addoption("--chaos-json", default=None, help="also write every run's faults and invariants here")
    parser.addoption("--chaos-md", default=None, help="also write the table as a markdown report here")


def seeds_from(text: str) -> list[int]:
    if "," in text:
        return [int(s) for s in text.split(",") if s.strip()]
    return list(range(int(text)))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "chaos_seed" in metafunc.fixturenames:
        metafunc.parametrize("chaos_seed", seeds_from(metafunc.config.getoption("--chaos-seeds")))


@pytest.fixture
def chaos_results(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Where each chaos run records its faults and invariant results for the closing table."""
    return request.config.stash.setdefault(RESULTS_KEY, [])


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    results = config.stash.get(RESULTS_KEY, [])
    if not results:
        return
    from tests.chaos.report import render

    terminalreporter.write_sep("=", "chaos summary")
    terminalreporter.write_line(render(results))
    path = config.getoption("--chaos-json")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    md = config.getoption("--chaos-md")
    if md:
        from tests.chaos.report import markdown

        with open(md, "w", encoding="utf-8") as f:
            f.write(markdown(results, command=" ".join(["pytest", *config.invocation_params.args])))
