"""Write tests/durations.json, the known-slow tests tests/conftest.py deals out first, from a JUnit report.

    python -m pytest -n 3 --dist worksteal --junitxml=/tmp/junit.xml
    python tests/durations.py /tmp/junit.xml [--min-seconds 5]

Each test's time is setup, call and teardown together (what its worker spends on it), rounded to a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

OUT = Path(__file__).resolve().parent / "durations.json"


def nodeid(case: ET.Element) -> str:
    """The pytest node id of a JUnit ``testcase`` (``classname`` is the dotted path, plus any class)."""
    parts = case.get("classname", "").split(".")
    name = case.get("name", "")
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if (OUT.parent.parent / path).is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    raise ValueError(f"no test file for {case.get('classname')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit", help="the --junitxml report of a whole-suite run")
    p.add_argument("--min-seconds", type=float, default=5.0, help="slower tests than this are listed")
    args = p.parse_args(argv)
    cases = ET.parse(args.junit).getroot().iter("testcase")
    known = {nodeid(c): round(float(c.get("time", 0))) for c in cases}
    slow = {k: v for k, v in sorted(known.items(), key=lambda kv: -kv[1]) if v >= args.min_seconds}
    OUT.write_text(json.dumps(slow, indent=0) + "\n")
    print(f"{len(slow)} tests of {len(known)} take {args.min_seconds:g} s or more: {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
