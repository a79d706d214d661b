"""Stopping a run with ``train.async_save`` during a save, then ``train.resume_from: latest``:
four msrun launches of ``gradpool train`` at 2 ranks (~15-25 s each on 2 cores), 8 steps saving
every 2.

1. The uninterrupted run: every save is committed within a step of its write (its ``saved
   step N`` line comes before step N+2's line; it used to wait for the next save), the last at
   the end; every step directory is committed and loads. The reference for the others.
2. The same run SIGKILLed (its launcher's pid; the ranks follow through their lifeline) while
   the background write of step 4 is surely in progress: the test hook
   ``GRADPOOL_TEST_SAVE_PAUSE=4:120`` holds every rank's write thread after writing its file,
   and the test waits for both rank files. Step 4 is left uncommitted; step 2 stays latest.
3. ``resume_from: latest`` on it resumes from step 2, and is SIGTERMed while the write of
   step 4 is held (``4:2``): the launcher says it lets the save finish, the write ends, the save
   commits, then the launcher stops every rank (exit 143). Step 4 is committed.
4. ``resume_from: latest`` again trains to step 8. The losses of every run equal the
   uninterrupted run's step for step, bit for bit, and so do the states of steps 2, 4 and 8.
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
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import files
from hyper_parallel.checkpoint.saving import PAUSE_ENV
from test_cli import TINY, _cli
from test_launch_signals import NO_PROCESS_LEFT_WITHIN, _run_processes
from test_train_checkpoint import _assert_same_bits, _state

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
RUN = ["train.steps=8", "train.save_every=2", "train.async_save=true"]
GRACE = 60          # train.stop_save_grace_s of run 3 (the default)


def _sets(*overrides: str) -> list[str]:
    return [item for o in (*RUN, *overrides) for item in ("--set", o)]


def _losses(log_dir: Path) -> dict[int, float]:
    return {s.step: s.loss for s in job.read_job_steps(log_dir)}


def _start(save_dir: Path, log_dir: Path, pause: str, *overrides: str) -> subprocess.Popen:
    # its own session, like a job started from a shell: a signal reaches the launcher alone
    return subprocess.Popen(
        [sys.executable, "-m", "gradpool", "train", "--config", str(TINY),
         *_sets(f"train.save_dir={save_dir}", f"launch.log_dir={log_dir}", *overrides)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", PAUSE_ENV: pause})


def _signal_during_write_of_step_4(launcher, save_dir: Path, log_dir: Path, signum: int,
                                   within: float) -> tuple[str, str]:
    """Once both ranks wrote their file of step 4 (their write threads now held by the hook,
    the save not committed), send ``signum`` to the launcher; its output once every process of
    the run is gone (``within`` seconds). Files an earlier, killed run left there (another
    generation) do not count."""
    step4 = save_dir / "step-00000004"
    pattern = "gen-*/rank-0000[01].safetensors"
    earlier = set(step4.glob(pattern))
    try:
        deadline = time.monotonic() + 180
        while len(set(step4.glob(pattern)) - earlier) < 2:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the save of step 4 did not start within 180 s"
            time.sleep(0.05)
        assert not (step4 / files.INDEX).exists()          # in progress: written, not committed
        sent_at = time.monotonic()
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=within)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    while _run_processes(str(log_dir)) and time.monotonic() < sent_at + within:
        time.sleep(0.1)
    assert _run_processes(str(log_dir)) == []
    return out, err


def test_stopping_during_a_background_save_then_resume_latest_continues_the_run(tmp_path):
    # 1. uninterrupted: each save committed within a step of its write, not at the next save
    full_dir, full_logs = tmp_path / "full", tmp_path / "logs-full"
    run = _cli("train", "--config", str(TINY), *_sets(f"train.save_dir={full_dir}",
                                                       f"launch.log_dir={full_logs}"))
    assert run.returncode == EXIT_OK, run.stdout + run.stderr[-4000:]
    full = _losses(full_logs)
    assert sorted(full) == list(range(8))
    lines = run.stdout.splitlines()
    for saved in (2, 4, 6):
        at = next(i for i, line in enumerate(lines) if re.match(
            rf"saved step {saved} to \S+ \([^)]* s in the background, training blocked \S+ s\)$",
            line))
        later = next(i for i, line in enumerate(lines) if line.startswith(f"step {saved + 2}/8"))
        assert at < later, f"step {saved} committed only after step {saved + 2}:\n{run.stdout}"
    assert re.search(r"^saved 4 checkpoints \(steps 2, 4, 6, 8\): .* \(training blocked \S+ s: "
                     r"train.async_save\); the last is \S+step-00000008$", run.stdout, re.M), \
        run.stdout
    assert sorted(p.parent.name for p in full_dir.glob("step-*/index.json")) == \
        ["step-00000002", "step-00000004", "step-00000006", "step-00000008"]

    # 2. SIGKILL while the background write of step 4 runs: step 2 stays latest
    save_dir, kill_logs = tmp_path / "ckpt", tmp_path / "logs-killed"
    launcher = _start(save_dir, kill_logs, "4:120")
    _signal_during_write_of_step_4(launcher, save_dir, kill_logs, signal.SIGKILL,
                                   NO_PROCESS_LEFT_WITHIN)
    assert launcher.returncode == -signal.SIGKILL
    assert not (save_dir / "step-00000004" / files.INDEX).exists()
    assert checkpoint.latest(save_dir) == save_dir / "step-00000002"
    killed = _losses(kill_logs)
    assert [killed[k] for k in sorted(killed)] == [full[k] for k in sorted(killed)]

    # 3. resume latest (step 2), SIGTERM while the write of step 4 is held for 2 s: the save
    # finishes and commits, then every rank is stopped
    term_logs = tmp_path / "logs-terminated"
    launcher = _start(save_dir, term_logs, "4:2", "train.resume_from=latest")
    out, err = _signal_during_write_of_step_4(launcher, save_dir, term_logs, signal.SIGTERM,
                                              GRACE + NO_PROCESS_LEFT_WITHIN)
    assert launcher.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert f"resuming from {save_dir / 'step-00000002'} at step 2 of 8" in out, out
    said = [line for line in err.splitlines() if line.strip()]
    assert said[0] == ("gradpool.launch: SIGTERM: letting the save of step 4 finish and commit "
                       f"before stopping the ranks (up to {GRACE} s: train.stop_save_grace_s)"), err
    assert re.fullmatch(r"gradpool.launch: SIGTERM: the save of step 4 committed after "
                        r"\d+\.\d s", said[1]), err
    assert said[2].startswith("gradpool.launch: SIGTERM: stopped msrun"), err
    assert (save_dir / "step-00000004" / files.INDEX).is_file()
    latest = checkpoint.latest(save_dir)
    # the ranks trained on while the launcher waited: a later save may have committed too
    assert latest.name in ("step-00000004", "step-00000006"), latest
    terminated = _losses(term_logs)
    assert min(terminated) == 2 and max(terminated) >= 3
    assert [terminated[k] for k in sorted(terminated)] == [full[k] for k in sorted(terminated)]

    # 4. resume latest to the end
    resume_logs = tmp_path / "logs-resumed"
    run = _cli("train", "--config", str(TINY), *_sets(
        f"train.save_dir={save_dir}", "train.resume_from=latest",
        f"launch.log_dir={resume_logs}"))
    assert run.returncode == EXIT_OK, run.stdout + run.stderr[-4000:]
    first = int(latest.name.split("-")[1])
    assert f"gradpool train: resuming from {latest} at step {first} of 8" in run.stdout
    resumed = _losses(resume_logs)
    assert sorted(resumed) == list(range(first, 8))
    assert [resumed[k] for k in sorted(resumed)] == [full[k] for k in sorted(resumed)]
    for step in (2, 4, 8):
        name = f"step-{step:08d}"
        _assert_same_bits(_state(save_dir / name), _state(full_dir / name))
