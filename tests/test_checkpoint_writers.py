"""One checkpoint directory, one writer at a time (issue 37): two processes save into one
directory at once while this one loads from it in a loop. Before the directory lock, the
exclusive generation and per-writer temporary names, such a run lost saves, committed one
writer's index over the other's files (a load returned values of another step) and once an
unparsable index. Now every save commits or raises a CheckpointError naming the other writer,
and every load returns the values of the step it reports. A few seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradpool.errors import CheckpointError
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from concurrent_save_worker import Small, set_step  # noqa: E402

SAVES = 40


def test_two_writers_and_a_reader_never_mix_two_saves(tmp_path):
    root, go = tmp_path / "ck", tmp_path / "go"
    set_step(model := Small(), 1)
    checkpoint.save(root, model, step=1)             # something to load from the start
    writers = [subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "concurrent_save_worker.py"), str(root),
         str(writer), str(SAVES), str(go), str(tmp_path / f"writer{writer}.json")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE,
        text=True) for writer in (1, 2)]
    go.touch()
    loads, refused = {}, []
    reader = Small()
    while any(w.poll() is None for w in writers) or not loads:
        try:
            step = checkpoint.load(root, reader)["step"]
        except CheckpointError as exc:
            refused.append(str(exc))
            continue
        for name, param in reader.parameters_dict().items():
            np.testing.assert_array_equal(param.asnumpy(), np.full(param.shape, step,
                                                                   param.asnumpy().dtype),
                                          err_msg=f"{name} after a load of step {step}")
        loads[step] = loads.get(step, 0) + 1
    for w in writers:
        assert w.wait(timeout=120) == 0, w.stderr.read()[-3000:]
    outcomes = [json.loads((tmp_path / f"writer{n}.json").read_text()) for n in (1, 2)]
    committed = sum(o == "committed" for out in outcomes for o in out)
    for message in (o for out in outcomes for o in out if o != "committed"):
        assert "is being saved by another writer (pid " in message, message
    assert committed >= 2 and len(loads) >= 2, (outcomes, loads)
    assert not refused, refused[:3]     # a replaced save is re-read, not failed
    # what is left: the newest committed save, loadable, and nothing else
    assert [p.name for p in root.glob("gen-*")] == [files.generation_dir(root, files.read_index(
        root).generation).name]
    assert not list(root.rglob("*.tmp"))
    final = Small()
    step = checkpoint.load(root, final)["step"]
    np.testing.assert_array_equal(final.w.asnumpy(), np.full((64, 64), step, np.float32))


def test_a_second_writer_is_refused_naming_the_holder(tmp_path):
    root = tmp_path / "ck"
    set_step(model := Small(), 3)
    checkpoint.save(root, model, step=3)
    with files.DirectoryLock(root, "pid 4242 on elsewhere, save 00ff"):
        set_step(model, 4)
        with pytest.raises(CheckpointError, match=r"is being saved by another writer \(pid "
                                                  r"4242 on elsewhere, save 00ff\)"):
            checkpoint.save(root, model, step=4)
    assert [p.name for p in root.glob("gen-*")] == ["gen-00000001"]
    other = Small()
    assert checkpoint.load(root, other)["step"] == 3
    np.testing.assert_array_equal(other.w.asnumpy(), np.full((64, 64), 3, np.float32))
    checkpoint.save(root, model, step=4)       # the lock is free again
    assert checkpoint.load(root, other)["step"] == 4


def test_a_generation_is_reserved_by_one_writer_only(tmp_path):
    """Two reservations in a row (as two writers racing would make them) get two generations;
    cleanup after a commit removes only older ones."""
    root = tmp_path / "ck"
    root.mkdir()
    first, second = files.reserve_generation(root), files.reserve_generation(root)
    assert (first, second) == (1, 2)
    third = files.reserve_generation(root)
    files.remove_superseded(root, second)
    assert sorted(p.name for p in root.glob("gen-*")) == [files.generation_dir(root, n).name
                                                          for n in (second, third)]
