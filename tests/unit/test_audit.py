"""Audit files and the exactly-once checker: redone steps count once, every violation is reported."""

from __future__ import annotations

import json
from pathlib import Path

from elastic_train.train.audit import AuditWriter, check_exactly_once, expected_steps, read_audit, write_meta
from elastic_train.train.events import EventWriter, read_events
from elastic_train.train.sampler import ElasticSampler

N, G = 23, 5


def simulate(directory: Path, schedule: list[tuple[int, int, int]]) -> None:
    """Run the sampler through ``(round, world_size, steps)`` segments; each segment resumes from the
    cursor saved one step before the previous segment ended (that step is redone)."""
    s = ElasticSampler(N, G, seed=4)
    step = 0
    saved = (s.state_dict(), 0)
    for round_, world, steps in schedule:
        s = ElasticSampler(N, G, seed=4)
        s.load_state_dict(saved[0])
        step = saved[1]
        writers = [AuditWriter(str(directory), rank=r, world_size=world, round=round_) for r in range(world)]
        for _ in range(steps):
            plans = [s.plan(world, r) for r in range(world)]
            for w, p in zip(writers, plans, strict=True):
                w.write(epoch=p.epoch, step=step + 1, indices=p.indices)
            before = (s.state_dict(), step)
            s.advance(plans[0])
            step += 1
        saved = before  # the last step of the segment is lost and redone in the next round
        for w in writers:
            w.close()


def test_expected_steps_follow_the_epoch_rule() -> None:
    assert expected_steps(6, G, N) == [(0, 5), (0, 5), (0, 5), (0, 5), (0, 3), (1, 5)]


def test_resizes_and_redone_steps_are_exactly_once(tmp_path: Path) -> None:
    simulate(tmp_path, [(0, 3, 4), (1, 2, 5), (2, 1, 3), (3, 4, 4)])
    total = 4 + 5 + 3 + 4 - 3  # each segment after the first starts by redoing the previous one's last step
    report = check_exactly_once(str(tmp_path), steps=total, global_batch=G, dataset_len=N)
    assert report.ok, report.problems
    assert report.redone_steps == {4: 2, 8: 2, 10: 2}
    assert report.world_sizes[1] == 3 and report.world_sizes[4] == 2 and report.world_sizes[13] == 4
    assert "exactly-once OK" in report.summary()
    assert report.to_json()["samples"] == sum(size for _, size in expected_steps(total, G, N))


def test_missing_rank_line_is_reported(tmp_path: Path) -> None:
    simulate(tmp_path, [(0, 2, 3)])
    path = tmp_path / "rank-1-round-0.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + lines[2:]) + "\n")  # drop rank 1's line of step 2
    report = check_exactly_once(str(tmp_path), steps=3, global_batch=G, dataset_len=N)
    assert not report.ok
    assert any("step 2 round 0: ranks [0]" in p for p in report.problems)


def test_repeated_and_skipped_samples_are_reported(tmp_path: Path) -> None:
    simulate(tmp_path, [(0, 1, 5)])
    path = tmp_path / "rank-0-round-0.jsonl"
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    lines[2]["indices"][0] = lines[1]["indices"][0]  # step 3 repeats a sample of step 2 and skips one
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = check_exactly_once(str(tmp_path), steps=5, global_batch=G, dataset_len=N)
    assert not report.ok
    assert any("trained twice in epoch 0" in p for p in report.problems)
    assert any("epoch 0: 1 samples never trained" in p for p in report.problems)


def test_missing_steps_and_torn_lines(tmp_path: Path) -> None:
    simulate(tmp_path, [(0, 2, 2)])
    with open(tmp_path / "rank-0-round-0.jsonl", "a") as f:
        f.write('{"epoch": 0, "step": 3, "ra')  # a crash mid-write
    assert len(read_audit(str(tmp_path))) == 4
    report = check_exactly_once(str(tmp_path), steps=3, global_batch=G, dataset_len=N)
    assert report.problems == ["step 3: no audit lines"]
    assert report.summary().startswith("exactly-once FAILED: step 3")


def test_meta_supplies_dataset_len_and_global_batch(tmp_path: Path) -> None:
    simulate(tmp_path, [(0, 2, 6)])
    assert not check_exactly_once(str(tmp_path), steps=6).ok  # no meta.json
    write_meta(str(tmp_path), dataset_len=N, global_batch=G, seed=4)
    assert check_exactly_once(str(tmp_path), steps=6).ok


def test_events_are_json_lines(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    w = EventWriter(str(path), round=2, world_size=3)
    w.emit("started", 0)
    w.emit("step", 1, loss=1.5, samples_per_s=10.0, epoch=0)
    w.close()
    assert not EventWriter(None, round=0, world_size=1).enabled
    events = read_events(str(path))
    assert [e["event"] for e in events] == ["started", "step"]
    assert events[1]["round"] == 2 and events[1]["world_size"] == 3 and events[1]["loss"] == 1.5


def test_a_run_resumed_from_another_runs_checkpoint_is_checked_from_its_first_step(tmp_path: Path) -> None:
    """Steps 1..7 were trained by another run; this run's audit (8..12) is complete on its own."""
    full = tmp_path / "full"
    simulate(full, [(1, 2, 12)])
    write_meta(str(full), dataset_len=N, global_batch=G, seed=4)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    for line in read_audit(str(full)):
        if line["step"] >= 8:
            with open(resumed / f"rank-{line['rank']}-round-1.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
    write_meta(str(resumed), dataset_len=N, global_batch=G, seed=4)
    assert not check_exactly_once(str(resumed), steps=11).ok  # steps 1..7 have no lines here
    report = check_exactly_once(str(resumed), steps=11, first_step=8)
    assert report.ok, report.problems
    assert report.samples == sum(size for _, size in expected_steps(11, G, N)[7:])
    # a step of this run that is missing is still caught
    lines = (resumed / "rank-0-round-1.jsonl").read_text().splitlines()
    (resumed / "rank-0-round-1.jsonl").write_text(
        "\n".join(ln for ln in lines if '"step": 9,' not in ln) + "\n"
    )
    assert "step 9" in check_exactly_once(str(resumed), steps=11, first_step=8).problems[0]
