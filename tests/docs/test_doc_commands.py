"""Every shell command in README.md, docs/ and the examples' docstrings runs as written (tests/docs/doccmds.py
says how a doc marks what a command needs); a command that cannot run here is SKIPPED with the doc's
reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs import sandbox
from tests.docs.doccmds import DocTest, collect, covering_test_exists, missing_lines

TESTS, PROBLEMS = collect()


def test_every_documented_command_is_collected() -> None:
    """Nothing in a doc escapes the harness: every fence names its language, no command hides in a text
    block, every marker sits on a block and reads, every shrink is a documented one."""
    assert not PROBLEMS, "\n".join(str(p) for p in PROBLEMS)


@pytest.mark.slow
@pytest.mark.parametrize(
    "doc", [pytest.param(t, id=t.id, marks=pytest.mark.timeout(t.marker.timeout + 60)) for t in TESTS]
)
def test_documented_command(doc: DocTest, tmp_path: Path) -> None:
    if doc.marker.skip:
        pytest.skip(doc.marker.skip)
    if doc.marker.covered:
        assert covering_test_exists(doc.marker.covered), (
            f"{doc.id}: the doc says {doc.marker.covered} runs this command, and there is no such test"
        )
        return
    why = sandbox.refused()
    if why:
        pytest.skip(why)
    result = sandbox.run(doc, tmp_path)
    shown = "\n".join(
        f"--- step {k}, node {n}: exit {code} after {r.seconds}s\n$ {doc.steps[k].text}\n{out[-4000:]}"
        for k, r in enumerate(result.steps)
        for n, (code, out) in enumerate(zip(r.exits, r.outputs, strict=True))
    )
    where = ", ".join(doc.where)
    assert not result.error, f"{where}: {result.error}\n{shown}"
    assert not result.timed_out, f"{where}: still running after {doc.marker.timeout:.0f}s\n{shown}"
    assert len(result.steps) == len(doc.steps), f"{where}: a step failed\n{shown}"
    for k, (step, ran) in enumerate(zip(doc.steps, result.steps, strict=True)):
        want = doc.marker.exit if k == len(doc.steps) - 1 else 0
        assert ran.exits == [want] * step.nodes, (
            f"{where}: exit status {ran.exits}, the doc expects {want}\n{shown}"
        )
        for out in ran.outputs:
            missing = missing_lines(step.expected, out)
            assert not missing, f"{where}: output lines the doc shows are missing: {missing}\n{shown}"
