"""``train.keep_last`` and ``train.resume_from: latest`` on real runs: two msrun launches of
``gradpool train`` at 2 ranks (~14 s each on 2 cores).

The first trains 5 steps saving after every one with ``keep_last: 2``: exactly step 4 and 5
remain, each save's line names what it removed, and the newest loads (every checksum verified).
Its step 5 is then uncommitted (its index removed, as a save killed before its commit leaves it)
and the second run resumes with ``resume_from: latest`` and ``keep_last: 1``: it skips step 5
saying why, resumes from step 4, and its step 5 (loss, and the model and Adam state it saves)
equals the first run's bit for bit; only its step 5 is left.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradpool.app import job
from gradpool.app.cli import EXIT_OK
from test_cli import STEP_LINE, TINY, _cli
from test_train_checkpoint import _assert_same_bits, _state

pytestmark = pytest.mark.distributed


def _train(log_dir: Path, *overrides: str):
    sets = [item for o in (*overrides, f"launch.log_dir={log_dir}") for item in ("--set", o)]
    run = _cli("train", "--config", str(TINY), "--set", "train.steps=5", *sets)
    assert run.returncode == EXIT_OK, run.stdout + run.stderr[-4000:]
    return run.stdout, {s.step: s for s in job.read_job_steps(log_dir)}


def _names(save_dir: Path) -> list:
    return sorted(p.name for p in save_dir.iterdir())


def test_keep_last_then_resume_latest_past_a_killed_save(tmp_path):
    save_dir = tmp_path / "ckpt"
    out, first = _train(tmp_path / "logs1", f"train.save_dir={save_dir}", "train.save_every=1",
                        "train.keep_last=2")
    assert _names(save_dir) == ["step-00000004", "step-00000005"]
    removed = re.findall(r"^saved step (\d) to \S+ \([^)]*\)(?:; removed (\S+) \(train.keep_last\))?$",
                         out, re.M)
    assert removed == [("1", ""), ("2", ""), ("3", "step-00000001"), ("4", "step-00000002"),
                       ("5", "step-00000003")], out
    worker = (tmp_path / "logs1" / "worker_0.log").read_text()
    assert re.search(r"^saved step 5 to \S+ \(\d+ B, \S+ s\); removed step-00000003 "
                     r"\(train.keep_last\)$", worker, re.M)
    saved5 = _state(save_dir / "step-00000005")      # the newest loads, checksums verified
    saved4 = _state(save_dir / "step-00000004")
    assert any(saved5[k].tobytes() != saved4[k].tobytes() for k in saved5)

    (save_dir / "step-00000005" / "index.json").unlink()     # killed before its commit
    out, second = _train(tmp_path / "logs2", f"train.save_dir={save_dir}",
                         "train.resume_from=latest", "train.keep_last=1")
    assert ("gradpool train: train.resume_from = latest: skipped step-00000005: not committed "
            "(no index.json: a save that did not finish)") in out
    assert f"gradpool train: train.resume_from = latest: {save_dir / 'step-00000004'} (step 4)" \
        in out
    assert f"gradpool train: resuming from {save_dir / 'step-00000004'} at step 4 of 5" in out
    assert [s[0] for s in STEP_LINE.findall(out)] == ["5"]
    assert sorted(second) == [4] and second[4].loss == first[4].loss
    assert re.search(r"^saved step 5 to \S+step-00000005 \([^)]*\); removed step-00000004 "
                     r"\(train.keep_last\)$", out, re.M), out
    assert _names(save_dir) == ["step-00000005"]
    _assert_same_bits(_state(save_dir / "step-00000005"), saved5)
