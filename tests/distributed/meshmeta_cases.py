"""Meta-device init and mindformers' meshes on 2 real CPU ranks (one msrun launch:
tests/test_mesh_meta_distributed.py).

Meta init (tests/meta_models.py, mindformers' Trainer order) with uneven shards (rows 11 -> 6 +
5, 7 -> 4 + 3): each rank's local shards equal those of the same model initialised whole on the
device and then sharded, and a NumPy draw of the first parameter sliced by hand; one training
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
from harness import Context, Suite, allclose, equal, raises  # noqa: E402

suite = Suite("meshmeta", blocking_launch=True)
X = np.random.default_rng(4).standard_normal((3, 11)).astype(np.float32)
LOG_DIR = tempfile.mkdtemp(prefix="gradpool-mindformers-log-")


def _step(net) -> tuple:
    params = net.trainable_params()
    loss, _ = ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, params)(ms.Tensor(X))
    return float(loss.asnumpy()), [np.array(p.main_grad.asnumpy()) for p in params]


@suite.case
def meta_init_matches_initialising_then_sharding(ctx: Context) -> dict:
    with meta_models.cpu_initialisers():
        reference = meta_models.shard(meta_models.build_reference(seed=11))
        built = meta_models.build_meta(seed=11)
    expected, got = meta_models.local_values(reference), meta_models.local_values(built)
    checks = {name: allclose(got[name], values, rtol=0, atol=0)
              for name, values in expected.items()}
    checks["names"] = equal(list(got), list(expected))
    # independent of fully_shard's own split: the first parameter drawn is embed.weight, shape
    # (6, 11), 3 rows a rank
    np.random.seed(11)
    full = np.random.normal(0.0, 0.01, (6, 11)).astype(np.float32)
    checks["embed.weight vs numpy"] = allclose(got["embed.weight"],
                                               full[3 * ctx.rank: 3 * ctx.rank + 3], rtol=0,
                                               atol=0)
    rows = 6 if ctx.rank == 0 else 5         # head.weight (11, 6): uneven, zero padding row
    checks["head.weight padding"] = allclose(got["head.weight"][rows:],
                                             np.zeros((6 - rows, 6)), rtol=0, atol=0,
                                             allow_empty=True)
    checks["devices"] = equal(sorted({p.device for p in built.trainable_params()}), ["CPU"])
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
