"""The README's fully_shard example runs as written: in one process and on 2 msrun ranks."""
import os
import pathlib
import subprocess
import sys

import pytest

from gradpool.app.launch import run_ranks

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fully_shard_mlp.py"


def _field(text: str, rank: int, name: str) -> list[float]:
    return [float(line.split(f" {name} ", 1)[1].split()[0]) for line in text.splitlines()
            if line.startswith(f"rank {rank}/") and f" {name} " in line]


def _losses(text: str, rank: int) -> list[float]:
    return _field(text, rank, "loss")


def _one_process_run(*args: str) -> str:
    out = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_example_in_one_process(tmp_path):
    out = _one_process_run(str(tmp_path / "ck"))
    losses = _losses(out, 0)
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert "rank 0 checkpoint:" in out and "step 6, identical True" in out, out[-2000:]


@pytest.mark.distributed
def test_example_on_two_msrun_ranks(tmp_path):
    result = run_ranks(EXAMPLE, [str(tmp_path / "ck")], nproc=2, log_dir=tmp_path, timeout=300)
    assert result.exit_codes == (0, 0)
    # clip_grad_norm_ on 2 ranks (uneven shards, a replicated bias) gives the norm of the
    # unsharded model's gradient: the one-process run's, step by step (clipping included)
    reference = _field(_one_process_run(), 0, "grad_norm")
    for rank in (0, 1):
        log = (tmp_path / f"worker_{rank}.log").read_text(errors="replace")
        losses = _losses(log, rank)
        assert len(losses) == 6 and losses[-1] < losses[0], log[-2000:]
        assert f"rank {rank}/2 step 6/6" in log
        assert f"rank {rank} checkpoint:" in log and "step 6, identical True" in log, log[-2000:]
        norms = _field(log, rank, "grad_norm")
        assert len(norms) == 6 and norms[0] > 1.0, "the first step is clipped"
        for got, want in zip(norms, reference):
            assert abs(got - want) <= 1e-5 * want, (norms, reference)
