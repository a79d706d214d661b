"""``gradpool train`` saves and resumes; ``gradpool export`` writes the model for inference.

Three msrun launches of ``gradpool train`` (~14 s each on 2 cores): a 2-rank run of 4 steps
saving after steps 2 and 4, then two runs resumed from its step 2, at 2 ranks (steps 3-4 and the
state they end in must equal the uninterrupted run's bit for bit) and at 1 rank (the same global
batch; losses within 1e-6 relative: the reduction order differs). The losses
come from rank 0's report (``job_steps``), not from the printed lines. The rest runs in this
process: refusals before any launch, the export and plain MindSpore loading it.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from gradpool.app import job
from gradpool.app.checkpoints import (CheckpointInfo, check_resume, run_extra, save_due,
                                      step_dir)
from gradpool.app.cli import EXIT_OK, EXIT_USAGE, main
from gradpool.app.config import load_config
from gradpool.app.model import TinyDeepSeekV3
from gradpool.app.train import optimizer_for, train_reference
from gradpool.errors import StateMismatchError
from gradpool.app.errors import ConfigValueError
from test_cli import STEP_LINE, TINY, _cli

# Before any kernel runs here: a later in-process `gradpool train` (tests/test_cli.py) sets the
# device again, which MindSpore allows only when it was set before the runtime started.
ms.set_device("CPU")
STEPS = ["--set", "train.steps=4"]
SAVED_LINE = re.compile(r"^saved step (\d+) to (\S+) \((\S+ \S+), (\S+) s\)$", re.M)


def _train(log_dir: Path, *overrides: str):
    sets = [item for o in (*overrides, f"launch.log_dir={log_dir}") for item in ("--set", o)]
    run = _cli("train", "--config", str(TINY), *STEPS, *sets)
    assert run.returncode == EXIT_OK, run.stdout + run.stderr[-4000:]
    return run.stdout, {s.step: s for s in job.read_job_steps(log_dir)}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The uninterrupted 2-rank run: 4 steps, checkpoints after steps 2 and 4."""
    base = tmp_path_factory.mktemp("first")
    out, steps = _train(base / "logs", f"train.save_dir={base / 'ckpt'}", "train.save_every=2")
    return {"out": out, "steps": steps, "save_dir": base / "ckpt", "logs": base / "logs"}


def _state(path: Path) -> dict:
    """Model and optimizer state of a checkpoint, loaded into an unsharded model in this
    process (initialised from another seed, so nothing matches by accident)."""
    from hyper_parallel import checkpoint
    cfg = load_config(TINY)
    model = TinyDeepSeekV3(cfg.model, seed=99)
    optimizer = optimizer_for(cfg, model.trainable_params())
    checkpoint.load(path, model, optimizer)
    tensors = {**model.parameters_dict(), **optimizer.parameters_dict()}
    return {name: tensor.asnumpy().copy() for name, tensor in tensors.items()}


def _assert_same_bits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype and \
            got[name].tobytes() == want[name].tobytes(), name


# -- when and where a run saves ----------------------------------------------------------------
def test_saves_every_n_steps_and_after_the_last():
    cfg = load_config(TINY, ["train.steps=5", "train.save_dir=c", "train.save_every=2"])
    assert [k for k in range(1, 6) if save_due(cfg, k)] == [2, 4, 5]
    cfg = load_config(TINY, ["train.steps=5", "train.save_dir=c"])
    assert [k for k in range(1, 6) if save_due(cfg, k)] == [5]
    assert not any(save_due(load_config(TINY), k) for k in range(1, 6))
    assert step_dir("c", 4) == Path("c/step-00000004")


@pytest.mark.distributed
def test_the_run_saves_at_the_steps_asked_and_says_so(first_run):
    out, steps, save_dir = first_run["out"], first_run["steps"], first_run["save_dir"]
    assert [s[0] for s in STEP_LINE.findall(out)] == ["1", "2", "3", "4"]   # format kept
    saved = SAVED_LINE.findall(out)
    assert [(s[0], s[1]) for s in saved] == [("2", str(save_dir / "step-00000002")),
                                            ("4", str(save_dir / "step-00000004"))]
    assert all(float(s[3]) > 0 and s[2].endswith("KiB") for s in saved)
    assert sorted(p.name for p in save_dir.iterdir()) == ["step-00000002", "step-00000004"]
    assert [s.step for s in steps.values() if s.saved] == [1, 3]   # 0-based step of the save
    assert steps[3].saved["bytes"] > 0 and steps[3].saved["path"] == str(save_dir / "step-00000004")
    assert re.search(r"^saved 2 checkpoints \(steps 2, 4\): \S+ \S+, \S+ s in all; the last is "
                     + re.escape(str(save_dir / "step-00000004")) + "$", out, re.M), out
    # each rank's own log says it too, next to its mindformers-style step line
    worker = (first_run["logs"] / "worker_1.log").read_text()
    assert re.search(r"^saved step 4 to \S+step-00000004 \(\d+ B, \S+ s\)$", worker, re.M)


# -- resume --------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_a_resumed_run_continues_bit_for_bit_at_the_same_world_size(first_run, tmp_path):
    resume_from = first_run["save_dir"] / "step-00000002"
    out, steps = _train(tmp_path / "logs", f"train.resume_from={resume_from}",
                        f"train.save_dir={tmp_path / 'ckpt'}")
    first = first_run["steps"]
    assert sorted(steps) == [2, 3]
    assert [steps[k].loss for k in (2, 3)] == [first[k].loss for k in (2, 3)]
    # the state it ends in, model and Adam's (moments, step count, beta powers), bit for bit
    _assert_same_bits(_state(tmp_path / "ckpt" / "step-00000004"),
                      _state(first_run["save_dir"] / "step-00000004"))
    assert f"gradpool train: resuming from {resume_from} at step 2 of 4 (saved at 2 rank(s))" in out
    assert [s[0] for s in STEP_LINE.findall(out)] == ["3", "4"]
    assert re.search(r"^summary: 2 steps \(steps 3-4\), .* 0 new allocations after step 3, ", out,
                     re.M), out
    assert re.search(rf"^resumed from {re.escape(str(resume_from))} at step 2 \(saved at 2 "
                     r"rank\(s\)\): \S+ \S+ read by 2 rank\(s\), \S+ s$", out, re.M), out


@pytest.mark.distributed
def test_a_run_resumed_at_another_world_size_continues_within_1e_6(first_run, tmp_path):
    # 1 rank (the cheapest other world size to launch; 2 -> 4 loads are checked tensor by tensor
    # in tests/test_checkpoint_distributed.py): the same global batch of 8 sequences, 8 per rank
    out, steps = _train(tmp_path / "logs", f"train.resume_from={first_run['save_dir']}"
                        "/step-00000002", "launch.ranks=1", "model.batch_size=8")
    first = first_run["steps"]
    assert sorted(steps) == [2, 3]
    for k in (2, 3):
        assert steps[k].loss == pytest.approx(first[k].loss, rel=1e-6, abs=0)
    assert "read by 1 rank(s)" in out


@pytest.mark.distributed
def test_a_run_resumed_with_expert_parallelism_continues_within_1e_6(first_run, tmp_path):
    # saved with every expert on every rank; resumed with EP 2 (each rank computes and holds 2
    # of the 4 experts): the same training, the expert sums in another order
    out, steps = _train(tmp_path / "logs", f"train.resume_from={first_run['save_dir']}"
                        "/step-00000002", "model.expert_parallel=2")
    first = first_run["steps"]
    assert sorted(steps) == [2, 3]
    for k in (2, 3):
        assert steps[k].loss == pytest.approx(first[k].loss, rel=1e-6, abs=0)
    assert "read by 2 rank(s)" in out


def _refused(capsys, *overrides: str) -> str:
    """``gradpool train`` refusing before it launches anything: exit 2, one line."""
    sets = [item for o in overrides for item in ("--set", o)]
    code = main(["train", "--config", str(TINY), *STEPS, *sets])
    captured = capsys.readouterr()
    assert code == EXIT_USAGE and captured.out == "", captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.distributed
@pytest.mark.parametrize("overrides, needles", [
    (["train.resume_from={ckpt}/step-00000009"], ["step-00000009 holds no checkpoint"]),
    (["train.resume_from={ckpt}/step-00000004"],
     ["holds step 4 and train.steps = 4: nothing is left to train", "above 4"]),
    (["train.resume_from={ckpt}/step-00000002", "model.hidden_size=64"],
     ["model.hidden_size = 32, this run has 64"]),
    (["train.resume_from={ckpt}/step-00000002", "launch.ranks=4"],
     ["global batch of 8 sequences", "set model.batch_size = 2"]),
    (["train.resume_from={ckpt}/step-00000002", "train.seed=7"],
     ["train.seed = 1234, this run has 7"]),
    (["train.resume_from={ckpt}/step-00000002", "train.optimizer=sgd"],
     ["train.optimizer = 'adam', this run has 'sgd'"]),
], ids=["missing", "no steps left", "model", "global batch", "seed", "optimizer"])
def test_a_resume_that_cannot_continue_is_refused_before_launch(first_run, capsys, overrides,
                                                                 needles):
    line = _refused(capsys, *(o.format(ckpt=first_run["save_dir"]) for o in overrides))
    assert line.startswith("gradpool train: cannot resume: ")
    for needle in needles:
        assert needle in line


def test_resume_checks_refuse_foreign_checkpoints_and_name_the_fix():
    cfg = load_config(TINY, ["train.steps=4"])
    saved = CheckpointInfo(Path("c"), 2, run_extra(cfg, 2), 2, 1)
    check_resume(cfg, saved, 2)                                   # the same run: fine
    with pytest.raises(StateMismatchError, match="not written by gradpool train"):
        check_resume(cfg, CheckpointInfo(Path("c"), None, None, 2, 1), 2)
    with pytest.raises(StateMismatchError, match="no model.batch_size gives 8 at 3 ranks"):
        check_resume(cfg, saved, 3)
    with pytest.raises(ConfigValueError, match="nothing is left to train") as info:
        check_resume(load_config(TINY, ["train.steps=2"]), saved, 2)
    assert info.value.key == "train.steps"


def test_an_unwritable_save_dir_is_refused_before_launch(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = _refused(capsys, f"train.save_dir={blocker / 'ckpt'}")
    assert f"train.save_dir = '{blocker / 'ckpt'}' cannot be written" in line


# -- export --------------------------------------------------------------------------------------
@pytest.mark.distributed
def test_export_writes_what_plain_mindspore_loads_into_the_unsharded_model(first_run, tmp_path,
                                                                          capsys):
    checkpoint = first_run["save_dir"] / "step-00000004"
    out = tmp_path / "export" / "model.safetensors"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert printed.startswith(f"gradpool export: wrote {out}: 41 tensors, ")
    assert f"(step 4 of {checkpoint}, saved at 2 rank(s))" in printed

    cfg = load_config(TINY)
    model = TinyDeepSeekV3(cfg.model, seed=99)
    untrained = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    not_loaded = ms.load_param_into_net(model, ms.load_checkpoint(str(out), format="safetensors"))
    assert not_loaded == ([], [])
    exported = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    saved = _state(checkpoint)
    _assert_same_bits(exported, {name: saved[name] for name in exported})
    assert not any(np.array_equal(exported[n], untrained[n]) for n in ("embed", "head"))
    # and it is the trained model: the unsharded reference run on the same batches ends there
    _, reference = train_reference(load_config(TINY, ["train.steps=4"]), world=2)
    for name, values in reference.items():
        np.testing.assert_allclose(exported[name], values, rtol=0, atol=1e-5, err_msg=name)


def _export_refused(capsys, checkpoint, out) -> str:
    code = main(["export", "--checkpoint", str(checkpoint), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == EXIT_USAGE and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradpool export: "), captured.err
    return lines[0]


@pytest.mark.distributed
def test_export_of_a_missing_or_corrupt_checkpoint_is_one_line(first_run, tmp_path, capsys):
    out = tmp_path / "model.safetensors"
    assert "holds no checkpoint" in _export_refused(capsys, tmp_path / "nothing", out)
    broken = tmp_path / "broken"
    shutil.copytree(first_run["save_dir"] / "step-00000004", broken)
    rank_file = sorted(broken.glob("gen-*/rank-00001.safetensors"))[0]
    rank_file.write_bytes(rank_file.read_bytes()[:1000])
    line = _export_refused(capsys, broken, out)
    assert str(rank_file) in line and "truncated" in line
    (broken / "index.json").write_text('{"format": ')
    assert "index.json cannot be read" in _export_refused(capsys, broken, out)
    assert "is a directory" in _export_refused(capsys, first_run["save_dir"] / "step-00000004",
                                               tmp_path)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))
