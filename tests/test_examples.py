"""The README's fully_shard example runs as written: in one process and on 2 msrun ranks."""
import os
import pathlib
import subprocess
import sys

import pytest

from gradpool.app.launch import run_ranks

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fully_shard_mlp.py"


def _losses(text: str, rank: int) -> list[float]:
    return [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(f"rank {rank}/") and " loss " in line]


def test_example_in_one_process():
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(out.stdout, 0)
    assert len(losses) == 6 and losses[-1] < losses[0]


@pytest.mark.distributed
def test_example_on_two_msrun_ranks(tmp_path):
    result = run_ranks(EXAMPLE, nproc=2, log_dir=tmp_path, timeout=300)
    assert result.exit_codes == (0, 0)
    for rank in (0, 1):
        log = (tmp_path / f"worker_{rank}.log").read_text(errors="replace")
        losses = _losses(log, rank)
        assert len(losses) == 6 and losses[-1] < losses[0], log[-2000:]
        assert f"rank {rank}/2 step 6/6" in log
