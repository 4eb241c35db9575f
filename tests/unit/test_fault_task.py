"""tests/fault_task.py, the task torchrun tests crash workers with: it must crash exactly where planned."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fault_task import FAULT_EXIT_CODE, PlannedFault, held, parse_faults, planned_steps

ROOT = Path(__file__).resolve().parents[2]

#: Builds the task as a worker of rank 1 in its second generation would, and trains it step by step the way
#: the loop does (optimizer step, then scheduler step), printing each step done.
TRAIN = """
import torch
from tests.fault_task import build
task = build(faults="1@3:1", n_samples=16)
for step in range(1, 6):
    loss = task.loss_fn(task.model, task.make_batch(list(range(4)))).sum()
    loss.backward()
    task.optimizer.step()
    task.optimizer.zero_grad()
    task.scheduler.step()
    print("done", step, flush=True)
"""


def test_fault_plans() -> None:
    assert parse_faults("1@7, 0@12:1") == [PlannedFault(1, 7, 0), PlannedFault(0, 12, 1)]
    with pytest.raises(ValueError, match="RANK@STEP"):
        parse_faults("1-7")
    assert planned_steps("1@7,1@9:1", rank=0, restart_count=0) == set()
    assert planned_steps("1@7,1@9:1", rank=1, restart_count=1) == {9}
    assert planned_steps("", rank=0, restart_count=0) == set()


def train(**environ: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **environ}
    return subprocess.run([sys.executable, "-c", TRAIN], env=env, capture_output=True, text=True, timeout=120)


def test_the_planned_rank_and_generation_exits_abruptly_before_the_planned_step() -> None:
    proc = train(RANK="1", WORLD_SIZE="2", TORCHELASTIC_RESTART_COUNT="1")
    assert proc.returncode == FAULT_EXIT_CODE, proc.stderr
    assert proc.stdout.split() == ["done", "1", "done", "2"]
    assert "planned fault: rank 1 exits at step 3" in proc.stderr


@pytest.mark.parametrize("environ", [{"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "1"},
                                     {"RANK": "1", "WORLD_SIZE": "2"}])  # fmt: skip
def test_other_ranks_and_generations_train_on(environ: dict[str, str]) -> None:
    proc = train(**environ)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["done", "5"]


def test_step_delay_slows_every_step_and_changes_no_number() -> None:
    import time

    import torch

    from tests.fault_task import build

    def three_steps(**args: float) -> tuple[float, list[torch.Tensor]]:
        torch.manual_seed(0)
        task = build(n_samples=16, **args)
        started = time.perf_counter()
        for _ in range(3):
            task.loss_fn(task.model, task.make_batch(list(range(4)))).sum().backward()
            task.optimizer.step()
            task.optimizer.zero_grad()
            assert task.scheduler is not None
            task.scheduler.step()
        return time.perf_counter() - started, [p.detach().clone() for p in task.model.parameters()]

    slow, slow_weights = three_steps(step_delay=0.1)
    _, weights = three_steps()
    assert slow >= 0.3
    assert all(torch.equal(a, b) for a, b in zip(slow_weights, weights, strict=True))


def test_the_hold_gate_holds_only_its_world_size_past_its_step(tmp_path: Path) -> None:
    gate = tmp_path / "hold"
    assert not held(str(gate), world_size=2, step=99)  # no gate
    gate.write_text("2 50")
    assert held(str(gate), world_size=2, step=51)
    assert not held(str(gate), world_size=2, step=50)
    assert not held(str(gate), world_size=3, step=51)
    gate.write_text("2")  # being written: not a gate yet
    assert not held(str(gate), world_size=2, step=51)
