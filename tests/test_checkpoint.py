"""Checkpoints in one process: the pure box geometry (property-tested against NumPy slicing),
state-dict and checkpoint round trips of unsharded models, refusals by name, interrupted saves
(a process SIGKILLed at each point of a save) and the export read back by plain MindSpore.
The cross-world-size and HSDP cases run on msrun ranks: tests/test_checkpoint_distributed.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mindspore import Parameter, nn

from gradpool.app.config import from_dict
from gradpool.app.model import TinyDeepSeekV3, next_token_loss
from gradpool.app.train import _batch, optimizer_for
from gradpool.errors import CheckpointError, InvalidArgumentError, StateMismatchError
from hyper_parallel import (ShardedTensor, checkpoint, get_model_state_dict,
                            get_optimizer_state_dict, set_model_state_dict,
                            set_optimizer_state_dict)
from hyper_parallel.core.dtensor.boxes import Box, check_cover, plan_reads, shard_box

ROOT = Path(__file__).resolve().parents[1]


# -- boxes -----------------------------------------------------------------------------------
@st.composite
def _tensor_and_two_layouts(draw):
    shape = tuple(draw(st.lists(st.integers(1, 7), min_size=1, max_size=3)))
    def layout():
        dim = draw(st.integers(0, len(shape) - 1))
        world = draw(st.integers(1, 6))
        return dim, world, -(-shape[dim] // world)
    return shape, layout(), layout()


@settings(max_examples=200, deadline=None)
@given(_tensor_and_two_layouts())
def test_reading_one_layout_into_another_rebuilds_every_shard(case):
    """Pieces saved under one layout (dim, world) fill every shard of another exactly."""
    shape, (dim_a, world_a, chunk_a), (dim_b, world_b, chunk_b) = case
    full = np.arange(int(np.prod(shape))).reshape(shape)
    pieces = [shard_box(shape, dim_a, chunk_a, r) for r in range(world_a)]
    check_cover("t", shape, pieces)
    for rank in range(world_b):
        target = shard_box(shape, dim_b, chunk_b, rank)
        out = np.full(target.lengths, -1)
        for index, part in plan_reads("t", shape, target, pieces):
            saved = full[pieces[index].slices()]           # what piece ``index`` holds
            out[part.slices(target)] = saved[part.slices(pieces[index])]
        np.testing.assert_array_equal(out, full[target.slices()])


def test_cover_refuses_a_gap_an_overlap_and_a_piece_outside():
    shape = (10, 3)
    halves = [shard_box(shape, 0, 5, 0), shard_box(shape, 0, 5, 1)]
    check_cover("t", shape, halves)
    with pytest.raises(CheckpointError, match="hold 25 of its 30"):
        check_cover("t", shape, [halves[0], Box((5, 0), (5, 2))])
    with pytest.raises(CheckpointError, match="overlap"):
        check_cover("t", shape, halves + [Box((4, 0), (1, 3))])
    with pytest.raises(CheckpointError, match="outside"):
        check_cover("t", shape, [Box((0, 0), (11, 3))])


def test_a_missing_part_is_refused_with_what_is_needed():
    with pytest.raises(StateMismatchError, match=r"hold 5 of the 10 .*offsets \(0,\)"):
        plan_reads("t", (10,), Box((0,), (10,)), [Box((0,), (5,))])


# -- round trips of an unsharded model --------------------------------------------------------
CFG = from_dict({}, ["model.num_experts=3"])


def _trained(seed: int, optimizer: str = "adam", steps: int = 2):
    cfg = from_dict({}, [f"train.optimizer={'sgd' if optimizer == 'sgd' else 'adam'}",
                         "model.num_experts=3"])
    model = TinyDeepSeekV3(cfg.model, seed=seed)
    params = model.trainable_params()
    if optimizer == "sgd":
        opt = nn.SGD(params, learning_rate=0.1, momentum=0.9)
    elif optimizer == "adamw":
        opt = nn.AdamWeightDecay(params, learning_rate=1e-3, weight_decay=0.01)
    else:
        opt = optimizer_for(cfg, params)
    grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
    for step in range(steps):
        _, grads = grad_fn(_batch(cfg, step, 0, 0, 1))
        opt(grads)
    return model, opt


def _values(cell) -> dict:
    return {k: p.asnumpy().copy() for k, p in cell.parameters_dict().items()}


def _assert_same(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key in expected:
        np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


@pytest.mark.parametrize("optimizer", ["adam", "sgd", "adamw"])
def test_checkpoint_round_trip_of_model_and_optimizer_states(tmp_path, optimizer):
    model, opt = _trained(seed=3, optimizer=optimizer)
    saved = checkpoint.save(tmp_path / "ck", model, opt, step=2, extra={"lr": 0.1})
    other, other_opt = _trained(seed=4, optimizer=optimizer, steps=1)
    assert not all(np.array_equal(a, b) for a, b in zip(_values(model).values(),
                                                         _values(other).values()))
    loaded = checkpoint.load(tmp_path / "ck", other, other_opt)
    assert (loaded["step"], loaded["extra"]) == (2, {"lr": 0.1})
    assert saved.bytes_written == saved.total_bytes > 0 and loaded["bytes_read"] > 0
    _assert_same(_values(other), _values(model))
    _assert_same(_values(other_opt), _values(opt))      # moments, global_step, powers
    assert int(other_opt.global_step.asnumpy()[0]) == 2


def test_state_dict_round_trip_full_and_sharded_forms_at_world_one():
    model, opt = _trained(seed=3)
    other, other_opt = _trained(seed=4, steps=1)
    set_model_state_dict(other, get_model_state_dict(model, full_state_dict=True))
    set_optimizer_state_dict(other, other_opt, get_optimizer_state_dict(model, opt))
    _assert_same(_values(other), _values(model))
    _assert_same(_values(other_opt), _values(opt))


def test_bfloat16_parameters_round_trip_bit_for_bit(tmp_path):
    bits = np.array([0x3F80, 0x7F7F, 0x0001, 0x8000, 0xC2F7], np.uint16)
    class Cell(nn.Cell):
        def __init__(self, values):
            super().__init__()
            self.w = Parameter(ms.Tensor(values.view(ml_dtypes.bfloat16)), name="w")
    checkpoint.save(tmp_path / "bf", Cell(bits))
    other = Cell(np.zeros(5, np.uint16))
    checkpoint.load(tmp_path / "bf", other)
    assert other.w.dtype == ms.bfloat16
    np.testing.assert_array_equal(np.array(other.w.asnumpy()).view(np.uint16), bits)


def test_a_mismatched_state_is_refused_by_key_and_shapes_with_the_model_unchanged(tmp_path):
    model, _ = _trained(seed=3, steps=1)
    checkpoint.save(tmp_path / "ck", model)
    narrow = TinyDeepSeekV3(from_dict({}, ["model.hidden_size=16", "model.num_experts=3"]).model)
    before = _values(narrow)
    with pytest.raises(StateMismatchError, match=r"'model/embed' is float32 of shape \(67, 32\); "
                                                 r"the model's is float32 of shape \(67, 16\)"):
        checkpoint.load(tmp_path / "ck", narrow)
    _assert_same(_values(narrow), before)
    state = get_model_state_dict(model, full_state_dict=True)
    with pytest.raises(StateMismatchError, match="'embed'.*shape \\(67, 32\\).*\\(67, 16\\)"):
        set_model_state_dict(narrow, state)
    missing = dict(state)
    missing.pop("head")
    with pytest.raises(StateMismatchError, match="no 'head'"):
        set_model_state_dict(model, missing)
    with pytest.raises(StateMismatchError, match="'extra.w'"):
        set_model_state_dict(model, {**state, "extra.w": state["head"]})
    with pytest.raises(StateMismatchError, match="float16"):
        set_model_state_dict(model, {**state, "head": state["head"].astype(ms.float16)})
    _assert_same(_values(narrow), before)
    with pytest.raises(StateMismatchError, match="has no 'optimizer/moment1.embed'"):
        checkpoint.load(tmp_path / "ck", model, optimizer_for(CFG, model.trainable_params()))


def test_a_sharded_dict_value_of_the_wrong_kind_is_refused():
    model, _ = _trained(seed=3, steps=1)
    state = get_model_state_dict(model)
    with pytest.raises(InvalidArgumentError, match="'head' is a list"):
        set_model_state_dict(model, {**state, "head": [1.0]})
    with pytest.raises(InvalidArgumentError, match="full_state_dict must be a bool"):
        get_model_state_dict(model, full_state_dict=1)
    part = ShardedTensor(state["head"][:3], tuple(state["head"].shape), (0, 0))
    with pytest.raises(StateMismatchError, match="head: the pieces given hold"):
        set_model_state_dict(model, {**state, "head": part})


def test_bad_save_arguments_are_refused(tmp_path):
    model, _ = _trained(seed=3, steps=0)
    with pytest.raises(InvalidArgumentError, match="step must be"):
        checkpoint.save(tmp_path / "ck", model, step=-1)
    with pytest.raises(InvalidArgumentError, match="JSON"):
        checkpoint.save(tmp_path / "ck", model, extra={"x": object()})
    with pytest.raises(InvalidArgumentError, match="strict JSON.*Out of range float"):
        checkpoint.save(tmp_path / "ck", model, extra={"x": float("nan")})
    assert not (tmp_path / "ck").exists()


def _saved(tmp_path) -> Path:
    model, _ = _trained(seed=3, steps=0)
    checkpoint.save(tmp_path / "ck", model, step=7)
    return tmp_path / "ck"


def test_missing_corrupted_and_truncated_files_are_refused_by_name(tmp_path):
    root = _saved(tmp_path)
    model = TinyDeepSeekV3(CFG.model, seed=9)
    with pytest.raises(CheckpointError, match="holds no checkpoint.*index.json"):
        checkpoint.load(tmp_path / "nothing", model)
    rank_file = next(root.glob("gen-*/rank-00000.safetensors"))
    data = rank_file.read_bytes()
    rank_file.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"{rank_file}.*truncated"):
        checkpoint.load(root, model)
    rank_file.write_bytes(b"\xff" * len(data))           # same size, garbage header
    with pytest.raises(CheckpointError, match=f"{rank_file} cannot be read"):
        checkpoint.load(root, model)
    rank_file.unlink()
    with pytest.raises(CheckpointError, match=f"{rank_file} is missing"):
        checkpoint.load(root, model)
    (root / "index.json").write_text('{"format": "gradpool-distributed-checkpoint", "vers')
    with pytest.raises(CheckpointError, match="index.json cannot be read"):
        checkpoint.load(root, model)
    (root / "index.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(CheckpointError, match="not a version-1"):
        checkpoint.load(root, model)


KILL_POINTS = {"rank_file_half_written": 1, "before_index": 1, "index_written_not_renamed": 1,
               "after_commit_before_cleanup": 2, "none": 2}


@pytest.mark.parametrize("point,loads_step", KILL_POINTS.items())
def test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint(tmp_path, point, loads_step):
    """A second save SIGKILLed at ``point``: the checkpoint loads, bit for bit, as the last save
    that committed its index; the next save succeeds and leaves one generation."""
    root = tmp_path / "ck"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "interrupted_save_worker.py"),
                           str(root), str(tmp_path), point], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == (0 if point == "none" else -9), proc.stderr[-3000:]
    sys.path.insert(0, str(ROOT / "tests"))
    from interrupted_save_worker import Small
    model = Small()
    assert checkpoint.load(root, model)["step"] == loads_step
    expected = np.load(tmp_path / f"step{loads_step}.npz")
    for name, param in model.parameters_dict().items():
        np.testing.assert_array_equal(param.asnumpy(), expected[name], err_msg=name)
    checkpoint.save(root, model, step=3)
    assert len(list(root.glob("gen-*"))) == 1 and not list(root.glob("*.tmp"))
    assert checkpoint.load(root, Small())["step"] == 3


def test_export_loads_into_the_unsharded_model_with_plain_mindspore(tmp_path):
    model, opt = _trained(seed=3)
    checkpoint.save(tmp_path / "ck", model, opt, step=2)
    out = tmp_path / "export" / "model.safetensors"
    report = checkpoint.export_full(tmp_path / "ck", out)
    assert report["tensors"] == len(model.parameters_dict()) and report["bytes"] == out.stat().st_size
    fresh = TinyDeepSeekV3(CFG.model, seed=11)
    not_loaded = ms.load_param_into_net(fresh, ms.load_checkpoint(str(out), format="safetensors"))
    assert not_loaded == ([], [])
    _assert_same(_values(fresh), _values(model))


def test_export_to_a_directory_or_an_unwritable_place_is_refused_by_name(tmp_path):
    model, _ = _trained(seed=3, steps=0)
    checkpoint.save(tmp_path / "ck", model)
    with pytest.raises(CheckpointError, match=f"{tmp_path} is a directory"):
        checkpoint.export_full(tmp_path / "ck", tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot be written"):
        checkpoint.export_full(tmp_path / "ck", tmp_path / "file" / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "file"]


def test_a_loaded_model_keeps_every_shape_and_saves_again_loadably(tmp_path):
    """Shapes after a load are the model's own (0-d ones included), so a model loaded from a
    checkpoint saves one that loads into a fresh model."""
    model, opt = _trained(seed=3)
    checkpoint.save(tmp_path / "a", model, opt)
    other, other_opt = _trained(seed=4, steps=1)
    shapes = {k: tuple(p.shape) for k, p in {**other.parameters_dict(),
                                             **other_opt.parameters_dict()}.items()}
    checkpoint.load(tmp_path / "a", other, other_opt)
    assert {k: tuple(p.shape) for k, p in {**other.parameters_dict(),
                                           **other_opt.parameters_dict()}.items()} == shapes
    checkpoint.save(tmp_path / "b", other, other_opt)
    third, third_opt = _trained(seed=5, steps=1)
    checkpoint.load(tmp_path / "b", third, third_opt)
    _assert_same(_values(third_opt), _values(opt))


def test_a_sharded_state_dict_of_another_layout_loads_from_all_its_pieces():
    """Every rank's ShardedTensors of a 3-way Shard(0) layout, given as lists, load into the
    unsharded model (each rank takes its part); a missing or overlapping piece is refused."""
    model, _ = _trained(seed=3, steps=1)
    full = get_model_state_dict(model, full_state_dict=True)

    def pieces(tensor, world=3, drop=None, overlap=False):
        values = tensor.asnumpy()
        if values.ndim == 0:
            return tensor
        chunk = -(-values.shape[0] // world)
        out = []
        for r in range(world):
            start = max(0, r * chunk - (1 if overlap and r else 0))
            part = values[start:(r + 1) * chunk]
            if part.shape[0] and r != drop:
                out.append(ShardedTensor(ms.Tensor(part), values.shape,
                                         (start,) + (0,) * (values.ndim - 1)))
        return out

    other, _ = _trained(seed=4, steps=0)
    set_model_state_dict(other, {k: pieces(v) for k, v in full.items()})
    _assert_same(_values(other), {k: v.asnumpy() for k, v in full.items()})
    with pytest.raises(StateMismatchError, match="embed: the pieces given hold"):
        set_model_state_dict(other, {**{k: pieces(v) for k, v in full.items()},
                                     "embed": pieces(full["embed"], drop=1)})
    with pytest.raises(StateMismatchError, match="overlap"):
        set_model_state_dict(other, {**{k: pieces(v) for k, v in full.items()},
                                     "embed": pieces(full["embed"], overlap=True)})


def test_a_full_numpy_state_dict_is_copied_not_adopted():
    """The caller's arrays stay the caller's: changing one after loading changes nothing."""
    model, _ = _trained(seed=3, steps=0)
    state = {k: v.asnumpy().copy() for k, v in get_model_state_dict(model,
                                                                     full_state_dict=True).items()}
    other, _ = _trained(seed=4, steps=0)
    set_model_state_dict(other, state)
    loaded = _values(other)
    for array in state.values():
        array[...] = 0
    _assert_same(_values(other), loaded)
