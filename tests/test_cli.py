"""The ``gradpool`` command: check-config in-process, train in-process (1 rank) and under msrun
(2 ranks: one successful run against the reference, one whose loss overflows to NaN)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from gradpool.app import rank_report
from gradpool.app.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from gradpool.app.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "deepseek3_tiny.yaml"
STEP_LINE = re.compile(r"^step (\d+)/(\d+)  loss (\S+)  time +\S+ ms  copied .+  copy +\S+ GB/s  "
                       r"new allocations +(\d+)  pool high-water .+$", re.M)
REFERENCE_LINE = re.compile(r"^reference: largest loss difference (\S+) absolute, (\S+) relative",
                            re.M)


def _cli(*args: str, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    """``python -m gradpool ARGS`` in a fresh process, from the project root."""
    return subprocess.run([sys.executable, "-m", "gradpool", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("gradpool")]


# -- check-config ------------------------------------------------------------------------------
def test_check_config_prints_the_resolved_config(capsys):
    assert main(["check-config", str(TINY), "--set", "train.steps=2",
                 "--set", "fully_shard.comm_fusion=on"]) == EXIT_OK
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = load_config(TINY, ["train.steps=2", "fully_shard.comm_fusion=true"])
    assert printed == expected.to_dict()
    assert printed["train"]["steps"] == 2 and printed["fully_shard"]["comm_fusion"] is True


def test_shipped_tiny_config_verifies_gradients():
    assert load_config(TINY).gradpool.verify_gradients is True


def test_check_config_bad_file_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gradpool:\n  bucket_cap_mb: 25\n")
    assert main(["check-config", str(bad)]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert "gradpool.bucket_cap_mb" in lines[0] and "bucket_cap_mib" in lines[0]


def test_check_config_unreadable_and_invalid_yaml(tmp_path, capsys):
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == EXIT_USAGE
    assert "cannot be read" in capsys.readouterr().err
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [1,\n  2\ntrain: {")
    assert main(["check-config", str(broken)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "not valid YAML" in err


@pytest.mark.parametrize("override, words", [
    ("train.stepz=2", ["train.stepz", "did you mean 'train.steps'"]),
    ("train.steps", ["section.key=value"]),
    ("model.num_heads=5", ["num_heads = 5", "not divisible"]),
    ("launch.device=GPU", ["launch.device", "'CPU'"]),
])
def test_bad_set_is_one_line_and_exit_2(override, words, capsys):
    assert main(["check-config", str(TINY), "--set", override]) == EXIT_USAGE
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradpool: config error: ")
    for word in words:
        assert word in lines[0]


def test_train_with_a_bad_config_launches_nothing(capsys):
    assert main(["train", "--config", str(TINY), "--set", "model.num_heads=3"]) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.out == "" and "not divisible" in captured.err


# -- train, one rank in this process -----------------------------------------------------------
# Blocking op launch is process-wide and cannot be undone, and the tests after these must run as
# MindSpore's default runs (tests/conftest.py fails a test that leaves the process blocking): in
# this process, block_launches is recorded instead of called, or the key is false.
IN_PROCESS = ["--set", "launch.launch_blocking=false"]


@pytest.fixture
def blocked(monkeypatch):
    from gradpool.app import rank_main
    calls = []
    monkeypatch.setattr(rank_main, "block_launches", lambda: calls.append(True))
    return calls


def test_train_one_rank_in_process_with_reference(tmp_path, capsys, blocked):
    code = main(["train", "--config", str(TINY), "--reference", "--set", "launch.ranks=1",
                 "--set", "train.steps=2", "--set", f"launch.log_dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    steps = STEP_LINE.findall(out)
    assert [(s[0], s[1]) for s in steps] == [("1", "2"), ("2", "2")]
    assert steps[1][3] == "0"                        # no new allocation in step 2
    assert "summary: 2 steps" in out and "0 new allocations after step 1" in out
    # the CPU default: the in-process rank and the reference each set blocking launch up (the
    # summary says what MindSpore reports, here the recorded call's process default)
    assert blocked == [True, True]
    assert "op launch: asynchronous (1 rank(s); launch.launch_blocking)" in out
    abs_diff, rel_diff = map(float, REFERENCE_LINE.search(out).groups())
    assert rel_diff <= 1e-5 and abs_diff <= 1e-4
    assert (tmp_path / "config.yaml").is_file()
    report = rank_report.read_report(tmp_path, 0)          # the in-process rank's report
    assert report is not None and report.results["outcome"]["status"] == "ok"
    assert [step["step"] for step in report.results["steps"]] == [0, 1]
    assert load_config(tmp_path / "config.yaml").launch.ranks == 1


def test_train_prints_its_log_directory_before_anything_runs(tmp_path, capsys, blocked):
    code = main(["train", "--config", str(TINY), "--set", "launch.ranks=1", "--set",
                 "train.steps=1", "--set", f"launch.log_dir={tmp_path / 'run'}", *IN_PROCESS])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert blocked == []                                 # launch.launch_blocking=false
    lines = out.splitlines()
    logs = next(i for i, line in enumerate(lines) if line.startswith("gradpool train: logs in "))
    assert lines[logs] == f"gradpool train: logs in {tmp_path / 'run'}"
    assert logs < next(i for i, line in enumerate(lines) if line.startswith("step 1/1"))


def test_every_rank_logs_its_steps_in_mindformers_style():
    from gradpool.app.rank_main import step_line
    from gradpool.app.train import StepRecord
    cfg = load_config(TINY)
    record = StepRecord(step=2, loss=4.5, seconds=0.25, bytes_copied=132096, copy_gbps=0.1,
                        new_allocations=0, high_water_bytes=88576, stall_seconds=0.0)
    line = step_line(cfg, record, rank=1, world=2)
    assert re.match(r"^step 3/5 loss 4\.500000 time 250\.0 ms lr 1\.000e-03 rank 1/2 ", line), line


def test_job_steps_show_the_slowest_rank_and_every_ranks_allocations():
    from gradpool.app.job import JobStep
    rows = [dict(seconds=0.5, bytes_copied=10, copy_gbps=2.0, new_allocations=3,
                 high_water_bytes=100, stall_seconds=0.0, stalls=0),
            dict(seconds=0.7, bytes_copied=12, copy_gbps=1.0, new_allocations=4,
                 high_water_bytes=90, stall_seconds=0.1, stalls=2)]
    record = JobStep(step=0, loss=1.5, ranks=tuple(rows)).record()
    assert (record.seconds, record.bytes_copied, record.copy_gbps, record.new_allocations,
            record.high_water_bytes, record.stall_seconds, record.stalls) == \
        (0.7, 12, 1.0, 7, 100, 0.1, 2)


def test_rank_counters_cross_the_all_reduce_exactly():
    """At world 1; the same rows between 2 real ranks: tests/distributed/comm_cases.py
    (rank_rows_cross_exactly)."""
    from gradpool.app.rank_main import OUTCOME_FIELDS, exchange
    from gradpool.comm import SingleProcessCommunicator
    mine = [1, 5, 205, 1, 43, 2 ** 40 + 3, 7, 2 ** 33 + 1, 2 ** 45 + 12345, 0.25, 0.5, 2,
            2 ** 48 + 17]
    assert exchange(SingleProcessCommunicator(), mine, OUTCOME_FIELDS) == [mine]


def test_step_records_are_followed_live_from_rank_0s_report(tmp_path, monkeypatch):
    from gradpool.app import job
    from gradpool.app.train import StepRecord

    monkeypatch.delenv(rank_report.ENV_DIR, raising=False)
    seen = []
    follower = job._RecordFollower(tmp_path, 0, seen.append)
    follower.start()
    try:
        reporter = rank_report.Reporter(tmp_path, rank=0, world_size=2)
        steps = []
        for step in range(3):
            steps.append(dict(step=step, loss=1.0, seconds=0.1, bytes_copied=8, copy_gbps=1.0,
                              new_allocations=0, high_water_bytes=8, stall_seconds=0.0))
            reporter.publish("steps", steps)
            for _ in range(100):                     # seen while the "run" goes on
                if len(seen) == step + 1:
                    break
                threading.Event().wait(0.05)
            assert [r.step for r in seen] == list(range(step + 1))
    finally:
        follower.stop()
    assert seen == [StepRecord(**s) for s in steps] == job.read_records(tmp_path, 0)


# -- train, two ranks under msrun ------------------------------------------------------------
@pytest.mark.distributed
def test_train_two_ranks_matches_the_reference():
    run = _cli("train", "--config", str(TINY), "--set", "train.steps=2", "--reference")
    assert run.returncode == EXIT_OK, run.stdout + run.stderr[-4000:]
    out = run.stdout
    assert "2 CPU rank(s) under msrun" in out
    steps = STEP_LINE.findall(out)
    assert [(s[0], s[1]) for s in steps] == [("1", "2"), ("2", "2")]
    assert all(float(s[2]) > 0 for s in steps)
    assert int(steps[0][3]) > 0 and steps[1][3] == "0"   # buckets reserved once, then reused
    summary = re.search(r"^summary: 2 steps, mean step time \S+ ms .*, copied .* in total, "
                        r"0 new allocations after step 1, pool high-water \S+ \S+$", out, re.M)
    assert summary, out
    verified = re.search(r"^gradient integrity: (\d+) gradients verified unchanged", out, re.M)
    assert verified and int(verified.group(1)) > 0
    # the CPU default, as each rank read it from MindSpore after setting it up
    assert "op launch: blocking (2 rank(s); launch.launch_blocking)" in out
    abs_diff, rel_diff = map(float, REFERENCE_LINE.search(out).groups())
    assert rel_diff <= 1e-5 and abs_diff <= 1e-4


@pytest.mark.distributed
def test_train_fails_on_a_non_finite_loss():
    # SGD at lr 1e38 throws the weights to ~1e38 after one step: the second step's activations
    # overflow float32 and its loss is NaN on both ranks (checked in-process: 4.56, nan, nan).
    # When msrun kills the second rank while it is still exiting, MindSpore's scheduler waits
    # out that node's heartbeat timeout (30 s by default) before msrun returns; MS_NODE_TIMEOUT
    # (MindSpore's own setting) shortens that wait.
    run = _cli("train", "--config", str(TINY), "--set", "train.steps=3",
               "--set", "train.optimizer=sgd", "--set", "train.learning_rate=1e38",
               env={"MS_NODE_TIMEOUT": "15"})
    assert run.returncode == EXIT_FAILED, run.stdout + run.stderr[-4000:]
    assert [s[0] for s in STEP_LINE.findall(run.stdout)] == ["1"]
    errors = _error_lines(run.stderr)
    assert errors and errors[0].startswith("gradpool train: FAILED: rank ")
    assert "NonFiniteLossError: step 2 of 3: loss is nan" in errors[0]
    assert "worker_0.log" in run.stderr                 # the launcher's log tail follows
