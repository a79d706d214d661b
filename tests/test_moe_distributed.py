"""Expert parallelism on real msrun ranks against the E=1 model unsharded in one process: ONE
launch per world size runs every case of tests/distributed/moe_cases.py (2 ranks: EP 2) and
tests/distributed/moe_cases_4.py (4 ranks: EP 2 x FSDP 2, EP 4, HSDP (2, 2) with EP 2); and the
main job, ``gradpool train --set model.expert_parallel=2 --reference``, in both gradient modes."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[1]
REFERENCE_LINE = re.compile(r"^reference: largest loss difference (\S+) absolute, (\S+) relative",
                            re.M)


class TestMoEOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "moe_cases.py", 2, 1200, True


class TestMoEOn4Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "moe_cases_4.py", 4, 1800, True


@pytest.mark.parametrize("extra", [["fully_shard.apply_grad_on_fp32_main_grad=true"],
                                   ["fully_shard.apply_grad_on_fp32_main_grad=false",
                                    "train.micro_steps=2", "fully_shard.comm_fusion=true"]],
                         ids=["main_grad", "plain_micro_steps_fused"])
def test_the_main_job_with_expert_parallelism_matches_its_reference(extra):
    """SGD at a large learning rate, so an expert gradient off by a factor shows in the losses
    (Adam would mostly hide it)."""
    run = subprocess.run(
        [sys.executable, "-m", "gradpool", "train", "--config", "configs/deepseek3_tiny.yaml",
         "--set", "model.expert_parallel=2", "--set", "launch.ranks=2", "--set", "train.steps=3",
         "--set", "train.optimizer=sgd", "--set", "train.learning_rate=0.5",
         *[arg for key in extra for arg in ("--set", key)], "--reference"],
        cwd=ROOT, text=True, capture_output=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "ranks: 2 on 1 node(s), every one ok" in run.stdout
    abs_diff, rel_diff = map(float, REFERENCE_LINE.search(run.stdout).groups())
    assert rel_diff <= 1e-5 and abs_diff <= 1e-4, run.stdout
