"""Asynchronous checkpoint saves and ``checkpoint.latest`` in one process (issue 37).

``save(..., async_save=True)`` returns once the state is copied to host memory; the file is
written on a background thread and the save is committed at the next wait point (the next
save, a load, ``wait()``, the handle's ``wait()``). Checked here against a synchronous save
of the same state (the same bytes on disk, save id aside), against the values the model held
when the save was called (the model changes right after it returns), and for a write that fails
in the background (raised at the wait, naming the file). The 2-rank runs of ``gradpool train``
with ``train.async_save`` are in tests/test_kill_during_save.py.
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from gradpool.app.config import from_dict
from gradpool.app.model import TinyDeepSeekV3, next_token_loss
from gradpool.app.train import _batch, optimizer_for
from gradpool.errors import CheckpointError, InvalidArgumentError
from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import files, saving

ms.set_device("CPU")
CFG = from_dict({}, ["model.num_experts=3"])


def _trained(seed: int, steps: int = 2):
    model = TinyDeepSeekV3(CFG.model, seed=seed)
    params = model.trainable_params()
    opt = optimizer_for(CFG, params)
    grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
    for step in range(steps):
        _, grads = grad_fn(_batch(CFG, step, 0, 0, 1))
        opt(grads)
    return model, opt


def _values(*cells) -> dict:
    return {k: p.asnumpy().copy() for cell in cells for k, p in cell.parameters_dict().items()}


def _assert_same_bits(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key].reshape(-1).view(np.uint8),
                                      want[key].reshape(-1).view(np.uint8), err_msg=key)


def _index(root: Path) -> dict:
    return json.loads((root / files.INDEX).read_text())


def _disturb(model, opt, step: int = 5) -> None:
    """One more training step: the optimizer changes the parameters and its states in place,
    in the memory a save that did not copy would still be reading."""
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
    _, grads = grad_fn(_batch(CFG, step, 0, 0, 1))
    opt(grads)


@pytest.fixture(autouse=True)
def _no_pending_save_left():
    yield
    assert checkpoint.pending() is None or checkpoint.pending().committed()


def test_an_async_save_writes_the_bytes_a_synchronous_save_writes(tmp_path):
    model, opt = _trained(seed=3)
    sync = checkpoint.save(tmp_path / "sync", model, opt, step=2, extra={"lr": 1e-3})
    handle = checkpoint.save(tmp_path / "async", model, opt, step=2, extra={"lr": 1e-3},
                             async_save=True)
    assert isinstance(handle, checkpoint.AsyncSave)
    done = handle.wait()
    assert done.asynchronous and not sync.asynchronous
    assert (done.step, done.generation, done.bytes_written, done.total_bytes) == \
        (sync.step, sync.generation, sync.bytes_written, sync.total_bytes)
    a, b = _index(tmp_path / "sync"), _index(tmp_path / "async")
    sync_id, async_id = a.pop("save_id"), b.pop("save_id")
    assert sync_id != async_id                       # each save draws its own id
    assert a == b                                    # every checksum, size, piece and extra
    name = files.rank_file(sync.generation, 0)
    got_header, got_data = _split((tmp_path / "async" / name).read_bytes())
    want_header, want_data = _split((tmp_path / "sync" / name).read_bytes())
    assert got_data == want_data                     # every tensor byte, in the same order
    # the header's metadata order is the writer's hash map's (it differs between any two saves,
    # synchronous or not): compared as JSON, save id aside
    assert got_header["__metadata__"].pop("gradpool.save_id") == async_id
    assert want_header["__metadata__"].pop("gradpool.save_id") == sync_id
    assert got_header == want_header


def _split(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (parsed) and its data section."""
    length = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + length]), data[8 + length:]


def test_the_async_save_holds_the_values_of_its_call_and_commits_only_at_the_wait(
        tmp_path, monkeypatch):
    model, opt = _trained(seed=4)
    checkpoint.save(tmp_path / "ck", model, opt, step=1)           # the committed one before
    _disturb(model, opt)
    want = _values(model, opt)
    # the background write starts only once training changed the state (else a fast write
    # could finish first and hide a save that reads the live tensors)
    gate, write = threading.Event(), files.write_rank_file
    monkeypatch.setattr(files, "write_rank_file", lambda *a: gate.wait(30) and write(*a))
    handle = checkpoint.save(tmp_path / "ck", model, opt, step=2, async_save=True)
    _disturb(model, opt)                   # training goes on at once; the snapshot is its own
    assert not handle.done()
    gate.set()
    while not handle.done():
        time.sleep(0.01)
    # written but not committed: the index still names step 1, whose values load
    assert _index(tmp_path / "ck")["step"] == 1 and not handle.committed()
    assert checkpoint.pending() is handle
    result = checkpoint.wait()
    assert result.step == 2 and handle.committed() and checkpoint.pending() is None
    assert handle.wait() is result                                  # again: the same result
    fresh, fresh_opt = _trained(seed=9, steps=1)
    assert checkpoint.load(tmp_path / "ck", fresh, fresh_opt)["step"] == 2
    _assert_same_bits(_values(fresh, fresh_opt), want)


def test_the_next_save_and_a_load_are_wait_points(tmp_path):
    model, opt = _trained(seed=5)
    first = checkpoint.save(tmp_path / "a", model, opt, step=1, async_save=True)
    checkpoint.save(tmp_path / "b", model, opt, step=1)             # commits "a" first
    assert first.committed() and _index(tmp_path / "a")["step"] == 1
    second = checkpoint.save(tmp_path / "c", model, opt, step=2, async_save=True)
    assert not (tmp_path / "c" / files.INDEX).exists()
    fresh, fresh_opt = _trained(seed=6, steps=1)
    assert checkpoint.load(tmp_path / "c", fresh, fresh_opt)["step"] == 2   # waits, then reads
    assert second.committed()
    assert checkpoint.wait() is None                                 # nothing pending


def test_a_failed_background_write_raises_at_the_wait_naming_the_file(tmp_path, monkeypatch):
    model, opt = _trained(seed=7)
    checkpoint.save(tmp_path / "ck", model, opt, step=1)
    want = _values(model, opt)

    def full_disk(arrays, path, metadata=None):
        raise OSError(28, "No space left on device", path)
    monkeypatch.setattr(files, "save_file", full_disk)
    handle = checkpoint.save(tmp_path / "ck", model, opt, step=2, async_save=True)  # no raise
    rank_file = tmp_path / "ck" / files.rank_file(handle._save.generation, 0)
    with pytest.raises(CheckpointError, match=rf"writing {rank_file} failed on rank 0: "
                                              r"OSError.*No space left on device"):
        checkpoint.wait()
    with pytest.raises(CheckpointError, match="No space left"):     # the handle keeps it
        handle.wait()
    monkeypatch.undo()
    fresh, fresh_opt = _trained(seed=8, steps=1)
    assert checkpoint.load(tmp_path / "ck", fresh, fresh_opt)["step"] == 1
    _assert_same_bits(_values(fresh, fresh_opt), want)
    # the lock was released: the next save commits
    assert checkpoint.save(tmp_path / "ck", model, opt, step=3, async_save=True).wait().step == 3


def test_async_save_takes_a_bool(tmp_path):
    model, _ = _trained(seed=1, steps=0)
    with pytest.raises(InvalidArgumentError, match="async_save"):
        checkpoint.save(tmp_path / "ck", model, async_save="yes")


# -- latest ---------------------------------------------------------------------------------------
def _flip_tensor_byte(root: Path) -> tuple[Path, str]:
    """Flip one byte inside the data of the first tensor of rank 0's file (same size, header
    intact): only a checksum can see it."""
    path = next(root.glob("gen-*/rank-00000.safetensors"))
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    key = sorted(k for k in header if k != "__metadata__")[0]
    begin = 8 + length + header[key]["data_offsets"][0]
    data[begin + 3] ^= 0x04
    path.write_bytes(bytes(data))
    return path, key


def test_latest_is_the_newest_committed_intact_step(tmp_path):
    model, opt = _trained(seed=2, steps=1)
    assert checkpoint.latest(tmp_path / "none") is None
    assert checkpoint.latest(tmp_path) is None
    for step in (2, 4, 6):
        checkpoint.save(checkpoint.step_dir(tmp_path, step), model, opt, step=step)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000006"
    flipped, _ = _flip_tensor_byte(tmp_path / "step-00000006")
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000004"          # verified
    assert checkpoint.latest(tmp_path, verify=False) == tmp_path / "step-00000006"
    pending = checkpoint.save(checkpoint.step_dir(tmp_path, 8), model, opt, step=8,
                              async_save=True)
    while not pending.done():
        time.sleep(0.01)
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000004"   # 8: not committed yet
    pending.wait()
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000008"
    shutil.copytree(tmp_path / "step-00000008", tmp_path / "step-00000010")  # holds step 8
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000008"
    for step in (2, 4, 8, 10):
        shutil.rmtree(checkpoint.step_dir(tmp_path, step))
    with pytest.raises(CheckpointError, match=rf"every committed checkpoint under {tmp_path} "
                                              rf"is damaged \(step-00000006: .*{flipped}"):
        checkpoint.latest(tmp_path)
