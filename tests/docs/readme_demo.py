"""README's demo output, from a real run: ``make readme-demo`` runs the demo and this script writes its output
(the fault lines and the summary; the per-step lines left out) between README's readme-demo markers.

    python tests/docs/readme_demo.py OUTPUT_FILE README.md

It refuses (one line, exit 1) an output that lacks what the demo prints when it works: each fault injected,
the job resumed from memory and training again, the summary, the fault table and the exactly-once verdict.
tests/docs/test_readme_demo.py checks README's block against the same structure.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BEGIN = "<!-- readme-demo: begin (written by make readme-demo from a real run; do not edit) -->"
END = "<!-- readme-demo: end -->"

_STEP_LINE = re.compile(r"^step\s+\d+ \|")
_T = r"\d+\.\d+s"

#: The demo's faults (Makefile DEMO_ARGS) and, in order, the lines a working demo prints.
FAULTS = ("kill-node 1@step=30", "add-node @step=60")
STRUCTURE: tuple[tuple[str, str], ...] = (
    *(
        line
        for label, world in zip(FAULTS, (2, 3), strict=True)
        for line in (
            (f"{label} injected", rf"!! {re.escape(label)}: injected after step \d+ \(round \d+\)"),
            (
                f"{label} resumed from memory",
                rf"resumed round \d+ at world size {world} from step \d+ \(memory\)",
            ),
            (
                f"{label} training again",
                rf"{re.escape(label)}: training again at world size {world} after {_T}, \d+ step\(s\) redone",
            ),
        )
    ),
    (
        "summary",
        rf"run demo-[\da-f-]+: finished (\d+)/\1 steps in [\d.]+s, first step after {_T}, final loss [\d.]+",
    ),
    ("world-size timeline", r"world size: 3@step1 -> 2@step\d+ -> 3@step\d+"),
    ("fault table", r"fault\s+detected\s+resumed\s+world\s+redone\s+source"),
    *(
        (f"{label} row", rf"{re.escape(label)}\s+({_T}|-)\s+{_T}\s+{world}\s+\d+\s+memory")
        for label, world in zip(FAULTS, (2, 3), strict=True)
    ),
    ("exactly-once verdict", r"exactly-once: OK \(\d+ steps, \d+ samples checked\)"),
)


def demo_lines(output: str) -> list[str]:
    """What README shows of a demo's output: everything but the per-step lines, blank edges trimmed."""
    lines = [ln.rstrip() for ln in output.splitlines() if not _STEP_LINE.match(ln)]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return lines


def structure_problems(lines: list[str]) -> list[str]:
    """What of :data:`STRUCTURE` the lines lack (each kind matched whole, in order)."""
    missing = []
    pos = 0
    stripped = [ln.strip() for ln in lines]
    for what, pattern in STRUCTURE:
        rx = re.compile(pattern)
        found = next((n for n in range(pos, len(stripped)) if rx.fullmatch(stripped[n])), None)
        if found is None:
            missing.append(what)
        else:
            pos = found + 1
    return missing


def readme_block(readme: str) -> list[str]:
    """The lines of the fenced block between the markers (ValueError when markers or fence are missing)."""
    if BEGIN not in readme or END not in readme:
        raise ValueError("README.md has no readme-demo markers")
    inner = readme.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()
    if len(inner) < 2 or inner[0] != "```text" or inner[-1] != "```":
        raise ValueError("README.md's readme-demo markers do not hold one ```text block")
    return inner[1:-1]


def rewrite(readme: str, lines: list[str]) -> str:
    """README with the block between the markers replaced by ``lines``."""
    head, rest = readme.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return head + BEGIN + "\n```text\n" + "\n".join(lines) + "\n```\n" + END + tail


def main(argv: list[str]) -> int:
    output, readme_path = Path(argv[0]), Path(argv[1])
    lines = demo_lines(output.read_text(encoding="utf-8", errors="replace"))
    missing = structure_problems(lines)
    if missing:
        sys.stderr.write(
            f"readme-demo: the demo's output lacks {', '.join(missing)}; README.md left as it is\n"
        )
        return 1
    readme_path.write_text(rewrite(readme_path.read_text(encoding="utf-8"), lines), encoding="utf-8")
    print(f"readme-demo: {readme_path} now shows this run ({len(lines)} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
