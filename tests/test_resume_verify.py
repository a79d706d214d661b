"""The launcher's pre-launch check of ``train.resume_from`` verifies every checksum (issue 37):
a flipped byte of tensor data in a rank file (same size, header intact, so only a checksum can
see it) is exit 2 with one line naming the file and the tensor, before any log directory or
rank exists. The opt-out (``--no-verify`` / ``train.verify_checkpoint: false``, and
``gradpool export --no-verify``) is said on stdout, never silent. In one process: the
checkpoint is saved by the unsharded tiny model with the run's ``extra``, and the launch itself
is replaced by a stub that records the config it was given (nothing here needs a rank).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import mindspore as ms
import pytest

from gradpool.app import checkpoints, job
from gradpool.app.cli import EXIT_OK, EXIT_USAGE, main
from gradpool.app.config import load_config
from gradpool.app.model import TinyDeepSeekV3
from gradpool.app.train import optimizer_for
from hyper_parallel import checkpoint

ms.set_device("CPU")
ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "deepseek3_tiny.yaml"
FAST = 5.0          # seconds: the check reads a 0.3 MiB checkpoint


@pytest.fixture
def step2(tmp_path):
    """A committed step-2 checkpoint of the tiny config at 2 ranks, as gradpool train saves it."""
    cfg = load_config(TINY)
    model = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
    optimizer = optimizer_for(cfg, model.trainable_params())
    path = checkpoints.step_dir(tmp_path / "ck", 2)
    checkpoint.save(path, model, optimizer, step=2, extra=checkpoints.run_extra(cfg, 2))
    return path


@pytest.fixture
def launches(monkeypatch):
    """The configs the launcher would have launched with (the launch is stubbed)."""
    seen = []

    def fake_run_job(cfg, **kwargs):
        seen.append(cfg)
        raise job.TrainJobError("stopped by the test before any rank", "")
    monkeypatch.setattr(job, "run_job", fake_run_job)
    return seen


def flip_tensor_byte(root: Path) -> tuple[Path, str]:
    """Flip one bit inside the data of one tensor of rank 0's file: size and header unchanged."""
    path = next(root.glob("gen-*/rank-00000.safetensors"))
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    key = sorted(k for k in header if k.startswith("model/"))[0]
    begin, end = header[key]["data_offsets"]
    data[8 + length + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return path, key


def _train(*sets: str, flags=()) -> list:
    argv = ["train", "--config", str(TINY), *flags]
    for item in sets:
        argv += ["--set", item]
    return argv


def test_a_flipped_byte_under_resume_from_is_exit_2_in_one_line_before_any_rank(
        step2, launches, capsys, tmp_path):
    main(_train(f"train.resume_from={step2}", f"launch.log_dir={tmp_path / 'logs'}"))
    assert len(launches) == 1, capsys.readouterr()      # intact: it would launch
    assert f"resuming from {step2} at step 2" in capsys.readouterr().out
    path, key = flip_tensor_byte(step2)
    start = time.monotonic()
    assert main(_train(f"train.resume_from={step2}",
                       f"launch.log_dir={tmp_path / 'logs2'}")) == EXIT_USAGE
    assert time.monotonic() - start < FAST
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("gradpool train: cannot resume: "), err
    assert str(path) in err[0] and f"tensor {key}" in err[0] and "checksum" in err[0], err
    assert len(launches) == 1 and "logs in" not in captured.out
    assert not (tmp_path / "logs2").exists()


def test_latest_passes_over_a_newest_checkpoint_whose_checksum_fails(step2, launches, capsys):
    cfg = load_config(TINY)
    model = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
    step4 = checkpoints.step_dir(step2.parent, 4)
    checkpoint.save(step4, model, optimizer_for(cfg, model.trainable_params()), step=4,
                    extra=checkpoints.run_extra(cfg, 2))
    path, key = flip_tensor_byte(step4)
    main(_train(f"train.save_dir={step2.parent}", "train.resume_from=latest"))
    out = capsys.readouterr().out
    assert "skipped step-00000004: damaged (" in out and str(path) in out and key in out, out
    assert launches[-1].train.resume_from == str(step2)


@pytest.mark.parametrize("how", [["--no-verify"], ["--set", "train.verify_checkpoint=false"]],
                         ids=["flag", "key"])
def test_the_opt_out_is_said_and_reaches_the_ranks(step2, launches, capsys, how):
    flip_tensor_byte(step2)
    main(_train(f"train.resume_from={step2}", flags=how))
    out = capsys.readouterr().out
    assert (f"gradpool train: train.verify_checkpoint = false: the checksums of {step2} are not "
            "verified (trusted storage), here or by the ranks") in out, out
    assert len(launches) == 1 and launches[0].train.verify_checkpoint is False


def test_export_no_verify_skips_the_checksums_and_says_so(step2, capsys, tmp_path):
    path, key = flip_tensor_byte(step2)
    out = tmp_path / "model.safetensors"
    assert main(["export", "--checkpoint", str(step2), "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert str(path) in err and key in err and not out.exists()
    assert main(["export", "--checkpoint", str(step2), "--out", str(out),
                 "--no-verify"]) == EXIT_OK
    said = capsys.readouterr().out
    assert f"gradpool export: --no-verify: the checksums of {step2} are not verified" in said
    assert out.is_file()
