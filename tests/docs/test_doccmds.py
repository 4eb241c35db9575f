"""The collector of documented commands (tests/docs/doccmds.py): what it makes tests of, what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.doccmds import Marker, collect, line_pattern, missing_lines, parse_marker, strip_comment


def docs(tmp_path: Path, readme: str, example: str = "") -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "examples").mkdir()
    (tmp_path / "README.md").write_text(readme)
    if example:
        (tmp_path / "examples" / "ex.py").write_text(example)
    return tmp_path


def test_each_command_of_a_bash_block_is_a_test_on_its_own_line(tmp_path: Path) -> None:
    root = docs(tmp_path, "intro\n\n```bash\nelastic-train --help   # what it does\n\npython -c pass\n```\n")
    tests, problems = collect(root)
    assert not problems
    assert [(t.id, t.steps[0].text) for t in tests] == [
        ("README.md:4", "elastic-train --help   # what it does"),
        ("README.md:6", "python -c pass"),
    ]


def test_a_marker_sets_what_the_block_needs_and_the_shrink_goes_last(tmp_path: Path) -> None:
    readme = (
        '<!-- doc-test: etcd=etcd:2379 nodes=2 shrink="--steps 20" -->\n```bash\n'
        "elastic-train run job.yaml \\\n    --endpoint etcd:2379   # on every node\n```\n"
    )
    (test,), problems = collect(docs(tmp_path, readme))
    assert not problems
    assert test.marker == Marker(etcd="etcd:2379", nodes=2, shrink="--steps 20")
    assert test.steps[0].text == "elastic-train run job.yaml --endpoint etcd:2379 --steps 20"
    assert test.steps[0].nodes == 2


def test_a_script_runs_once_up_to_every_node_then_on_each(tmp_path: Path) -> None:
    readme = (
        '<!-- doc-test: script nodes=2 shrink="--steps 5" -->\n```bash\n'
        "elastic-train etcd --port 2379 &\n# on every node:\n"
        "torchrun --nnodes=2 \\\n  -m elastic_train.worker\n```\n"
    )
    (test,), problems = collect(docs(tmp_path, readme))
    assert not problems
    assert [(s.text, s.nodes) for s in test.steps] == [
        ("elastic-train etcd --port 2379 &", 1),
        ("torchrun --nnodes=2 -m elastic_train.worker --steps 5", 2),
    ]


def test_a_console_session_checks_each_commands_output(tmp_path: Path) -> None:
    readme = "<!-- doc-test: exit=2 -->\n```console\n$ a --x\nout 1\n\n$ b \\\n  --y\n...\nlast line\n```\n"
    (test,), problems = collect(docs(tmp_path, readme))
    assert not problems
    assert [(s.text, s.expected) for s in test.steps] == [("a --x", ("out 1",)), ("b --y", ("last line",))]
    assert test.marker.exit == 2


def test_a_text_block_right_after_a_command_is_its_output(tmp_path: Path) -> None:
    (test,), problems = collect(
        docs(tmp_path, "```bash\nelastic-train --version\n```\n\n```text\nelastic-train 0.1.0\n```\n")
    )
    assert not problems and test.steps[0].expected == ("elastic-train 0.1.0",)


def test_the_same_command_in_two_places_runs_once(tmp_path: Path) -> None:
    example = '"""Run it:\n\n    python examples/ex.py --epochs 2\n"""\n'
    readme = "```bash\npython examples/ex.py --epochs 2   # a world of one\n```\n"
    (test,), problems = collect(docs(tmp_path, readme, example))
    assert not problems and test.where == ("README.md:2", "examples/ex.py:3")


def test_a_docstring_marker_sits_on_the_line_before_its_block(tmp_path: Path) -> None:
    example = (
        '"""Run it.\n\n.. doc-test: skip="needs a GPU"\n\n    python examples/ex.py --cuda\n\nAnd:\n\n'
        '    python examples/ex.py\n"""\n'
    )
    tests, problems = collect(docs(tmp_path, "no commands\n", example))
    assert not problems
    assert [(t.id, t.marker.skip) for t in tests] == [
        ("examples/ex.py:5", "needs a GPU"),
        ("examples/ex.py:9", None),
    ]


@pytest.mark.parametrize(
    ("readme", "problem"),
    [
        ("```\nelastic-train --help\n```\n", "names no language"),
        ("```text\nelastic-train --help\n```\n", "a command in a text block"),
        ('<!-- doc-test: skip="x" -->\n\nprose\n', "a doc-test marker with no block under it"),
        (
            '<!-- doc-test: shrink="--lr 1" -->\n```bash\npython t.py\n```\n',
            "not a documented way to shorten",
        ),
        ("<!-- doc-test: nodez=2 -->\n```bash\npython t.py\n```\n", "cannot read 'nodez=2'"),
        ("```bash\nelastic-train etcd &\n```\n", "runs in the background"),
        ("```bash\na\nb\n```\n```text\nout\n```\n", "an output block after several commands"),
        ("```console\nno prompt\n```\n", "a console block without a `$ ` command"),
    ],
)
def test_what_cannot_become_a_test_is_a_problem(tmp_path: Path, readme: str, problem: str) -> None:
    _, problems = collect(docs(tmp_path, readme))
    assert len(problems) == 1 and problem in problems[0].what, problems


def test_markers_are_read_strictly() -> None:
    assert parse_marker('skip="needs a Kubernetes cluster"') == Marker(skip="needs a Kubernetes cluster")
    assert parse_marker("script nodes=3 exit=1 timeout=60") == Marker(
        script=True, nodes=3, exit=1, timeout=60.0
    )
    for bad in ("nodes=0", "etcd=nohost", 'shrink="--steps x"', "script=1"):
        with pytest.raises(ValueError):
            parse_marker(bad)


def test_shown_output_matches_any_numbers_and_elisions_in_order() -> None:
    out = (
        "noise\nrun demo-20261204: finished 40/40 steps in 5.9s\nexactly-once: OK (40 steps, 1920 samples)\n"
    )
    assert missing_lines(("run demo-1: finished 800/800 steps in 35.6s", "exactly-once: OK (…)"), out) == []
    assert missing_lines(("exactly-once: OK (…)", "run demo-1: finished 1/1 steps in 1.0s"), out) == [
        "run demo-1: finished 1/1 steps in 1.0s"
    ]
    assert missing_lines(("exactly-once: VIOLATED (…)",), out) == ["exactly-once: VIOLATED (…)"]
    assert line_pattern("a  b 1").fullmatch("a b 22")
    assert not line_pattern("a b").fullmatch("a b c")


def test_a_trailing_comment_is_dropped_before_a_shrink_but_not_inside_quotes() -> None:
    assert strip_comment("python t.py --x 1   # comment") == "python t.py --x 1"
    assert strip_comment("python -c 'print(1)  # not a comment'") == "python -c 'print(1)  # not a comment'"
    assert strip_comment("echo a#b") == "echo a#b"


def test_the_checkout_has_no_problem_and_every_runnable_command_has_a_place() -> None:
    tests, problems = collect()
    assert not problems, "\n".join(map(str, problems))
    assert all(t.where and all(s.text.strip() for s in t.steps) for t in tests)


def test_a_covered_marker_names_a_test_that_exists() -> None:
    from tests.docs.doccmds import covering_test_exists, parse_marker

    this = "tests/docs/test_doccmds.py::test_a_covered_marker_names_a_test_that_exists"
    marker = parse_marker(f'covered="{this}"')
    assert marker.covered is not None and covering_test_exists(marker.covered)
    assert not covering_test_exists("tests/docs/test_doccmds.py::test_no_such_test")
    with pytest.raises(ValueError, match="covered"):
        parse_marker('covered="examples/own_loop.py"')
