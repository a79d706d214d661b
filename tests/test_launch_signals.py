"""A signal to ``gradpool train`` ends the whole run (issue 37): msrun and both ranks live in
sessions of their own, so without the launcher's handlers and the ranks' lifeline they trained
on, reparented to init, and committed checkpoints after the user "killed" the run.

Each case starts a real 2-rank ``gradpool train`` (saving after every step), waits for its first
committed checkpoint, signals the launcher's pid (never a process found by name), and checks:
the launcher's exit status (128 + the signal; SIGKILL runs no handler), the one line it prints,
that no process of the run is left within 10 s (a ``/proc`` scan for the run's own log
directory, which every process of the run has on its command line), that no checkpoint was
committed after the signal, and that the last committed one loads with every checksum verified.
About 12-15 s a case on the 2-core machine.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradpool.app.config import load_config
from gradpool.app.model import TinyDeepSeekV3
from gradpool.app.train import optimizer_for
from hyper_parallel import checkpoint

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "deepseek3_tiny.yaml"
NO_PROCESS_LEFT_WITHIN = 10.0
# a save already renaming its index when the signal lands may still finish: the launcher acts
# between polls (0.5 s), a rank's lifeline within 0.2 s
COMMIT_SLACK = 1.0
# one layer, no gradient checksums: the first checkpoint commits a few seconds sooner
SMALL = ["model.num_layers=1", "gradpool.verify_gradients=false"]


def _run_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker`` (zombies do not count)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                "utf-8", "replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _committed(save_dir: Path) -> dict[str, float]:
    """Each committed step directory and when its index was written."""
    return {p.parent.name: p.stat().st_mtime for p in save_dir.glob("step-*/index.json")}


@pytest.mark.distributed
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT,
                                    signal.SIGKILL], ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_the_launcher_ends_every_process_of_the_run(tmp_path, signum):
    save_dir, log_dir = tmp_path / "ckpt", tmp_path / "logs"
    # stop_save_grace_s 0: a save in progress when the signal lands is not waited for (saving
    # every step, one nearly always is); the grace is tested in tests/test_kill_during_save.py
    sets = [*SMALL, "train.steps=200", "train.save_every=1", f"train.save_dir={save_dir}",
            f"launch.log_dir={log_dir}", "train.stop_save_grace_s=0"]
    # its own session, like a job started from a shell: the signal reaches the launcher alone
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gradpool", "train", "--config", str(TINY),
         *[item for s in sets for item in ("--set", s)]],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 180
        while not _committed(save_dir):
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "no checkpoint committed within 180 s"
            time.sleep(0.1)
        assert _run_processes(str(log_dir)), "the run's processes are not found by its marker"
        killed_at = time.time()
        launcher.send_signal(signum)
        out, err = launcher.communicate(timeout=NO_PROCESS_LEFT_WITHIN)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    while _run_processes(str(log_dir)) and time.time() < killed_at + NO_PROCESS_LEFT_WITHIN:
        time.sleep(0.1)
    assert _run_processes(str(log_dir)) == [], f"left running {NO_PROCESS_LEFT_WITHIN:.0f} s " \
                                               f"after {signal.Signals(signum).name}"
    committed = _committed(save_dir)
    late = {step: mtime - killed_at for step, mtime in committed.items()
            if mtime > killed_at + COMMIT_SLACK}
    assert not late, f"committed after the signal (seconds after it): {late}"
    last = save_dir / max(committed)
    if signum == signal.SIGKILL:
        assert launcher.returncode == -signal.SIGKILL
    else:
        assert launcher.returncode == 128 + signum, err[-3000:]
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"gradpool.launch: {signal.Signals(signum).name}: stopped "
                                   "msrun (pid "), lines[0]
        assert "rank(s) 0, 1, no process of the launch left; last committed checkpoint: " \
            in lines[0], lines[0]
        named = lines[0].split("last committed checkpoint: ", 1)[1].split(" (step ")[0]
        # the newest the ranks reported; one committed in the instant of the signal may follow
        assert named in {str(save_dir / step) for step in committed}, (lines[0], committed)
    cfg = load_config(TINY, SMALL)
    model = TinyDeepSeekV3(cfg.model, seed=99)
    loaded = checkpoint.load(last, model, optimizer_for(cfg, model.trainable_params()))
    assert loaded["step"] == int(last.name.split("-")[1])
