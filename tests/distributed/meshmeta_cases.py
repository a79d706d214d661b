"""Meta-device init and mindformers' meshes on 2 real CPU ranks (one msrun launch:
tests/test_mesh_meta_distributed.py).

Meta init (tests/meta_models.py, mindformers' Trainer order) with uneven shards (rows 11 -> 6 +
5, 7 -> 4 + 3; columns too): each rank's local shards equal those of the same model initialised
whole on the device and then sharded, and a NumPy draw of the first parameter sliced by hand,
drawn block by block (chunk-sized and 7-element blocks) or whole, and the random stream ends
where the unsharded init leaves it, with no block the size of a full parameter; one training
step of the two gives the same loss and main_grads; a forward on meta is refused by name on
both ranks before any collective. Meshes (when mindformers is installed): mindformers' own
``ParallelDims`` for FSDP (1 x 2), HSDP (2 x 1) and EP 2, checked by tests/distributed/
mesh_checks.py.
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import mindspore as ms
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/meta_models.py

import meta_models  # noqa: E402
from gradpool import MetaDeviceError  # noqa: E402
from hyper_parallel.core.dtensor.placement_types import Shard  # noqa: E402
from hyper_parallel.platform.mindspore.fully_shard import meta_init  # noqa: E402
from harness import Context, Suite, allclose, equal, raises  # noqa: E402

suite = Suite("meshmeta", blocking_launch=True)
X = np.random.default_rng(4).standard_normal((3, 11)).astype(np.float32)
LOG_DIR = tempfile.mkdtemp(prefix="gradpool-mindformers-log-")


def _step(net) -> tuple:
    params = net.trainable_params()
    loss, _ = ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, params)(ms.Tensor(X))
    return float(loss.asnumpy()), [np.array(p.main_grad.asnumpy()) for p in params]


def _columns(param):
    """Shard(1) for the matrices (columns 11 -> 6 + 5 and 7 -> 4 + 3), dim 0 for the rest."""
    return Shard(1) if len(param.shape) == 2 else None


# name -> (normal_ marked continues_across_calls, block budget in bytes, shard_placement_fn):
# blocks of the local chunk; 7 elements a block (rank 1's rows start inside a block); the full
# draw MindSpore's own op gets; column shards (a run per row) in 7-element blocks
DRAWS = {"chunk blocks": (True, None, None), "7-element blocks": (True, 28, None),
         "full draw": (False, None, None), "columns, 7-element blocks": (True, 28, _columns)}


@suite.case
def meta_init_matches_initialising_then_sharding(ctx: Context) -> dict:
    checks = {}
    for variant, (block_by_block, block_bytes, placement) in DRAWS.items():
        checks.update({f"{variant}: {k}": v for k, v in _init_checks(
            ctx, block_by_block, block_bytes, placement).items()})
    return checks


def _init_checks(ctx, block_by_block, block_bytes, placement) -> dict:
    saved = meta_init.BLOCK_BYTES
    meta_init.BLOCK_BYTES = block_bytes or saved
    draws = []
    try:
        with meta_models.cpu_initialisers():
            reference = meta_models.shard(meta_models.build_reference(seed=11),
                                          placement=placement)
            next_after_reference = np.random.normal(size=5)
        with meta_models.cpu_initialisers(block_by_block, draws):
            built = meta_models.build_meta(seed=11, placement=placement)
            next_after_built = np.random.normal(size=5)
    finally:
        meta_init.BLOCK_BYTES = saved
    expected, got = meta_models.local_values(reference), meta_models.local_values(built)
    checks = {name: allclose(got[name], values, rtol=0, atol=0)
              for name, values in expected.items()}
    checks["names"] = equal(list(got), list(expected))
    # the stream is left where the unsharded init leaves it (the next draw's values are right)
    checks["next draw"] = allclose(next_after_built, next_after_reference, rtol=0, atol=0)
    # every element of every normal_ parameter drawn (66 + 2 x (42 + 42) + 66); blocks never
    # the full parameter (the smallest is 42): at most its chunk (36) or 7 elements
    largest = 66 if not block_by_block else 7 if block_bytes else 36
    checks["draws"] = equal([sum(draws), max(draws)], [300, largest])
    checks["devices"] = equal(sorted({p.device for p in built.trainable_params()}), ["CPU"])
    if placement is None:
        # independent of fully_shard's own split: the first parameter drawn is embed.weight,
        # shape (6, 11), 3 rows a rank
        np.random.seed(11)
        full = np.random.normal(0.0, 0.01, (6, 11)).astype(np.float32)
        checks["embed.weight vs numpy"] = allclose(got["embed.weight"],
                                                   full[3 * ctx.rank: 3 * ctx.rank + 3],
                                                   rtol=0, atol=0)
        rows = 6 if ctx.rank == 0 else 5     # head.weight (11, 6): uneven, zero padding row
        checks["head.weight padding"] = allclose(got["head.weight"][rows:],
                                                 np.zeros((6 - rows, 6)), rtol=0, atol=0,
                                                 allow_empty=True)
    else:
        cols = 6 if ctx.rank == 0 else 5     # embed.weight (6, 11) by columns
        np.random.seed(11)
        full = np.random.normal(0.0, 0.01, (6, 11)).astype(np.float32)
        checks["embed.weight vs numpy"] = allclose(got["embed.weight"][:, :cols],
                                                   full[:, 6 * ctx.rank: 6 * ctx.rank + cols],
                                                   rtol=0, atol=0)
    return checks


@suite.case
def meta_init_trains_like_initialising_then_sharding(ctx: Context) -> dict:
    with meta_models.cpu_initialisers():
        reference = meta_models.shard(meta_models.build_reference(seed=5))
        built = meta_models.build_meta(seed=5)
    (loss, grads), (ref_loss, ref_grads) = _step(built), _step(reference)
    checks = {"loss": allclose(np.array([loss]), np.array([ref_loss]), rtol=0, atol=0)}
    for param, grad, ref in zip(built.trainable_params(), grads, ref_grads):
        checks[f"main_grad {param.name}"] = allclose(grad, ref, rtol=0, atol=0)
    return checks


@suite.case
def forward_on_meta_is_refused_by_name(ctx: Context) -> dict:
    with ms.DeviceCtx("meta"):
        net = meta_models.shard(meta_models.Net())
    return {"refused": raises(MetaDeviceError, lambda: net(ms.Tensor(X)), "embed.weight",
                              "to_empty()")}


def _mesh_case(name: str, config: dict) -> None:
    def case(ctx: Context) -> dict:
        import mesh_checks
        return mesh_checks.check_config(ctx, config, LOG_DIR)
    suite.add(name, case)


from installed import mindformers_installed  # noqa: E402

if mindformers_installed():
    _mesh_case("parallel_dims_fsdp", dict(dp_replicate=1, dp_shard=-1, ep=1))
    _mesh_case("parallel_dims_hsdp_2x1", dict(dp_replicate=2, dp_shard=1, ep=1))
    _mesh_case("parallel_dims_ep2", dict(dp_replicate=1, dp_shard=2, ep=2))


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
