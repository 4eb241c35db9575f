"""Every shell command the docs show, as the tests that run it.

Sources: README.md, docs/**/*.md and the module docstrings of examples/*.py. In Markdown a command is a line
of a fenced ``bash``/``sh`` block, or a ``$ `` line of any other fenced block (a ``console`` session: the
lines under a ``$`` command, up to the next one, are the output it shows). In a docstring it is a line of an
indented block. A line ending in ``\\`` continues on the next.

A comment right before a block tells the harness what the block needs (``<!-- doc-test: ... -->`` in
Markdown, ``.. doc-test: ...`` in a docstring; readers of the rendered page see neither)::

    skip="why"         not run here (a real cluster, a GPU, Docker): reported as SKIPPED with this reason
    etcd=HOST:PORT     a development etcd serves HOST:PORT (HOST resolves to 127.0.0.1 for the test)
    nodes=N            the command is what every node runs: N copies run at once, each must succeed
    script             the block is one shell script (``&`` allowed); with nodes=N, the lines after
                       ``# on every node:`` run on each of N nodes, the lines before once
    shrink="ARGS"      appended to the command (the node part of a script): --steps N,
                       --set train.steps=N or --epochs N, the documented ways to shorten a run
    covered="TEST"     run as written by the named test (``tests/...py::test_name``), which checks more of
                       it (faults, the audit): the harness only checks that the test exists
    exit=N             the exit status the (last) command must end with (default 0)
    timeout=S          seconds the test may take (default :data:`DEFAULT_TIMEOUT`)

Every command of a block without a marker is run as written, in a scratch directory that sees the
checkout's files, and must exit 0; a ``text`` block right after a one-command block is that command's
output: its lines must appear, in order, in what the command printed (digits stand for any number, ``…``
for anything). The same command shown twice (same marker) runs once. Whatever cannot be collected (a
fence without a language, a command in a ``text`` block, a marker on no block, a shrink that is not one
of the documented ones) is a :class:`Problem`, which fails the suite.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Seconds a documented command may take unless its marker says otherwise.
DEFAULT_TIMEOUT = 240.0

#: Languages a fenced block may name. Shell blocks hold commands; the others hold none.
SHELL = ("bash", "sh", "shell")
LANGUAGES = (*SHELL, "console", "text", "python", "json", "yaml", "diff", "dockerfile")

#: The documented ways to shorten a run (docs/training.md: --steps, --set train.steps; examples' --epochs).
SHRINKS = re.compile(r"^(--steps \d+|--set train\.steps=\d+|--epochs \d+)$")

#: A test that runs a documented command itself: ``tests/<path>.py::<test function>``.
COVERED = re.compile(r"^tests/[\w/]+\.py::test_\w+$")


def covering_test_exists(covered: str, root: Path = ROOT) -> bool:
    """Whether the test a ``covered`` marker names is defined (a module-level ``def test_...``)."""
    path, _, name = covered.partition("::")
    try:
        tree = ast.parse((root / path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return False
    return any(isinstance(n, ast.FunctionDef) and n.name == name for n in tree.body)


#: Programs whose name at the start of a ``text`` line means a command was put where nothing runs it.
PROGRAMS = ("elastic-train", "torchrun", "python", "python3", "pip", "kubectl", "docker", "make", "etcdctl",
            "etcdutl", "pytest", "PYTHONPATH=")  # fmt: skip

#: The line of a ``script`` block that starts the part every node runs.
EVERY_NODE = "# on every node:"

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<ticks>```+)(?P<lang>[^`\s]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*doc-test:(?P<body>.*?)-->\s*$")
_RST_MARKER = re.compile(r"^\s*\.\.\s+doc-test:(?P<body>.*)$")


@dataclass(frozen=True)
class Marker:
    """What a block needs to run here (see the module docstring)."""

    skip: str | None = None
    etcd: str | None = None
    nodes: int = 1
    script: bool = False
    shrink: str | None = None
    covered: str | None = None
    exit: int = 0
    timeout: float = DEFAULT_TIMEOUT


@dataclass(frozen=True)
class Step:
    """One shell text run as a unit: a command, or a script; on ``nodes`` nodes at once."""

    text: str
    nodes: int = 1
    expected: tuple[str, ...] = ()
    """Output lines the doc shows for it."""


@dataclass(frozen=True)
class DocTest:
    """The steps of one test, run in order in one scratch directory; ``where`` lists every place shown."""

    where: tuple[str, ...]
    steps: tuple[Step, ...]
    marker: Marker = field(default_factory=Marker)

    @property
    def id(self) -> str:
        return self.where[0]

    def key(self) -> tuple[object, ...]:
        """Equal for the same commands with the same needs, wherever they are shown."""
        steps = tuple(
            (
                " ".join(" ".join(strip_comment(line) for line in s.text.splitlines()).split()),
                s.nodes,
                s.expected,
            )
            for s in self.steps
        )
        return (steps, replace(self.marker, timeout=0.0))


@dataclass(frozen=True)
class Problem:
    """Something in a doc the harness cannot turn into a test: the suite fails on it."""

    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass
class Block:
    """A fenced (Markdown) or indented (docstring) block and the marker right above it."""

    where: str
    lang: str
    lines: list[str]
    marker: Marker | None = None
    marker_text: str = ""
    output: list[str] | None = None
    """The lines of a ``text`` block that follows this one directly (its output)."""
    fenced: bool = True
    """False for a docstring's indented block, whose ``where`` is its first line."""


def parse_marker(body: str) -> Marker:
    """A marker's ``key=value`` words.

    Raises:
        ValueError: an unknown key, a bad value, or a shrink that is not a documented one.
    """
    fields: dict[str, object] = {}
    for word in shlex.split(body):
        key, eq, value = word.partition("=")
        if key == "script" and not eq:
            fields["script"] = True
        elif key in ("skip", "etcd", "shrink", "covered") and eq and value:
            fields[key] = value
        elif key in ("nodes", "exit") and eq and value.isdigit():
            fields[key] = int(value)
        elif key == "timeout" and eq:
            fields[key] = float(value)
        else:
            raise ValueError(f"doc-test marker: cannot read {word!r}")
    shrink = fields.get("shrink")
    if isinstance(shrink, str) and not SHRINKS.match(shrink):
        raise ValueError(
            f"doc-test marker: shrink={shrink!r} is not a documented way to shorten a run "
            "(--steps N, --set train.steps=N, --epochs N)"
        )
    covered = fields.get("covered")
    if isinstance(covered, str) and not COVERED.match(covered):
        raise ValueError(f"doc-test marker: covered={covered!r} is not tests/PATH.py::test_NAME")
    etcd = fields.get("etcd")
    if isinstance(etcd, str) and not re.match(r"^[A-Za-z0-9.-]+:\d+$", etcd):
        raise ValueError(f"doc-test marker: etcd={etcd!r} is not HOST:PORT")
    if fields.get("nodes") == 0:
        raise ValueError("doc-test marker: nodes must be at least 1")
    return Marker(**fields)  # type: ignore[arg-type]


def markdown_blocks(path: Path, rel: str) -> tuple[list[Block], list[Problem]]:
    """The fenced blocks of a Markdown file with their markers; a ``text`` block right after another block
    becomes that block's output."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    problems: list[Problem] = []
    pending: list[tuple[int, str]] = []  # marker lines waiting for their block
    last_end: int | None = None  # line index after the previous block's closing fence
    i = 0
    while i < len(lines):
        m = _MARKER.match(lines[i])
        if m:
            pending.append((i, m.group("body")))
            i += 1
            continue
        fence = _FENCE.match(lines[i])
        if not fence:
            if pending and lines[i].strip():
                problems.append(
                    Problem(f"{rel}:{pending[0][0] + 1}", "a doc-test marker with no block under it")
                )
                pending = []
            i += 1
            continue
        indent, ticks, lang = fence.group("indent"), fence.group("ticks"), fence.group("lang").lower()
        end = i + 1
        while end < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[end]):
            end += 1
        body = [ln[len(indent) :] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1 : end]]
        where = f"{rel}:{i + 1}"
        block = Block(where, lang, body)
        if pending:
            text = " ".join(b for _, b in pending)
            try:
                block.marker, block.marker_text = parse_marker(text), text
            except ValueError as exc:
                problems.append(Problem(where, str(exc)))
            pending = []
        if not lang:
            problems.append(
                Problem(where, f"a fenced block names no language (one of {', '.join(LANGUAGES)})")
            )
        elif lang not in LANGUAGES:
            problems.append(
                Problem(where, f"unknown block language {lang!r} (one of {', '.join(LANGUAGES)})")
            )
        adjacent = last_end is not None and all(not ln.strip() for ln in lines[last_end:i])
        if lang == "text" and adjacent and blocks and blocks[-1].lang in SHELL and block.marker is None:
            blocks[-1].output = body
        else:
            blocks.append(block)
        last_end = end + 1
        i = end + 1
    if pending:
        problems.append(Problem(f"{rel}:{pending[0][0] + 1}", "a doc-test marker with no block under it"))
    return blocks, problems


def docstring_blocks(path: Path, rel: str) -> tuple[list[Block], list[Problem]]:
    """The indented blocks of a module docstring (each is shell: examples' docstrings show how to run
    them), with the ``.. doc-test:`` marker right above each."""
    source = path.read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source), clean=False) or ""
    first = source.index('"""') if '"""' in source else 0
    offset = source[:first].count("\n")  # the docstring's first line in the file
    lines = doc.splitlines()
    blocks: list[Block] = []
    problems: list[Problem] = []
    marker: tuple[int, str] | None = None
    i = 0
    while i < len(lines):
        m = _RST_MARKER.match(lines[i])
        if m:  # consecutive marker lines are one marker
            marker = (marker[0], f"{marker[1]} {m.group('body')}") if marker else (i, m.group("body"))
            i += 1
            continue
        if lines[i].startswith("    ") and lines[i].strip():
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            body = [ln[4:] for ln in lines[i:end]]
            while body and not body[-1].strip():
                body.pop()
            where = f"{rel}:{offset + i + 1}"
            block = Block(where, "bash", body, fenced=False)
            if marker is not None:
                try:
                    block.marker, block.marker_text = parse_marker(marker[1]), marker[1]
                except ValueError as exc:
                    problems.append(Problem(where, str(exc)))
                marker = None
            blocks.append(block)
            i = end
            continue
        if marker is not None and lines[i].strip():
            problems.append(
                Problem(f"{rel}:{offset + marker[0] + 1}", "a doc-test marker with no block under it")
            )
            marker = None
        i += 1
    return blocks, problems


def logical_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(first line index, text) of each line with its ``\\`` continuations joined, blank lines dropped."""
    out: list[tuple[int, str]] = []
    current: list[str] = []
    start = 0
    for n, line in enumerate(lines):
        if not current:
            start = n
        if line.rstrip().endswith("\\"):
            current.append(line.rstrip()[:-1].rstrip())
            continue
        current.append(line.strip() if current else line.rstrip())
        text = " ".join(part.strip() for part in current).strip()
        current = []
        if text:
            out.append((start, text))
    if current:
        out.append((start, " ".join(part.strip() for part in current)))
    return out


def strip_comment(command: str) -> str:
    """The command without a trailing ``# comment`` (a ``#`` outside quotes, after a blank)."""
    quote = ""
    for n, ch in enumerate(command):
        if quote:
            if ch == quote:
                quote = ""
            elif ch == "\\" and quote == '"':
                continue
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (n == 0 or command[n - 1].isspace()):
            return command[:n].rstrip()
    return command.rstrip()


def with_shrink(command: str, shrink: str | None) -> str:
    """``command`` with the marker's shrink appended (after any trailing comment is dropped)."""
    if not shrink:
        return command
    return f"{strip_comment(command)} {shrink}"


def session(block: Block) -> list[tuple[str, tuple[str, ...]]]:
    """The ``$`` commands of a console block, each with the output lines shown under it."""
    commands: list[list[str]] = []
    outputs: list[list[str]] = []
    cont = False
    for line in block.lines:
        if cont:
            commands[-1].append(line)
        elif line.startswith("$ "):
            commands.append([line[2:]])
            outputs.append([])
        elif commands:
            outputs[-1].append(line)
            continue
        else:
            continue
        cont = line.rstrip().endswith("\\")
    return [
        (logical_lines(cmd)[0][1], tuple(expected_lines(out)))
        for cmd, out in zip(commands, outputs, strict=True)
    ]


def expected_lines(lines: list[str]) -> list[str]:
    """The lines of shown output that a run must print (blank lines and bare ``...``/``…`` dropped)."""
    return [ln.rstrip() for ln in lines if ln.strip() and ln.strip() not in ("...", "…")]


def tests_of(block: Block) -> tuple[list[DocTest], list[Problem]]:
    """The tests a block makes: one per command, or one for a script or a console session."""
    marker = block.marker or Marker()
    problems: list[Problem] = []
    has_prompt = any(ln.startswith("$ ") for ln in block.lines)
    if block.lang in SHELL:
        commands = [(n, t) for n, t in logical_lines(block.lines) if not t.startswith("#")]
        if not commands:
            return [], [Problem(block.where, "a shell block without a command")]
        if marker.script:
            test, found = script_test(block, marker)
            return [test], found
        if block.output is not None and len(commands) > 1:
            problems.append(
                Problem(block.where, "an output block after several commands (show each in a console block)")
            )
        expected = tuple(expected_lines(block.output or [])) if len(commands) == 1 else ()
        for _, text in commands if not marker.skip else ():
            if text.endswith("&"):
                problems.append(
                    Problem(block.where, f"{text!r} runs in the background: mark the block `script`")
                )
        return [
            DocTest(
                (line_of(block, n),),
                (Step(with_shrink(text, marker.shrink), marker.nodes, expected),),
                marker,
            )
            for n, text in commands
        ], problems
    if block.lang == "console" or (has_prompt and block.lang not in ("python", "json", "yaml", "diff")):
        steps = tuple(Step(cmd, 1, exp) for cmd, exp in session(block))
        if not steps:
            return [], [Problem(block.where, "a console block without a `$ ` command")]
        if marker.shrink or marker.nodes != 1 or marker.script:
            problems.append(Problem(block.where, "a console session takes no shrink, nodes or script marker"))
        return [DocTest((block.where,), steps, marker)], problems
    if block.marker is not None:
        problems.append(Problem(block.where, f"a doc-test marker on a {block.lang or 'plain'} block"))
    if block.lang == "text":
        for line in block.lines:
            word = line.strip().split(" ", 1)[0]
            if word in PROGRAMS or any(p.endswith("=") and word.startswith(p) for p in PROGRAMS):
                problems.append(
                    Problem(
                        block.where, f"a command in a text block, which nothing runs: {line.strip()[:60]!r}"
                    )
                )
                break
    return [], problems


def line_of(block: Block, n: int) -> str:
    """``file:line`` of line ``n`` of a block's body (a fence's body starts on the line after it)."""
    rel, line = block.where.rsplit(":", 1)
    return f"{rel}:{int(line) + n + (0 if block.fenced is False else 1)}"


def script_test(block: Block, marker: Marker) -> tuple[DocTest, list[Problem]]:
    """A ``script`` block as one test: the part before ``# on every node:`` once, the rest on each node."""
    lines = block.lines
    split = next((n for n, ln in enumerate(lines) if ln.strip().lower() == EVERY_NODE), None)
    before, after = ([], lines) if split is None else (lines[:split], lines[split + 1 :])
    steps: list[Step] = []
    expected = tuple(expected_lines(block.output or []))
    if any(ln.strip() and not ln.strip().startswith("#") for ln in before):
        steps.append(Step("\n".join(before), 1, () if after else expected))
    if after:
        cmds = logical_lines(after)
        last = max((n for n, t in cmds if not t.startswith("#")), default=None)
        body = list(after)
        if marker.shrink and last is not None:
            # the shrink goes on the node part's last command (its continuation lines joined)
            end = last
            while body[end].rstrip().endswith("\\"):
                end += 1
            joined = dict(cmds)[last]
            body[last : end + 1] = [with_shrink(joined, marker.shrink)]
        steps.append(Step("\n".join(body), marker.nodes, expected))
    problems = []
    if marker.shrink and not after:
        problems.append(Problem(block.where, f"a script's shrink needs a `{EVERY_NODE}` part to go on"))
    return DocTest((block.where,), tuple(steps), marker), problems


def sources(root: Path = ROOT) -> list[Path]:
    """The files whose commands are tests: README.md, docs/**/*.md, examples/*.py."""
    return [
        root / "README.md",
        *sorted((root / "docs").rglob("*.md")),
        *sorted((root / "examples").glob("*.py")),
    ]


def collect(root: Path = ROOT) -> tuple[list[DocTest], list[Problem]]:
    """Every documented command as a test (duplicates merged), and every problem found on the way."""
    tests: list[DocTest] = []
    problems: list[Problem] = []
    for path in sources(root):
        rel = str(path.relative_to(root))
        blocks, found = (docstring_blocks if path.suffix == ".py" else markdown_blocks)(path, rel)
        problems += found
        for block in blocks:
            made, found = tests_of(block)
            tests += made
            problems += found
    merged: dict[tuple[object, ...], DocTest] = {}
    for t in tests:
        k = t.key()
        if k in merged:
            merged[k] = replace(merged[k], where=merged[k].where + t.where)
        else:
            merged[k] = t
    return list(merged.values()), problems


_NUMBER = re.compile(r"\d+")


def line_pattern(expected: str) -> re.Pattern[str]:
    """A shown output line as a pattern: digits stand for any number, ``…`` for anything, spacing is free."""
    parts = []
    for piece in re.split(r"(…|\d+|\s+)", expected.strip()):
        if piece == "…":
            parts.append(".*")
        elif piece and piece.isspace():
            parts.append(r"\s+")
        elif _NUMBER.fullmatch(piece or "x"):
            parts.append(r"\d+")
        elif piece:
            parts.append(re.escape(piece))
    return re.compile("".join(parts))


def missing_lines(expected: tuple[str, ...], output: str) -> list[str]:
    """The shown lines that do not appear, in order, among the output's lines (each matched whole)."""
    actual = [ln.strip() for ln in output.splitlines()]
    missing: list[str] = []
    pos = 0
    for line in expected:
        pattern = line_pattern(line)
        found = next((n for n in range(pos, len(actual)) if pattern.fullmatch(actual[n])), None)
        if found is None:
            missing.append(line)
        else:
            pos = found + 1
    return missing
