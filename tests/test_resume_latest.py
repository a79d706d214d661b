"""``train.resume_from: latest``, ``train.keep_last`` and the config edges of issue 37, in one
process (no launch; a few seconds): real checkpoints of a small model are saved into step
directories, then damaged, uncommitted, locked or surrounded by things that are not ours.
The real runs (msrun) are in ``tests/test_keep_last_run.py``.
"""
from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, nn

from gradpool.app import checkpoints, rank_main
from gradpool.app.checkpoints import (CheckpointInfo, check_resume, find_latest, resolve_latest,
                                      run_extra, step_dir)
from gradpool.app.cli import EXIT_USAGE, main
from gradpool.app.config import load_config
from gradpool.app.errors import ConfigValueError, OverrideSyntaxError
from gradpool.errors import CheckpointError, StateMismatchError
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import files, steps
from test_cli import TINY

ms.set_device("CPU")


class Net(nn.Cell):
    def __init__(self, value: float):
        super().__init__()
        self.w = Parameter(ms.Tensor(np.full((3, 4), value, np.float32)), name="w")

    def construct(self, x):
        return x


def _save(save_dir: Path, step: int, extra=None) -> Path:
    path = step_dir(save_dir, step)
    checkpoint.save(path, Net(float(step)), step=step, extra=extra)
    return path


def _loaded_value(path) -> float:
    net = Net(-1.0)
    checkpoint.load(path, net)
    return float(net.w.asnumpy()[0, 0])


def _cfg(save_dir, *overrides):
    return load_config(TINY, [f"train.save_dir={save_dir}", "train.resume_from=latest",
                              *overrides])


# -- latest --------------------------------------------------------------------------------------
def test_latest_skips_uncommitted_and_damaged_newer_steps_and_says_why(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    (step_dir(tmp_path, 8) / files.INDEX).unlink()                 # a save killed before commit
    rank6 = next(step_dir(tmp_path, 6).glob("gen-*/rank-00000.safetensors"))
    with open(rank6, "r+b") as fh:                                 # truncated by a full disk
        fh.truncate(rank6.stat().st_size - 3)
    # not ours: ignored whatever their names promise
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-00000010.old").mkdir()
    os.symlink(step_dir(tmp_path, 2), tmp_path / "step-00000011")
    (tmp_path / "step-00000012").write_text("a file")
    cfg, info, notes = resolve_latest(_cfg(tmp_path))
    assert info.step == 4 and cfg.train.resume_from == str(step_dir(tmp_path, 4))
    assert len(notes) == 3, notes
    assert notes[0].startswith("train.resume_from = latest: skipped step-00000008: not committed")
    assert notes[1].startswith("train.resume_from = latest: skipped step-00000006: damaged (")
    assert str(rank6) in notes[1]
    assert notes[2] == f"train.resume_from = latest: {step_dir(tmp_path, 4)} (step 4)"
    assert _loaded_value(cfg.train.resume_from) == 4.0


def test_latest_refuses_a_step_whose_index_holds_another_step(tmp_path):
    _save(tmp_path, 2)
    shutil.copytree(_save(tmp_path / "other", 3), step_dir(tmp_path, 5))
    info, skipped = find_latest(tmp_path)
    assert info.step == 2
    assert skipped == [f"step-00000005: damaged ({step_dir(tmp_path, 5) / files.INDEX} holds "
                       "step 3, its directory's name says 5)"]


def test_latest_with_nothing_committed_starts_from_step_0_and_says_so(tmp_path):
    for save_dir in (tmp_path / "missing", tmp_path):
        cfg, info, notes = resolve_latest(_cfg(save_dir))
        assert info is None and cfg.train.resume_from is None
        assert notes == [f"train.resume_from = latest: no committed checkpoint under "
                         f"{save_dir}; starting from step 0"]
    _save(tmp_path, 3)
    (step_dir(tmp_path, 3) / files.INDEX).unlink()
    cfg, info, notes = resolve_latest(_cfg(tmp_path))
    assert cfg.train.resume_from is None and len(notes) == 2 and "not committed" in notes[0]


def test_latest_refuses_when_every_committed_checkpoint_is_damaged(tmp_path):
    for step in (1, 2):
        path = _save(tmp_path, step)
        next(path.glob("gen-*/rank-00000.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"every committed checkpoint under .* is damaged "
                                              r"\(step-00000002: .*; step-00000001: "):
        find_latest(tmp_path)


def test_other_configs_are_not_resolved(tmp_path):
    cfg = load_config(TINY, [f"train.resume_from={tmp_path}/latest"])
    assert resolve_latest(cfg) == (cfg, None, [])


# Ranks that find different steps all refuse: at 2 real msrun ranks in
# tests/distributed/checkpoint_cases.py (w2_ranks_that_find_different_latest_all_refuse).


# -- keep_last -----------------------------------------------------------------------------------
def _names(save_dir: Path) -> list:
    return sorted(p.name for p in save_dir.iterdir())


def prune(save_dir, keep_last: int, saved_step: int) -> list:
    """The step directories :func:`steps.prune` removed (it removed every one it tried)."""
    pruned = steps.prune(save_dir, keep_last, saved_step, holder="test")
    assert pruned.left == {}, pruned.left
    return pruned.removed


@contextlib.contextmanager
def unremovable(path: Path):
    """``path`` (a file, or a directory whose entries then cannot be removed) made so that a
    removal really fails. Permission bits do not stop root, so as root the file system's
    immutable attribute (``chattr +i``; ext4 here), else a read-only parent directory; skipped
    where neither is available. Undone on exit."""
    if os.geteuid() == 0:
        made = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True) \
            if shutil.which("chattr") else None
        if made is None or made.returncode:
            pytest.skip(f"cannot make {path} immutable as root: "
                        f"{made.stderr.strip() if made else 'no chattr'}")
        undo = ["chattr", "-i", str(path)]
    else:
        target = path if path.is_dir() else path.parent
        os.chmod(target, 0o555)
        undo = None
    try:
        yield
    finally:
        if undo:
            subprocess.run(undo, check=True)
        else:
            os.chmod(target, 0o755)


@pytest.mark.parametrize("what", ["rank file", "generation directory", "index"])
def test_a_removal_that_fails_is_logged_retried_and_never_resumed(tmp_path, caplog, what):
    """keep_last=1 after step 3: step 1's removal fails on a real file-system refusal. The
    warning names the directory and what remained; step 2 goes; a half-removed step 1 is
    uncommitted, so latest never picks it (not even when it is the only directory left); an
    index that cannot be removed leaves the step whole and committed. Once the file can go, the
    next prune removes it."""
    for step in (1, 2, 3):
        _save(tmp_path, step)
    one = step_dir(tmp_path, 1)
    rank_file = next(one.glob("gen-*/rank-00000.safetensors"))
    target = {"rank file": rank_file, "generation directory": rank_file.parent,
              "index": one / files.INDEX}[what]
    with unremovable(target):
        with caplog.at_level(logging.WARNING, logger="hyper_parallel.checkpoint.steps"):
            pruned = steps.prune(tmp_path, 1, 3, holder="test")
        assert pruned.removed == [str(step_dir(tmp_path, 2))] and pruned.busy == []
        assert list(pruned.left) == [str(one)]
        remaining = [str(p.relative_to(one)) for p in sorted(one.rglob("*")) if p.is_file()]
        assert pruned.left[str(one)] == remaining
        assert str(rank_file.relative_to(one)) in remaining
        [record] = [r for r in caplog.records if "could not remove" in r.getMessage()]
        message = record.getMessage()
        assert str(one) in message and str(target.relative_to(one)) in message
        assert f"what remains: {', '.join(remaining)}" in message
        committed = what == "index"
        assert (one / files.INDEX).is_file() == committed
        assert "stays committed" in message if committed else "stays committed" not in message
        assert steps.latest(tmp_path) == step_dir(tmp_path, 3)
        shutil.rmtree(step_dir(tmp_path, 3))
        # the only directory left: a half-removed one is never resumed, a whole one may be
        assert steps.latest(tmp_path) == (one if committed else None)
        if not committed:
            assert steps.scan(tmp_path).skipped[0].startswith("step-00000001: not committed")
        _save(tmp_path, 4)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hyper_parallel.checkpoint.steps"):
            again = steps.prune(tmp_path, 1, 4, holder="test")
        assert list(again.left) == [str(one)] and len(caplog.records) == 1    # still loud
    again = steps.prune(tmp_path, 1, 4, holder="test")              # retried: it goes now
    assert (again.removed, again.left) == ([str(one)], {})
    assert _names(tmp_path) == ["step-00000004"]
    line = checkpoints.removed_text({"removed": pruned.removed, "not_removed": list(pruned.left)})
    assert line == ("; removed step-00000002 (train.keep_last); could not remove step-00000001 "
                    "(train.keep_last: see the rank's log; retried at the next save)")


def test_keep_last_removes_only_older_steps_of_ours_beyond_the_newest_n(tmp_path):
    for step in range(1, 7):
        _save(tmp_path, step)
    (step_dir(tmp_path, 2) / files.INDEX).unlink()          # killed save: removed too
    (step_dir(tmp_path, 1) / "notes.txt").write_text("mine")   # not only a save's files: kept
    (tmp_path / "step-3").mkdir()                            # not a step directory: kept
    _save(tmp_path, 9)                                       # newer (an earlier, longer run)
    # step 3 is being saved by another writer: left
    fd = os.open(step_dir(tmp_path, 3) / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        removed = prune(tmp_path, 2, 6)
    finally:
        os.close(fd)
    assert removed == [str(step_dir(tmp_path, 2)), str(step_dir(tmp_path, 4))]
    assert _names(tmp_path) == ["step-00000001", "step-00000003", "step-00000005",
                                "step-00000006", "step-00000009", "step-3"]
    assert _loaded_value(step_dir(tmp_path, 6)) == 6.0
    assert prune(tmp_path, 2, 6) == [str(step_dir(tmp_path, 3))]      # the lock is free now
    assert prune(tmp_path, 1, 6) == [str(step_dir(tmp_path, 5))]      # never the one saved
    assert _names(tmp_path) == ["step-00000001", "step-00000006", "step-00000009", "step-3"]
    assert (tmp_path / "step-00000001" / "notes.txt").read_text() == "mine"
    assert _loaded_value(step_dir(tmp_path, 6)) == 6.0


def test_save_step_prunes_on_rank_0_only_and_names_what_it_removed(tmp_path, monkeypatch):
    for step in (1, 2):
        _save(tmp_path, step)
    cfg = load_config(TINY, [f"train.save_dir={tmp_path}", "train.keep_last=1"])
    net = Net(3.0)
    saved = checkpoints.save_step(cfg, net, None, 3, 1, rank=1)
    assert saved["removed"] == [] and len(_names(tmp_path)) == 3
    saved = checkpoints.save_step(cfg, net, None, 3, 1, rank=0)
    assert saved["removed"] == [str(step_dir(tmp_path, 1)), str(step_dir(tmp_path, 2))]
    assert _names(tmp_path) == ["step-00000003"]
    assert rank_main.saved_line(saved).endswith(
        "; removed step-00000001, step-00000002 (train.keep_last)")
    assert checkpoints.save_step(load_config(TINY, [f"train.save_dir={tmp_path}"]), net, None,
                                 4, 1)["removed"] == []           # null: keep all
    assert _names(tmp_path) == ["step-00000003", "step-00000004"]


def test_with_async_save_a_step_is_pruned_only_after_a_newer_one_committed(tmp_path):
    """train.async_save with keep_last 1: each save commits (and prunes) at the next save, so
    the newest committed step is never removed while a newer one is only being written."""
    cfg = load_config(TINY, [f"train.save_dir={tmp_path}", "train.keep_last=1",
                             "train.async_save=true", "train.save_every=1", "train.steps=3"])
    net = Net(1.0)
    saver = checkpoints.StepSaver(cfg, net, None, 1, 0)
    assert saver.after_step(1) is None and saver.started["step"] == 1
    saver.pending.wait()                           # step 1 written and committed (keep it)
    saved = saver.after_step(2)                    # commits step 1, starts step 2
    assert saved["step"] == 1 and saved["asynchronous"] and saved["removed"] == []
    net.w.set_data(ms.Tensor(np.full((3, 4), 2.0, np.float32)))
    saved = saver.after_step(3)                    # commits step 2 (removes 1), starts step 3
    assert saved["step"] == 2 and saved["removed"] == [str(step_dir(tmp_path, 1))]
    assert _names(tmp_path) == ["step-00000002", "step-00000003"]
    assert not (step_dir(tmp_path, 3) / files.INDEX).exists()          # being written
    assert checkpoint.latest(tmp_path) == step_dir(tmp_path, 2)
    assert "in the background, training blocked" in rank_main.saved_line(saved)
    final = saver.finish()                         # the end of the run commits step 3
    assert final["step"] == 3 and final["removed"] == [str(step_dir(tmp_path, 2))]
    assert _names(tmp_path) == ["step-00000003"] and saver.finish() is None
    assert _loaded_value(step_dir(tmp_path, 3)) == 2.0


def test_a_background_save_commits_within_a_step_of_its_last_write(tmp_path):
    """save_every 2: the save of step 2 is not committed by the step that started it, nor while
    any rank's write still runs; at the end of the first step after every write finished it is
    (before step 4's save), so latest() finds it and a kill from then on loses nothing of it."""
    import time
    cfg = load_config(TINY, [f"train.save_dir={tmp_path}", "train.async_save=true",
                             "train.save_every=2", "train.steps=6"])
    net = Net(2.0)
    saver = checkpoints.StepSaver(cfg, net, None, 1, 0)
    assert saver.after_step(1) is None and saver.started is None and not saver.written()
    assert saver.after_step(2) is None and saver.started["step"] == 2
    while not saver.pending.done():
        time.sleep(0.01)
    assert not saver.written(), "a save started by this step commits at a later step"
    assert saver.commit_if_written(False) is None
    assert saver.after_step(3) is None and saver.written()
    assert saver.commit_if_written(False) is None          # another rank still writes
    assert checkpoint.latest(tmp_path) is None
    saved = saver.commit_if_written(True)
    assert saved["step"] == 2 and saved["asynchronous"]
    assert checkpoint.latest(tmp_path) == step_dir(tmp_path, 2)
    assert saver.pending is None and not saver.written() and saver.finish() is None
    assert _loaded_value(step_dir(tmp_path, 2)) == 2.0


# -- config edges --------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["train.save_dir", "train.resume_from", "launch.log_dir",
                                 "model.seq_len"])
def test_an_empty_override_is_refused_saying_how_to_unset(key):
    with pytest.raises(OverrideSyntaxError, match=rf"the value of {key} is empty; give a "
                                                  rf"value, or write {key}=null"):
        load_config(TINY, [f"{key}="])
    assert load_config(TINY, [f"{key}=null"]) if key != "model.seq_len" else True


def _one_error_line(capsys, *argv) -> str:
    code = main(list(argv))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == EXIT_USAGE and captured.out == "" and len(lines) == 1, captured
    return lines[0]


@pytest.mark.parametrize("command", ["train", "check-config"])
def test_empty_values_and_uncovered_meshes_are_one_line_exit_2(capsys, command):
    head = ["train", "--config", str(TINY)] if command == "train" else ["check-config", str(TINY)]
    line = _one_error_line(capsys, *head, "--set", "train.resume_from=")
    assert line.endswith("train.resume_from is empty; give a value, or write "
                         "train.resume_from=null to unset the key")
    line = _one_error_line(capsys, *head, "--set", "fully_shard.mesh_shape=[3,5]")
    assert "fully_shard.mesh_shape = [3, 5] covers 15 rank(s), but launch.ranks = 2" in line
    line = _one_error_line(capsys, *head, "--set", "train.keep_last=0")
    assert "train.keep_last = 0 (int) is not allowed; expected an integer >= 1 or null" in line
    for key, value, shown in (("keep_last", "2", "2"), ("resume_from", "latest", "'latest'")):
        line = _one_error_line(capsys, *head, "--set", f"train.{key}={value}")
        assert f"train.{key} = {shown} needs train.save_dir, which is null" in line
    assert load_config(TINY, ["fully_shard.mesh_shape=[1,2]"]).fully_shard.mesh_shape == (1, 2)


def test_latest_with_an_empty_save_dir_starts_fresh_before_launch(tmp_path, capsys, monkeypatch):
    # the run itself is stubbed: what matters is what the launcher decided before launching
    from gradpool.app import job
    seen = {}

    def fake_run_job(cfg, **kwargs):
        seen["cfg"] = cfg
        raise job.TrainJobError("stopped by the test", "")
    monkeypatch.setattr(job, "run_job", fake_run_job)
    main(["train", "--config", str(TINY), "--set", f"train.save_dir={tmp_path / 'ck'}",
          "--set", "train.resume_from=latest", "--set", f"launch.log_dir={tmp_path / 'logs'}"])
    out = capsys.readouterr().out
    assert (f"gradpool train: train.resume_from = latest: no committed checkpoint under "
            f"{tmp_path / 'ck'}; starting from step 0") in out
    assert seen["cfg"].train.resume_from is None


# -- fully_shard settings a resume must keep ----------------------------------------------------
FULLY_SHARD_CHANGES = [
    ("fully_shard.reduce_op=sum", "fully_shard.reduce_op = 'avg', this run has 'sum'"),
    ("fully_shard.gradient_scaling_factor=0.5",
     "fully_shard.gradient_scaling_factor = 1.0, this run has 0.5"),
    ("fully_shard.reduce_dtype=bfloat16",
     "fully_shard.reduce_dtype = 'float32', this run has 'bfloat16'"),
    ("fully_shard.param_dtype=bfloat16", "fully_shard.param_dtype = None, this run has 'bfloat16'"),
    ("fully_shard.apply_grad_on_fp32_main_grad=false",
     "fully_shard.apply_grad_on_fp32_main_grad = True, this run has False"),
    ("fully_shard.mesh_shape=[1,2]", "fully_shard.mesh_shape = None, this run has [1, 2]"),
]


def test_the_fully_shard_settings_are_recorded_when_saving():
    cfg = load_config(TINY, ["fully_shard.mesh_shape=[2]", "fully_shard.reduce_op=sum"])
    assert run_extra(cfg, 2)["fully_shard"] == {
        "reduce_op": "sum", "gradient_scaling_factor": 1.0, "reduce_dtype": "float32",
        "param_dtype": None, "apply_grad_on_fp32_main_grad": True, "mesh_shape": [2]}


@pytest.mark.parametrize("override, needle", FULLY_SHARD_CHANGES,
                         ids=[o.split("=")[0].split(".")[1] for o, _ in FULLY_SHARD_CHANGES])
def test_a_resume_with_other_fully_shard_settings_is_refused_before_launch(
        tmp_path, capsys, override, needle):
    cfg = load_config(TINY, ["train.steps=4"])
    path = _save(tmp_path, 2, extra=run_extra(cfg, 2))
    line = _one_error_line(capsys, "train", "--config", str(TINY), "--set", "train.steps=4",
                           "--set", f"train.resume_from={path}", "--set", override)
    assert line.startswith("gradpool train: cannot resume: ") and needle in line, line
    assert "(or start a new run without train.resume_from)" in line


def test_a_checkpoint_without_fully_shard_settings_is_accepted_with_a_warning(caplog):
    cfg = load_config(TINY, ["train.steps=4"])
    extra = run_extra(cfg, 2)
    del extra["fully_shard"]
    with caplog.at_level(logging.WARNING, logger="gradpool.app.checkpoints"):
        check_resume(load_config(TINY, ["train.steps=4", "fully_shard.reduce_op=sum"]),
                     CheckpointInfo(Path("c"), 2, extra, 2, 1), 2)
    assert "records no fully_shard settings" in caplog.text
    assert "fully_shard.reduce_op" in caplog.text
    with pytest.raises(StateMismatchError, match="fully_shard.reduce_op"):
        check_resume(load_config(TINY, ["train.steps=4", "fully_shard.reduce_op=sum"]),
                     CheckpointInfo(Path("c"), 2, run_extra(cfg, 2), 2, 1), 2)


# Ranks that resumed different steps all fail: at 2 real msrun ranks in
# tests/distributed/checkpoint_cases.py (w2_ranks_that_resumed_different_steps_all_fail).
