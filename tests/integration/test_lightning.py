"""examples/lightning_train.py, an ordinary Lightning script with ElasticStrategy, under real faults.

- plain ``torchrun --rdzv-backend=etcd3`` agents (the script as torchrun's entry, no fork server): a kill -9
  of a node and a join;
- ``elastic-train local --entry`` with the fork server preloading Lightning: a kill and a join.

Both: exit 0, exactly-once from the sampler's audit, at most one step redone per fault (resumed from a
surviving rank's memory), and final weights equal to a fault-free world-1 run within 1e-5 (float64, no
dropout); ``num_nodes`` is left at Lightning's default. Lightning's own last.ckpt is written alongside.
Then the unsupported settings, each one clear line.
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
    made_once,
    script_env,
    wait_for_step,
)

pytestmark = pytest.mark.slow
pytest.importorskip("pytorch_lightning")
pytest.importorskip("elastic_train.rendezvous.registry")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "lightning_train.py"
#: The same script with every step slowed down by a strategy hook (so that faults land while it trains).
SLOW_SCRIPT = ROOT / "tests" / "integration" / "slow_lightning.py"
EPOCHS = 6
STEPS = EPOCHS * 15  # 240 samples, 16 per step
ARGS = ["--float64", "--epochs", str(EPOCHS), "--checkpoint-every", "10"]
#: 0.3 s per step; a group of fewer than 3 waits at step 60 to be joined (slow_lightning.py), so a joining
#: node is in before training ends, however loaded the machine.
HOLD = "0.3:60:3"


def env(**extra: str) -> dict[str, str]:
    return script_env({"ELASTIC_TRAIN_LOG_LEVEL": "warning"}, **extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same script, fault-free, as one plain process (no torchrun: a world of one); run once a session."""

    def run(ck: Path) -> None:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *ARGS, "--checkpoint", str(ck / "ck"), "--root", str(ck / "pl")],
            cwd=ck,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        last = ck / "pl" / "checkpoints" / "last.ckpt"
        assert last.exists(), "Lightning's own ModelCheckpoint wrote nothing"

    ck = made_once(tmp_path_factory, "lightning-reference", run)
    return final_weights(ck / "ck", "default", STEPS)


def test_plain_torchrun_agents_kill_and_join(
    tmp_path: Path, etcd_server: Any, reaper: Any, reference: dict[str, torch.Tensor]
) -> None:
    script = [
        str(SLOW_SCRIPT),
        HOLD,
        *ARGS,
        "--checkpoint",
        str(tmp_path / "ck"),
        "--root",
        str(tmp_path / "pl"),
    ]
    job = TorchrunAgents(tmp_path, etcd_server.endpoint, reaper, "lightning", script, env(), step_timeout=300)
    for _ in range(3):
        job.start()
    job.wait_step(3, 5)
    job.kill(job.procs[2])
    shrunk = job.wait_step(2, 1)
    job.start()
    job.wait_step(3, shrunk["step"] + 1)
    job.wait_all(job.procs[:2] + job.procs[3:], timeout=400)

    assert_resumed_once_each(read_events(str(job.events)), STEPS, tmp_path / "audit", min_faults=2)
    assert_same_weights(final_weights(tmp_path / "ck", "lightning", STEPS), reference, torch.float64)
    assert (tmp_path / "pl" / "checkpoints" / "last.ckpt").exists()
    verify = cli("ckpt", "verify", str(tmp_path / "ck" / "lightning"))  # the project's format
    assert verify.returncode == 0 and f"step-{STEPS:08d}" in verify.stdout, verify.stdout + verify.stderr


def test_local_entry_kill_and_join(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    summary_path = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--kill-node", "1@step=10", "--add-node", "@step=20", "--workdir", str(tmp_path / "work"),
        "--audit", str(tmp_path / "audit"), "--summary", str(summary_path), "--timeout", "500",
        "--preload", "elastic_train.lightning",
        "--entry", str(SLOW_SCRIPT), HOLD, *ARGS,
        "--checkpoint", str(tmp_path / "ck"), "--root", str(tmp_path / "pl"),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    summary = json.loads(summary_path.read_text())
    assert_local_kill_and_join(summary, STEPS)
    assert "exactly-once: OK" in proc.stdout
    assert_same_weights(final_weights(tmp_path / "ck", summary["run_id"], STEPS), reference, torch.float64)


UNSUPPORTED = """
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
    trainer = pl.Trainer(strategy=ElasticStrategy(checkpoint=sys.argv[1]), accelerator="cpu", devices=1,
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, **trainer_args)
    trainer.fit(model, loader or DataLoader(data, batch_size=8))

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


def test_unsupported_settings_are_one_clear_line_each(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(UNSUPPORTED)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ck")],
        cwd=tmp_path,
        env=env(ELASTIC_TRAIN_LOG_LEVEL="error"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    assert "several optimizers" in found.get("optimizers", ""), proc.stdout + proc.stderr[-2000:]
    assert "manual optimization" in found.get("manual", ""), proc.stdout
    assert "accumulate_grad_batches=2" in found.get("accumulate", ""), proc.stdout
    assert "batch_sampler" in found.get("batch_sampler", ""), proc.stdout
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "train.py: error: rank 0: Trainer(accumulate_grad_batches=4) is not supported" in proc.stderr


PROBE = """
import sys, time
before = "pytorch_lightning" in sys.modules
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


def test_sigterm_ends_a_training_worker_at_once(tmp_path: Path, reaper: Any) -> None:
    """torchrun stops workers with SIGTERM: the worker ends by it, without Lightning's handler (which
    broadcasts from inside the handler and then lets the script exit 0 as if training were done)."""
    events = tmp_path / "events.jsonl"
    proc = reaper.popen(
        [
            sys.executable,
            str(SLOW_SCRIPT),
            "0.3",
            *ARGS,
            "--checkpoint",
            str(tmp_path / "ck"),
            "--root",
            str(tmp_path / "pl"),
        ],
        cwd=tmp_path,
        env=env(ELASTIC_TRAIN_EVENTS=str(events)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(events, 1, 3, 180.0, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert not any(e["event"] == "done" for e in read_events(str(events)))
