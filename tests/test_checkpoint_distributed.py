"""Distributed checkpoints across world sizes and meshes, on real msrun ranks.

Three launches of tests/distributed/checkpoint_cases.py share one directory: 2 ranks save ``w2``;
in this process (world 1, an unsharded model) ``w2`` is loaded and ``w1`` saved; 4 ranks load
``w2`` flat and on an HSDP (2, 2) mesh and save ``f4`` and ``h4``; world 1 loads those; 2 ranks
load ``h4`` and ``w1``. Every loading run dumps its raw local tensors, and the full tensors
assembled from them with NumPy must equal the saving run's bit for bit (model and Adam states).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

import harness

pytestmark = pytest.mark.distributed

SCRIPT = harness.DIST_DIR / "checkpoint_cases.py"
SUITE = harness.load_suite(SCRIPT)
CASES = sys.modules["_cases_checkpoint_cases"]
PHASES = {"w2": 2, "w4": 4, "back": 2}
# (what was saved, what a later run loaded from it)
PAIRS = [("w2", "w2_at_w2"), ("w2", "w2_at_w1"), ("w2", "w2_at_f4"), ("w2", "w2_at_h4"),
         ("h4", "h4_at_f4"), ("h4", "h4_at_w1"), ("h4", "h4_at_w2"), ("f4", "f4_at_w1"),
         ("w1", "w1_at_w2"),
         # expert parallelism: EP 2 at 4 ranks into EP 4, EP 1, 2 ranks EP 2 and EP 1, world 1
         ("e2", "e2_at_ep4"), ("e2", "e2_at_ep1"), ("e2", "e2_at_w2ep2"), ("e2", "e2_at_w2ep1"),
         ("e2", "e2_at_w1")]


def phase_names(phase: str) -> list[str]:
    return [name for name in SUITE.names if name.startswith(phase + "_")]


def _launch(phase: str, shared: Path, out_dir: Path):
    from gradpool.app.launch import run_ranks
    names = phase_names(phase)
    launch = run_ranks(SCRIPT, args=[str(out_dir), *names], nproc=PHASES[phase],
                       log_dir=out_dir / "logs", timeout=600, report_dir=out_dir,
                       env={"CHECKPOINT_SHARED": str(shared)})
    return harness.load_results(out_dir, SUITE.name, PHASES[phase], launch)


def _world_one(shared: Path, loads: list[str], save: bool = False, experts: int = 0) -> None:
    """In this process: an unsharded model and its Adam take each checkpoint and dump."""
    from gradpool.app.config import from_dict
    from gradpool.comm import SingleProcessCommunicator
    ctx = harness.Context(rank=0, world_size=1, comm=SingleProcessCommunicator())
    cfg = from_dict({}, CASES.MODEL + ([f"model.num_experts={experts}"] if experts else []))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CHECKPOINT_SHARED", str(shared))
        _load_and_save(shared, loads, save, ctx, cfg)


def _load_and_save(shared, loads, save, ctx, cfg) -> None:
    from gradpool.app.model import TinyDeepSeekV3
    from gradpool.app.train import optimizer_for
    from hyper_parallel import checkpoint
    for source in loads:
        model = TinyDeepSeekV3(cfg.model, seed=77)
        optimizer = optimizer_for(cfg, model.trainable_params())
        checkpoint.load(shared / source, model, optimizer)
        CASES.dump(f"{source}_at_w1", ctx, model, optimizer)
    if save:
        model = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
        optimizer = optimizer_for(cfg, model.trainable_params())
        CASES.train(cfg, model, optimizer, ctx, steps=3)
        checkpoint.save(shared / "w1", model, optimizer, step=5)
        CASES.dump("w1", ctx, model, optimizer)


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    shared = tmp_path_factory.mktemp("checkpoint_shared")
    results = {"w2": _launch("w2", shared, tmp_path_factory.mktemp("w2"))}
    _world_one(shared, ["w2"], save=True)
    results["w4"] = _launch("w4", shared, tmp_path_factory.mktemp("w4"))
    _world_one(shared, ["f4", "h4"])
    _world_one(shared, ["e2"], experts=4)
    results["back"] = _launch("back", shared, tmp_path_factory.mktemp("back"))
    return shared, results


def assemble(shared: Path, tag: str) -> dict[str, np.ndarray]:
    """Full tensors from a run's raw dumps: shards in shard order along their dim, padding cut;
    HSDP replicas must hold the same shard bit for bit. Under expert parallelism a rank holds
    some experts only: each tensor is assembled from the ranks that hold it."""
    folder = shared / "raw" / tag
    metas = sorted(folder.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    ranks = [(json.loads(m.read_text()), np.load(m.with_suffix(".npz"))) for m in metas]
    assert ranks and len(ranks) == ranks[0][0]["world_size"], f"{folder}: dumps missing"
    full = {}
    every_key = {key: meta["geometry"][key] for meta, _ in ranks for key in meta["geometry"]}
    for key, geometry in every_key.items():
        holders = [(meta, arrays) for meta, arrays in ranks if key in meta["geometry"]]
        dim = geometry["shard_dim"]
        if dim < 0:
            values = [arrays[key] for _, arrays in holders]
            assert all(np.array_equal(values[0], v) for v in values), f"{tag}: {key} differs"
            full[key] = values[0]
            continue
        shards: dict[int, np.ndarray] = {}
        for meta, arrays in holders:
            where = meta["geometry"][key]
            index, array = where["shard_rank"], arrays[key]
            if index in shards:
                assert np.array_equal(shards[index], array), f"{tag}: replicas of {key} differ"
            shards[index] = array
        stacked = np.concatenate([shards[i] for i in sorted(shards)], axis=dim)
        full[key] = stacked[tuple(slice(0, n) for n in geometry["shape"])]
    return full


@pytest.mark.parametrize("phase", list(PHASES))
def test_every_rank_ran_the_phase(phases, phase):
    phases[1][phase].verify_every_rank_ran(phase_names(phase), PHASES[phase])


@pytest.mark.parametrize("name", SUITE.names)
def test_case(phases, name):
    phases[1][name.split("_")[0]].verify(name)


@pytest.mark.parametrize("saved,loaded", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_every_full_tensor_loads_bit_identical(phases, saved, loaded):
    shared = phases[0]
    expected, actual = assemble(shared, saved), assemble(shared, loaded)
    assert sorted(actual) == sorted(expected)
    moments = [k for k in expected if k.startswith("optimizer/moment1.")]
    assert moments and any(np.abs(expected[k]).sum() > 0 for k in moments), \
        "the saved optimizer has no state: nothing would show a lost moment"
    for key, values in expected.items():
        assert actual[key].shape == values.shape and actual[key].dtype == values.dtype, key
        np.testing.assert_array_equal(actual[key], values, err_msg=f"{saved} -> {loaded}: {key}")


def test_full_state_dict_is_identical_on_every_rank(phases):
    reports = phases[1]["w2"].reports
    digests = [r["cases"]["w2_full_state_dict_is_the_same_on_every_rank"]["checks"]["digest"]
               ["actual"] for r in reports]
    assert len(digests) == 2 and digests[0] == digests[1]


def test_ep_full_state_dict_holds_every_expert_as_saved(phases):
    """get_model_state_dict / get_optimizer_state_dict(full_state_dict=True) at EP 2: every rank
    got every expert (and everything else) equal to the tensors assembled from the raw dumps."""
    shared = phases[0]
    expected = assemble(shared, "e2")
    dumps = sorted((shared / "full" / "e2").glob("rank*.npz"))
    assert len(dumps) == 4
    experts = [k for k in expected if k.startswith("model/layers.1.moe.experts.3.")]
    assert experts, "the EP dumps hold no expert 3: nothing would show a missing expert"
    for path in dumps:
        full = np.load(path)
        model_keys = {k for k in expected if k.startswith("model/")}
        assert model_keys <= set(full.files), f"{path.name}: missing {model_keys - set(full.files)}"
        for key in expected:
            if key in full.files:
                np.testing.assert_array_equal(full[key], expected[key].astype(np.float32),
                                              err_msg=f"{path.name}: {key}")


def test_ep_checkpoint_exports_the_plain_model(phases, tmp_path):
    """gradpool export of the EP 2 checkpoint: one file holding every expert, the saved values."""
    from hyper_parallel.checkpoint import export_full
    from safetensors.numpy import load_file
    shared = phases[0]
    out = tmp_path / "model.safetensors"
    export_full(shared / "e2", out)
    exported = load_file(str(out))
    expected = {k[len("model/"):]: v for k, v in assemble(shared, "e2").items()
                if k.startswith("model/")}
    assert sorted(exported) == sorted(expected)
    for key, values in expected.items():
        np.testing.assert_array_equal(exported[key], values, err_msg=key)
