"""Two nodes on one host: two `gradpool train` processes (nodes: 2, one rank each, master
127.0.0.1), as two machines would run them. Both exit 0, node 0 prints the whole job (both
ranks), each node writes only its own node<k>/ directory, every rank's log holds its step lines,
and the plan's per-rank pool high-water is what each rank measured. And a node whose peer never
comes up fails within launch.cluster_timeout_s, saying so."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradpool.app import rank_report
from gradpool.app.config import load_config
from gradpool.app.launch import free_port
from gradpool.app.plan import plan_memory

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "deepseek3_tiny.yaml"
STEPS = 2
RANK_LINE = re.compile(r"^  rank (\d+) \(node (\d+)\): (\d+) steps, pool high-water (\S+ \S+), ",
                       re.M)
WORKER_STEP = re.compile(r"^step (\d+)/(\d+) loss \S+ time \S+ ms lr \S+ rank (\d+)/2 ", re.M)

pytestmark = pytest.mark.distributed


def _train(*overrides: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "gradpool", "train", "--config", str(TINY)]
    for item in overrides:
        argv += ["--set", item]
    return subprocess.Popen(argv, cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _kib(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[unit]


def test_two_nodes_on_one_host_train_and_node_0_reports_both_ranks(tmp_path):
    common = ["launch.nodes=2", "launch.ranks=2", f"launch.master_port={free_port()}",
              "launch.master_addr=127.0.0.1", f"launch.log_dir={tmp_path}",
              f"train.steps={STEPS}", "launch.cluster_timeout_s=120",
              "launch.launch_blocking=false"]     # a job on msrun ranks with async launch
    start = time.monotonic()
    node0 = _train(*common, "launch.node_rank=0")
    node1 = _train(*common, "launch.node_rank=1")
    out0, err0 = node0.communicate(timeout=600)
    out1, err1 = node1.communicate(timeout=600)
    seconds = time.monotonic() - start
    print(f"2-node run: {seconds:.1f} s wall")
    assert node0.returncode == 0, out0 + err0[-4000:]
    assert node1.returncode == 0, out1 + err1[-4000:]

    # node 0: the job's step lines and a summary covering both ranks
    assert out0.index("logs in") < out0.index("step 1/")        # printed before the launch
    assert [m for m in re.findall(r"^step (\d+)/(\d+)", out0, re.M)] == [("1", "2"), ("2", "2")]
    ranks = RANK_LINE.findall(out0)
    assert [(r[0], r[1], r[2]) for r in ranks] == [("0", "0", "2"), ("1", "1", "2")], out0
    assert "ranks: 2 on 2 node(s), every one ok" in out0
    assert "op launch: asynchronous (2 rank(s); launch.launch_blocking)" in out0
    assert re.search(r"^gradient integrity: \d+ gradients verified unchanged after their reduce "
                     r"path \(all 2 ranks\)$", out0, re.M)
    # node 1: its own ranks, no job summary
    assert "node 1: ranks 1 finished 2 steps each, ok" in out1 and "summary:" not in out1

    # each node wrote its own directory only; msrun (scheduler) ran on node 0 only
    node0_dir, node1_dir = tmp_path / "node0", tmp_path / "node1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node0", "node1"]
    assert {"config.yaml", "msrun.log", "scheduler.log", "worker_0.log",
            "rank0.report.json"} <= {p.name for p in node0_dir.iterdir()}
    assert {p.name for p in node1_dir.iterdir()} == {"config.yaml", "worker_1.log",
                                                      "rank1.report.json"}
    assert rank_report.read_report(node1_dir, 1).exit_code == 0
    assert rank_report.read_report(node0_dir, 1) is None

    # every rank's own log has its step lines (mindformers style)
    for directory, rank in ((node0_dir, 0), (node1_dir, 1)):
        lines = WORKER_STEP.findall((directory / f"worker_{rank}.log").read_text())
        assert [(s, n, r) for s, n, r in lines] == [("1", "2", str(rank)), ("2", "2", str(rank))]

    # the plan at world 2 is what each rank's pool measured
    planned = plan_memory(load_config(TINY, ["launch.ranks=2"])).pool.high_water_bytes / 1024
    for rank in ranks:
        assert abs(_kib(rank[3]) - planned) <= 0.03 * planned, (rank, planned)


def test_a_node_whose_peer_never_comes_up_fails_within_the_cluster_timeout(tmp_path):
    timeout_s = 5
    start = time.monotonic()
    node0 = _train("launch.nodes=2", f"launch.master_port={free_port()}",
                   f"launch.log_dir={tmp_path}", f"launch.cluster_timeout_s={timeout_s}")
    out, err = node0.communicate(timeout=300)
    seconds = time.monotonic() - start
    assert node0.returncode == 1, out + err[-4000:]
    first = [line for line in err.splitlines() if line.startswith("gradpool train: FAILED")]
    assert first and "ClusterFormationError" in first[0], err[-4000:]
    assert f"did not form within launch.cluster_timeout_s = {timeout_s} s" in first[0]
    assert "launch.node_rank" in first[0]                  # says what the other nodes must do
    # startup (~10 s on a loaded 2-core host) + the timeout + the launcher's grace, not msrun's
    # own 600 s default nor the job timeout
    assert seconds < 90, seconds
