"""README's demo output is a run's, written by ``make readme-demo`` (tests/docs/readme_demo.py): it has the
structure a working demo prints, whatever its numbers."""

from __future__ import annotations

import pytest

from tests.docs.doccmds import ROOT
from tests.docs.readme_demo import BEGIN, END, demo_lines, readme_block, rewrite, structure_problems

RUN = """etcd 3.5.1 on 127.0.0.1:34795; run id demo-20261204-101224
step     1 | world 3 | round 1 | loss 3.4000 | 900 samples/s
!! kill-node 1@step=30: injected after step 101 (round 1)
   kill-node 1@step=30: rendezvous reacted after 0.17s (running, round 2)
   resumed round 2 at world size 2 from step 101 (memory)
   kill-node 1@step=30: training again at world size 2 after 0.27s, 0 step(s) redone
!! add-node @step=60: injected after step 201 (round 2)
   resumed round 3 at world size 3 from step 398 (memory)
   add-node @step=60: training again at world size 3 after 7.32s, 0 step(s) redone
step   800 | world 3 | round 3 | loss 0.3294 | 2,000 samples/s

run demo-20261204-101224: finished 800/800 steps in 33.2s, first step after 7.64s, final loss 0.3294
world size: 3@step1 -> 2@step102 -> 3@step399

fault                     detected   resumed  world  redone  source
-------------------------------------------------------------------
kill-node 1@step=30          0.17s     0.27s      2       0  memory
add-node @step=60                -     7.32s      3       0  memory

exactly-once: OK (800 steps, 38362 samples checked)
"""


def test_readme_shows_a_whole_demo_run() -> None:
    lines = readme_block((ROOT / "README.md").read_text(encoding="utf-8"))
    assert not structure_problems(lines), (
        f"README's demo output lacks {structure_problems(lines)}: make readme-demo"
    )
    assert not any(line.startswith("step ") for line in lines)


def test_a_run_is_written_without_its_step_lines() -> None:
    lines = demo_lines(RUN)
    assert structure_problems(lines) == []
    assert "step     1" not in "\n".join(lines)
    readme = f"intro\n{BEGIN}\n```text\nold\n```\n{END}\nrest\n"
    assert readme_block(rewrite(readme, lines)) == lines
    assert rewrite(readme, lines).endswith(f"{END}\nrest\n")


@pytest.mark.parametrize(
    ("drop", "missing"),
    [
        ("resumed round 2", "kill-node 1@step=30 resumed from memory"),
        ("exactly-once: OK", "exactly-once verdict"),
        ("add-node @step=60                -", "add-node @step=60 row"),
    ],
)
def test_a_run_that_did_not_work_is_refused(drop: str, missing: str) -> None:
    lines = [ln for ln in demo_lines(RUN) if drop not in ln]
    assert missing in structure_problems(lines)


def test_a_demo_that_failed_or_repeated_steps_is_refused() -> None:
    assert "summary" in structure_problems(demo_lines(RUN.replace("finished 800/800", "FAILED 640/800")))
    assert "exactly-once verdict" in structure_problems(demo_lines(RUN.replace("OK (800", "VIOLATED (800")))
