"""kill -9 during a save, then ``train.resume_from: latest`` (issue 37), and ``train.async_save``
on a real run: three msrun launches of ``gradpool train`` at 2 ranks (~15-25 s each on 2 cores).

1. An uninterrupted 6-step run saving every 2 steps with ``train.async_save: true``: each save
   is committed at the next save (its line says it was written in the background) and the last
   at the end of the run; every step directory is committed and loads.
2. The same run with synchronous saves, SIGKILLed (its launcher's pid; the ranks follow through
   their lifeline) while the save of step 4 is surely in progress: the test hook
   ``GRADPOOL_TEST_SAVE_PAUSE=4:120`` holds every rank after writing its file, before the
   commit, and the test waits for both rank files to appear. Step 4 is left uncommitted.
3. ``--set train.resume_from=latest`` on the killed run's save_dir: it skips step 4 saying
   why, resumes from step 2, and its losses of steps 3-6 equal the uninterrupted run's bit for
   bit, as does the state it saves at step 6. The step-2 and step-6 checkpoints of the
   asynchronous run equal the synchronous runs' (values and optimizer states, bit for bit).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradpool.app import job
from gradpool.app.cli import EXIT_OK
from hyper_parallel.checkpoint import files
from hyper_parallel.checkpoint.saving import PAUSE_ENV
from test_cli import TINY, _cli
from test_launch_signals import NO_PROCESS_LEFT_WITHIN, _run_processes
from test_train_checkpoint import _assert_same_bits, _state

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
RUN = ["train.steps=6", "train.save_every=2"]


def _sets(*overrides: str) -> list[str]:
    return [item for o in (*RUN, *overrides) for item in ("--set", o)]


def _losses(log_dir: Path) -> dict[int, float]:
    return {s.step: s.loss for s in job.read_job_steps(log_dir)}


def test_kill_9_during_a_save_then_resume_latest_continues_the_uninterrupted_run(tmp_path):
    # 1. uninterrupted, asynchronous saves
    full_dir, full_logs = tmp_path / "full", tmp_path / "logs-full"
    run = _cli("train", "--config", str(TINY), *_sets(
        f"train.save_dir={full_dir}", "train.async_save=true", f"launch.log_dir={full_logs}"))
    assert run.returncode == EXIT_OK, run.stdout + run.stderr[-4000:]
    full = _losses(full_logs)
    assert sorted(full) == [0, 1, 2, 3, 4, 5]
    committed = re.findall(r"^saved step (\d) to \S+ \([^)]* s in the background, training "
                           r"blocked \S+ s\)$", run.stdout, re.M)
    assert committed == ["2", "4"], run.stdout         # at the next save; 6 at the end
    assert re.search(r"^saved 3 checkpoints \(steps 2, 4, 6\): .* \(training blocked \S+ s: "
                     r"train.async_save\); the last is \S+step-00000006$", run.stdout, re.M), \
        run.stdout
    assert sorted(p.parent.name for p in full_dir.glob("step-*/index.json")) == \
        ["step-00000002", "step-00000004", "step-00000006"]

    # 2. synchronous saves, killed while the save of step 4 is in progress
    save_dir, kill_logs = tmp_path / "ckpt", tmp_path / "logs-killed"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gradpool", "train", "--config", str(TINY),
         *_sets(f"train.save_dir={save_dir}", f"launch.log_dir={kill_logs}")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     PAUSE_ENV: "4:120"})
    step4 = save_dir / "step-00000004"
    try:
        deadline = time.monotonic() + 180
        while len(list(step4.glob("gen-*/rank-0000[01].safetensors"))) < 2:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the save of step 4 did not start within 180 s"
            time.sleep(0.05)
        assert not (step4 / files.INDEX).exists()          # in progress: written, not committed
        killed_at = time.monotonic()
        launcher.send_signal(signal.SIGKILL)
        launcher.communicate(timeout=NO_PROCESS_LEFT_WITHIN)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == -signal.SIGKILL
    while _run_processes(str(kill_logs)) and \
            time.monotonic() < killed_at + NO_PROCESS_LEFT_WITHIN:
        time.sleep(0.1)
    assert _run_processes(str(kill_logs)) == []
    assert not (step4 / files.INDEX).exists()
    assert (save_dir / "step-00000002" / files.INDEX).is_file()
    killed = _losses(kill_logs)
    assert [killed[k] for k in sorted(killed)] == [full[k] for k in sorted(killed)]

    # 3. resume the latest committed step
    resume_logs = tmp_path / "logs-resumed"
    run = _cli("train", "--config", str(TINY), *_sets(
        f"train.save_dir={save_dir}", "train.resume_from=latest",
        f"launch.log_dir={resume_logs}"))
    assert run.returncode == EXIT_OK, run.stdout + run.stderr[-4000:]
    assert ("gradpool train: train.resume_from = latest: skipped step-00000004: not committed "
            "(no index.json: a save that did not finish)") in run.stdout, run.stdout
    assert f"gradpool train: resuming from {save_dir / 'step-00000002'} at step 2 of 6" \
        in run.stdout
    resumed = _losses(resume_logs)
    assert sorted(resumed) == [2, 3, 4, 5]
    assert [resumed[k] for k in (2, 3, 4, 5)] == [full[k] for k in (2, 3, 4, 5)]
    final = _state(save_dir / "step-00000006")
    _assert_same_bits(final, _state(full_dir / "step-00000006"))
    _assert_same_bits(_state(save_dir / "step-00000002"), _state(full_dir / "step-00000002"))
