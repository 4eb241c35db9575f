"""examples/lightning_train.py, an ordinary Lightning script with ElasticStrategy, run as its docs show it.

- ``python examples/lightning_train.py``, as shipped: stopped by SIGTERM at once mid-run, then run again to
  the end from its memory snapshot; and with ``--float64``, the fault-free reference of the runs below;
- ``elastic-train local ... --entry examples/lightning_train.py`` (the docs' command, ``--epochs`` shrunk): a
  kill -9 of a node and a join, each resumed from a surviving rank's memory with at most one step redone,
  exactly-once from the sampler's audit;
- plain ``torchrun --rdzv-backend=etcd3`` agents running ``examples/lightning_train.py --float64``: a kill
  and a join, the same checks, and final weights equal to the reference within 1e-5;
- a script on ``pytorch_lightning`` (the other namespace) trains, and each unsupported setting is one line.

The runs with faults keep the script and its command line as documented; the test environment adds the hold
gate of tests/instrument/sitecustomize.py, which keeps a group at a step until a fault has landed or a joining
node is in, however loaded the machine.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic_train.train.events import read_events
from tests.helpers import (
    TorchrunAgents,
    assert_local_kill_and_join,
    assert_resumed_once_each,
    assert_same_weights,
    cli,
    final_weights,
    gated,
    made_once,
    script_env,
    wait_for_step,
)

pytestmark = pytest.mark.slow
pytest.importorskip("lightning")
pytest.importorskip("pytorch_lightning")
pytest.importorskip("elastic_train.rendezvous.registry")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "lightning_train.py")
#: The example's length: 4 epochs of 240 samples, 16 per step.
STEPS = 60
#: ``--epochs`` of the local run (the docs' command trains 300, so that a node joining unaided is in before
#: the end; here the gate holds the shrunk group for it).
LOCAL_EPOCHS = 8


def env(**extra: str) -> dict[str, str]:
    return script_env({"ELASTIC_TRAIN_LOG_LEVEL": "warning"}, **extra)


def run_example(cwd: Path, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    """``python examples/lightning_train.py ARGS`` in ``cwd`` (a world of one)."""
    cmd = [sys.executable, SCRIPT, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env(**extra), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """``python examples/lightning_train.py --float64``, fault-free, at a world of one; run once a session."""
    ck = made_once(tmp_path_factory, "lightning-reference", lambda d: run_example(d, "--float64"))
    assert (ck / "lightning_logs" / "checkpoints" / "last.ckpt").exists(), "Lightning's own checkpoint"
    return final_weights(ck / "checkpoints", "default", STEPS)


def test_a_world_of_one_stops_at_sigterm_and_resumes(tmp_path: Path, reaper: Any) -> None:
    """torchrun stops workers with SIGTERM: the worker ends by it at once, without Lightning's handler (which
    broadcasts from inside the handler and then lets the script exit 0 as if training were done); the same
    command run again trains on from the stopped run's memory snapshot to the end, in float32 as shipped."""
    gate, events = tmp_path / "gate", tmp_path / "events.jsonl"
    gate.write_text("1 13")  # held at step 13, so that the signal lands mid-run
    proc = reaper.popen(
        [sys.executable, SCRIPT],
        cwd=tmp_path,
        env=gated(env(ELASTIC_TRAIN_EVENTS=str(events)), gate),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(events, 1, 12, 180.0, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert not any(e["event"] == "done" for e in read_events(str(events)))

    run_example(tmp_path, ELASTIC_TRAIN_EVENTS=str(events))  # python examples/lightning_train.py
    resumed = [e for e in read_events(str(events)) if e["event"] == "resumed"]
    assert [(e["source"], e["from_step"]) for e in resumed] == [("memory", 12)], resumed
    weights = final_weights(tmp_path / "checkpoints", "default", STEPS)
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert (tmp_path / "lightning_logs" / "checkpoints" / "last.ckpt").exists()


def test_local_entry_kill_and_join(tmp_path: Path) -> None:
    """The docs' ``elastic-train local`` command, as written but for ``--epochs``."""
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "4",
        "--kill-node", "1@step=30", "--add-node", "@step=60", "--summary", "run.json",
        "--preload", "elastic_train.lightning", "--entry", SCRIPT, "--epochs", str(LOCAL_EPOCHS),
    ]  # fmt: skip
    gate = tmp_path / "gate"
    gate.write_text("3 40\n2 76")  # the kill lands before step 40; at world 2 the job waits for the joiner
    variables = gated(env(), gate)
    proc = subprocess.run(cmd, cwd=tmp_path, env=variables, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    steps = LOCAL_EPOCHS * 15
    summary = json.loads((tmp_path / "run.json").read_text())
    assert_local_kill_and_join(summary, steps)
    assert "exactly-once: OK" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    final = final_weights(tmp_path / "checkpoints", summary["run_id"], steps)
    assert {t.dtype for t in final.values()} == {torch.float32}
    assert (tmp_path / "lightning_logs" / "checkpoints" / "last.ckpt").exists()


@pytest.mark.long
def test_plain_torchrun_agents_kill_and_join(
    tmp_path: Path, etcd_server: Any, reaper: Any, reference: dict[str, torch.Tensor]
) -> None:
    """Each node: the docs' ``torchrun --nnodes=2:4 ... examples/lightning_train.py --float64``."""
    gate = tmp_path / "gate"
    script, variables = [SCRIPT, "--float64"], gated(env(), gate)
    job = TorchrunAgents(tmp_path, etcd_server.endpoint, reaper, "job-42", script, variables, rdzv_conf=None)
    gate.write_text("3 31\n2 46")  # the kill lands by step 31; at world 2 the job waits for the joiner
    for _ in range(3):
        job.start("2:4")
    job.wait_step(3, 5)
    job.kill(job.procs[2])
    shrunk = job.wait_step(2, 1)
    job.start("2:4")
    job.wait_step(3, shrunk["step"] + 1)
    job.wait_all(job.procs[:2] + job.procs[3:], timeout=180)

    assert_resumed_once_each(read_events(str(job.events)), STEPS, tmp_path / "audit", min_faults=2)
    assert_same_weights(final_weights(tmp_path / "checkpoints", "job-42", STEPS), reference, torch.float64)
    assert (tmp_path / "lightning_logs" / "checkpoints" / "last.ckpt").exists()
    verify = cli("ckpt", "verify", str(tmp_path / "checkpoints" / "job-42"))  # the project's format
    assert verify.returncode == 0 and f"step-{STEPS:08d}" in verify.stdout, verify.stdout + verify.stderr


PYTORCH_LIGHTNING = """
import sys, torch, pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
from elastic_train.lightning import ElasticStrategy, LightningUnsupported

data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))

class Net(pl.LightningModule):
    def __init__(self, optimizers=1, manual=False):
        super().__init__()
        self.layer, self.n, self.automatic_optimization = torch.nn.Linear(4, 1), optimizers, not manual
    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
    def configure_optimizers(self):
        opts = [torch.optim.SGD(self.parameters(), lr=0.1) for _ in range(self.n)]
        return opts[0] if self.n == 1 else opts

def fit(model, loader=None, **trainer_args):
    strategy = ElasticStrategy(checkpoint=sys.argv[1])
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_args)
    trainer.fit(model, loader or DataLoader(data, batch_size=8))
    return strategy

strategy = fit(Net())
print(f"trained: {type(strategy).namespace} step {strategy.sampler.step}")
cases = {
    "optimizers": lambda: fit(Net(optimizers=2, manual=True)),  # Lightning needs manual optimization for 2
    "manual": lambda: fit(Net(manual=True)),
    "accumulate": lambda: fit(Net(), accumulate_grad_batches=2),
    # (with Lightning's own sampler injection on, Lightning refuses such a loader itself, first)
    "batch_sampler": lambda: fit(
        Net(), DataLoader(data, batch_sampler=[[0, 1], [2, 3]]), use_distributed_sampler=False
    ),
}
for name, case in cases.items():
    try:
        case()
    except LightningUnsupported as exc:
        print(f"{name}: {exc}")
fit(Net(), accumulate_grad_batches=4)  # uncaught: the one line of elastic_train.init's hook
"""


def test_a_pytorch_lightning_script_trains_and_unsupported_settings_are_one_line_each(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(PYTORCH_LIGHTNING)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck")],
        cwd=tmp_path,
        env=env(ELASTIC_TRAIN_LOG_LEVEL="error"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    found = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert found.get("trained") == "pytorch_lightning step 2", proc.stdout + proc.stderr[-2000:]
    assert "several optimizers" in found.get("optimizers", ""), proc.stdout
    assert "manual optimization" in found.get("manual", ""), proc.stdout
    assert "accumulate_grad_batches=2" in found.get("accumulate", ""), proc.stdout
    assert "batch_sampler" in found.get("batch_sampler", ""), proc.stdout
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "train.py: error: rank 0: Trainer(accumulate_grad_batches=4) is not supported" in proc.stderr
    assert final_weights(tmp_path / "ck", "default", 2)


PROBE = """
import sys, time
before = "lightning.pytorch" in sys.modules
t = time.perf_counter()
import elastic_train.lightning
print(f"preloaded={before} import_s={time.perf_counter() - t:.3f}")
"""


def test_fork_server_preloads_lightning(tmp_path: Path, reaper: Any) -> None:
    """``--preload``: a worker forked from the server finds Lightning imported; a bad name is refused."""
    from elastic_train.worker.forkserver import ENV_PID, ENV_SOCKET

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    sock = str(tmp_path / "fs.sock")
    server = reaper.popen(
        [
            sys.executable,
            "-m",
            "elastic_train.worker.forkserver",
            "--socket",
            sock,
            "--preload",
            "elastic_train.lightning,no_such_module_here",
        ]
    )
    variables = env(**{ENV_SOCKET: sock, ENV_PID: str(server.pid)})
    for _ in range(2):  # every fork gets it
        proc = subprocess.run(
            [sys.executable, "-m", "elastic_train.worker.standin", str(script)],
            env=variables,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "fork server unavailable" not in proc.stderr
        assert proc.stdout.startswith("preloaded=True"), proc.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "elastic_train", "run", "--preload", "not a module", "--entry", str(script)],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].endswith("--preload: 'not a module' is not a module name")
