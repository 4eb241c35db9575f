"""structlog set-up: JSON lines off a terminal, console on one, bound context in every event."""

from __future__ import annotations

import io
import json

import pytest
import structlog

from elastic_train.log import LoggingConfig, bind_context, configure_logging, get_logger


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _clear_context():
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()


def test_json_lines_when_not_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_TRAIN_LOG_FORMAT", raising=False)
    monkeypatch.delenv("ELASTIC_TRAIN_LOG_LEVEL", raising=False)
    out = io.StringIO()
    configure_logging(LoggingConfig(), stream=out)
    bind_context(run_id="job-1", rank=2, world_size=3)
    get_logger("t").info("checkpoint_committed", step=12, bytes=100)
    event = json.loads(out.getvalue().strip().splitlines()[-1])
    assert event["event"] == "checkpoint_committed"
    assert event | {"run_id": "job-1", "rank": 2, "world_size": 3, "step": 12, "level": "info"} == event
    assert "timestamp" in event


def test_console_on_a_tty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_TRAIN_LOG_FORMAT", raising=False)
    out = _Tty()
    configure_logging(LoggingConfig(), stream=out)
    get_logger().info("node_joined", node="n1")
    text = out.getvalue()
    assert "node_joined" in text and "n1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.strip().splitlines()[-1])


def test_level_filters_and_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setenv("ELASTIC_TRAIN_LOG_LEVEL", "warning")
    monkeypatch.setenv("ELASTIC_TRAIN_LOG_FORMAT", "json")
    configure_logging(LoggingConfig(level="debug"), stream=out)
    log = get_logger()
    log.info("hidden")
    log.warning("shown")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in lines] == ["shown"]


def test_bad_logging_config() -> None:
    with pytest.raises(ValueError, match="level: 'loud'"):
        LoggingConfig(level="loud")


class _Writes(io.StringIO):
    """A stream that records each ``write`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, s: str) -> int:
        self.calls.append(s)
        return super().write(s)


def test_each_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent and its workers share a node's stderr: a line written as its text and then its newline
    (two system calls) can have another process's line land in between, and both are lost to a parser."""
    monkeypatch.delenv("ELASTIC_TRAIN_LOG_FORMAT", raising=False)
    out = _Writes()
    configure_logging(LoggingConfig(format="json"), stream=out)
    get_logger("t").info("straggler_probe", rates={"cpu": 25436.29})
    get_logger("t").warning("straggler_flagged", node="n1", score=2.1)
    assert len(out.calls) == 2 and all(c.endswith("\n") and c.count("\n") == 1 for c in out.calls), out.calls
    assert [json.loads(c)["event"] for c in out.calls] == ["straggler_probe", "straggler_flagged"]
