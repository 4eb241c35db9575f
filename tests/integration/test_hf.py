"""examples/hf_train.py, an ordinary Hugging Face Trainer script with ElasticTrainer, under real faults.

- plain ``torchrun --rdzv-backend=etcd3`` agents (the script as torchrun's entry, no fork server): a kill -9
  of a node and a join;
- ``elastic-train local --entry`` with the fork server preloading transformers: a kill and a join.

Both: exit 0, exactly-once from the sampler's audit, every resume from a surviving rank's memory with at most
one step redone, final weights equal to a fault-free world-1 run within 1e-5 (float64, no dropout), and
``elastic-train ckpt verify`` on the run's checkpoints; the Trainer's own checkpoints are written alongside.
Then: the Trainer's own checkpoint resumes exactly; a plain Trainer loses and repeats samples over the same
resizes (the baseline); the unsupported settings, one line each; SIGTERM ends a worker at once.
"""

from __future__ import annotations

import json
import shutil
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
pytest.importorskip("transformers")
pytest.importorskip("elastic_train.rendezvous.registry")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "hf_train.py"
#: The same script with every step slowed down by a trainer hook (so that faults land while it trains).
SLOW_SCRIPT = ROOT / "tests" / "integration" / "slow_hf.py"
EPOCHS = 2
STEPS = EPOCHS * 11  # 256 samples, 24 per step
ARGS = ["--float64", "--epochs", str(EPOCHS)]
#: 0.2 s per step; a group of fewer than 3 waits at step 14 to be joined (slow_hf.py), so a joining node is
#: in before training ends, however loaded the machine.
HOLD = "0.2:14:3"


def env(**extra: str) -> dict[str, str]:
    return script_env({"ELASTIC_TRAIN_LOG_LEVEL": "warning", "HF_HUB_OFFLINE": "1"}, **extra)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same script, fault-free, as one plain process (a world of one); run once a session. Its
    ``output_dir`` (the Trainer's checkpoints and ``elastic/default``, ours)."""

    def run(work: Path) -> None:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), *ARGS, "--output-dir", str(work / "out")],
            cwd=work,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    return made_once(tmp_path_factory, "hf-reference", run) / "out"


def reference_weights(out: Path) -> dict[str, torch.Tensor]:
    return final_weights(out / "elastic", "default", STEPS)


def assert_verified(root: Path) -> None:
    verify = cli("ckpt", "verify", str(root))  # the project's format
    assert verify.returncode == 0 and f"step-{STEPS:08d}" in verify.stdout, verify.stdout + verify.stderr


@pytest.mark.long
def test_plain_torchrun_agents_kill_and_join(
    tmp_path: Path, etcd_server: Any, reaper: Any, reference: Path
) -> None:
    out = tmp_path / "out"
    script = [str(SLOW_SCRIPT), HOLD, *ARGS, "--output-dir", str(out)]
    job = TorchrunAgents(tmp_path, etcd_server.endpoint, reaper, "hf", script, env(), step_timeout=300)
    for _ in range(3):
        job.start()
    job.wait_step(3, 4)
    job.kill(job.procs[2])
    shrunk = job.wait_step(2, 1)
    job.start()
    job.wait_step(3, shrunk["step"] + 1)
    job.wait_all(job.procs[:2] + job.procs[3:], timeout=400)

    assert_resumed_once_each(read_events(str(job.events)), STEPS, tmp_path / "audit", min_faults=2)
    weights = final_weights(out / "elastic", "hf", STEPS)
    assert_same_weights(weights, reference_weights(reference), torch.float64)
    assert (out / f"checkpoint-{STEPS}" / "trainer_state.json").exists()  # the Trainer's own, as before
    assert_verified(out / "elastic" / "hf")


def test_local_entry_kill_and_join(tmp_path: Path, reference: Path) -> None:
    summary_path, probe, out = tmp_path / "summary.json", tmp_path / "preload.txt", tmp_path / "out"
    cmd = [
        sys.executable, "-m", "elastic_train", "local",
        "--nodes", "3", "--min-nodes", "2", "--max-nodes", "3",
        "--kill-node", "1@step=5", "--add-node", "@step=10", "--workdir", str(tmp_path / "work"),
        "--audit", str(tmp_path / "audit"), "--summary", str(summary_path), "--timeout", "500",
        "--preload", "elastic_train.hf",
        "--entry", str(SLOW_SCRIPT), HOLD, *ARGS, "--output-dir", str(out),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, cwd=tmp_path, env=env(PRELOAD_PROBE=str(probe)), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    summary = json.loads(summary_path.read_text())
    assert_local_kill_and_join(summary, STEPS)
    assert "exactly-once: OK" in proc.stdout
    weights = final_weights(out / "elastic", summary["run_id"], STEPS)
    assert_same_weights(weights, reference_weights(reference), torch.float64)
    assert_verified(out / "elastic" / summary["run_id"])
    starts = probe.read_text().split()[1::2]
    assert len(starts) >= 4 and set(starts) == {"True"}, starts  # every worker forked with transformers in


def test_the_trainers_own_checkpoint_resumes_exactly(tmp_path: Path, reference: Path) -> None:
    """A run without a state of ours resumes from the Trainer's ``checkpoint-20`` (model, optimizer,
    scheduler, its global step, hence the data position) and ends where the fault-free run did."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(reference / "checkpoint-20", out / "checkpoint-20")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *ARGS, "--output-dir", str(out)],
        cwd=tmp_path,
        env=env(ELASTIC_TRAIN_EVENTS=str(tmp_path / "events.jsonl")),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [e["step"] for e in read_events(str(tmp_path / "events.jsonl")) if e["event"] == "step"]
    assert steps == [21, 22]
    assert_same_weights(reference_weights(out), reference_weights(reference), torch.float64)


def test_a_plain_trainer_loses_and_repeats_samples_on_a_resize() -> None:
    """The baseline: the plain Trainer's own data path over a kill (3 -> 2) and a join (2 -> 3), resumed from
    its save_steps checkpoints, against ElasticTrainer's sampler over the same job (hf_plain_resize.py)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "integration" / "hf_plain_resize.py")],
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, elastic = result["plain"], result["elastic"]
    assert plain["lost"] > 0 and plain["duplicated"] > 0, plain
    assert elastic["lost"] == 0 and elastic["duplicated"] == 0, elastic


MEAN_LOSS = """
import sys, torch
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments, set_seed
from elastic_train.hf import ElasticTrainer

class Waves(Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 6, generator=g, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(1, keepdim=True))
    def __len__(self): return len(self.x)
    def __getitem__(self, i): return {"x": self.x[i], "y": self.y[i]}

class Net(torch.nn.Module):  # no num_items_in_batch: its loss is the mean over the micro-batch
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    def forward(self, x, y=None):
        return {"loss": torch.nn.functional.mse_loss(self.body(x), y)}

set_seed(0)
args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=3, num_train_epochs=2,
    learning_rate=0.05, report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no",
    eval_strategy="steps", eval_steps=5, dataloader_num_workers=1, label_names=["y"])
class Timed(TrainerCallback):  # was each rank's wait for the gradient all-reduce timed?
    def on_train_end(self, args, state, control, **kwargs):
        print(f"timed={trainer.checkpointer.clock.timed}", flush=True)

trainer = ElasticTrainer(model=Net().double(), args=args, train_dataset=Waves(70), eval_dataset=Waves(20),
                         global_batch=10, callbacks=[Timed()])
trainer.train()
"""


@pytest.mark.long
def test_a_mean_loss_is_weighted_to_the_same_update_at_any_world_size(tmp_path: Path) -> None:
    """A model whose loss is the mean over its micro-batch (the Trainer divides it by the accumulation
    steps): global batch 10 at world 1 (micro-batches of 3, 3, 2, 2) and world 3 (shares of 4, 3, 3 in two
    micro-batches each) end with the same weights; evaluation and a DataLoader worker on the way. At world 3
    the Trainer's DDP model carries the timing hook (slow-node detection), which reduces as DDP's own."""
    script = tmp_path / "mean_loss.py"
    script.write_text(MEAN_LOSS)
    for world in (1, 3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        proc = subprocess.run(
            [*(cmd if world > 1 else [sys.executable]), str(script), str(tmp_path / f"w{world}")],
            cwd=tmp_path,
            env=env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        timed = [line for line in proc.stdout.splitlines() if line.startswith("timed=")]
        assert timed == [f"timed={world > 1}"] * world, proc.stdout[-2000:]  # world 1 has no DDP model
    (run_id,) = (p.name for p in (tmp_path / "w3" / "elastic").iterdir())
    weights = final_weights(tmp_path / "w3" / "elastic", run_id, 14)
    assert_same_weights(weights, final_weights(tmp_path / "w1" / "elastic", "default", 14), torch.float64)


UNSUPPORTED = """
import sys, torch
from torch.utils.data import Dataset, IterableDataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from elastic_train.hf import ElasticTrainer, HFUnsupported

class Data(Dataset):
    def __len__(self): return 16
    def __getitem__(self, i): return {"input_ids": torch.arange(8) % 16, "labels": torch.arange(8) % 16}

class Stream(IterableDataset):
    def __iter__(self): yield from (Data()[i] for i in range(16))

model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1,
                                   bos_token_id=0, eos_token_id=0))

def fit(data=None, **changes):
    args = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=2,
                             report_to="none", disable_tqdm=True, use_cpu=True, **changes)
    ElasticTrainer(model=model, args=args, train_dataset=data or Data()).train()

cases = {
    "group_by_length": lambda: fit(train_sampling_strategy="group_by_length"),
    "dataloader_drop_last": lambda: fit(dataloader_drop_last=True),
    "ignore_data_skip": lambda: fit(ignore_data_skip=True),
    "auto_find_batch_size": lambda: fit(auto_find_batch_size=True),
    "average_tokens_across_devices": lambda: fit(average_tokens_across_devices=False),
    "enable_jit_checkpoint": lambda: fit(enable_jit_checkpoint=True),
    "fsdp": lambda: fit(fsdp=True),
    "IterableDataset": lambda: fit(Stream()),
}
for name, case in cases.items():
    try:
        case()
    except HFUnsupported as exc:
        print(f"{name}: {exc}")
fit(Stream())  # uncaught: the one line of elastic_train.init's hook
"""


def test_unsupported_settings_are_one_clear_line_each(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(UNSUPPORTED)
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")],
        cwd=tmp_path,
        env=env(ELASTIC_TRAIN_LOG_LEVEL="error"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    found = dict(line.split(": ", 1) for line in proc.stdout.splitlines() if ": " in line)
    for name in (
        "group_by_length",
        "dataloader_drop_last",
        "ignore_data_skip",
        "auto_find_batch_size",
        "average_tokens_across_devices",
        "enable_jit_checkpoint",
    ):
        assert f"{name}" in found.get(name, ""), (name, proc.stdout, proc.stderr[-2000:])
    assert "FSDP" in found.get("fsdp", ""), proc.stdout
    assert "map-style dataset" in found.get("IterableDataset", ""), proc.stdout
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "train.py: error: rank 0: the training dataset is a Stream without a length" in proc.stderr


def test_sigterm_ends_a_training_worker_at_once(tmp_path: Path, reaper: Any) -> None:
    """torchrun stops workers with SIGTERM: the worker ends by it once its snapshot copy is sealed, without
    waiting on peers (the Trainer's own JIT checkpoint on SIGTERM, which would, is refused above)."""
    events = tmp_path / "events.jsonl"
    proc = reaper.popen(
        [sys.executable, str(SLOW_SCRIPT), "0.3", *ARGS, "--output-dir", str(tmp_path / "out")],
        cwd=tmp_path,
        env=env(ELASTIC_TRAIN_EVENTS=str(events)),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_for_step(events, 1, 3, 180.0, tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == -signal.SIGTERM
    assert not any(e["event"] == "done" for e in read_events(str(events)))
