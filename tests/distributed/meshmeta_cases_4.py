"""Meta-device init's memory and mindformers' meshes on 4 real CPU ranks (one msrun launch:
tests/test_mesh_meta_distributed.py).

* ``meta_init_peak_memory``: a model of 104 MiB float32 parameters (3 blocks of two 16 MiB
  matrices) built the Trainer's way (meta build, fully_shard inside the meta context,
  ``to_empty()``, ``init_states()``), its ``normal_`` drawn block by block. Measured two ways:
  the peak resident memory the build and init add on each rank (VmHWM reset first) must stay
  below the model's size, and init may add the local shards and less than one full parameter
  (full draws add several: 132 MiB against 63 MiB); the tensors ``normal_`` fills (counted by
  the stand-in) are blocks of at most 1 MiB, never a parameter, and cover every element.
* Meshes (when mindformers is installed): mindformers' own ``ParallelDims`` for HSDP 2 x 2,
  FSDP 4 with EP 2, HSDP 2 x 2 with EP 2, and the dense weights' 2-of-4 shard mesh
  (``get_fsdp_shard_mesh``), checked by tests/distributed/mesh_checks.py.
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore.graph.api import _no_grad

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/meta_models.py

import meta_models  # noqa: E402
from harness import Context, Suite, equal  # noqa: E402
from hyper_parallel.platform.mindspore.fully_shard import meta_init  # noqa: E402

suite = Suite("meshmeta_4", blocking_launch=True)
LOG_DIR = tempfile.mkdtemp(prefix="gradpool-mindformers-log-")
MIB = 2 ** 20
SIZES = dict(vocab=1024, width=1024, hidden=4096, layers=3)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


@suite.case
def meta_init_peak_memory(ctx: Context) -> dict:
    draws = []
    with meta_models.cpu_initialisers(draws=draws):
        # once per process, not per model (the runtime, its communicators, kernels): not counted
        meta_models.build_meta(seed=1, vocab=16, width=8, hidden=8, layers=1)
        draws.clear()
        Path("/proc/self/clear_refs").write_text("5")      # reset VmHWM to the current RSS
        before = _status_kib("VmRSS") * 1024
        with ms.DeviceCtx("meta"):
            net = meta_models.shard(meta_models.Net(**SIZES))
        stages = {"after fully_shard": _status_kib("VmHWM") * 1024 - before}
        net.to_empty()
        stages["after to_empty"] = _status_kib("VmHWM") * 1024 - before
        np.random.seed(3)
        with _no_grad():
            net.init_states()
    peak = _status_kib("VmHWM") * 1024 - before
    params = net.trainable_params()
    model = sum(int(np.prod(p.hsdp_param.orig_shape)) * 4 for p in params)
    largest = max(int(np.prod(p.hsdp_param.orig_shape)) * 4 for p in params)
    local = sum(int(np.prod(p.shape)) * 4 for p in params)
    main_grad = sum(int(np.prod(p.main_grad.shape)) * 4 for p in params)
    # what init adds beyond what to_empty left (main_grad, the runtime's share): the local
    # shards' memory and transients that must stay below one full parameter
    bound = local + stages["after to_empty"] + largest
    # tracked: every tensor normal_ (the matrices' initialiser) filled during init
    drawn = [p.hsdp_param for p in params if len(p.shape) == 2]
    report = {"peak_mib": round(peak / MIB, 1), "model_mib": round(model / MIB, 1),
              "local_shards_mib": round(local / MIB, 1),
              "main_grad_mib": round(main_grad / MIB, 1),
              "largest_param_mib": round(largest / MIB, 1), "bound_mib": round(bound / MIB, 1),
              **{f"peak {k} (MiB)": round(v / MIB, 1) for k, v in stages.items()}}
    draws_report = {"largest draw (elements)": max(draws), "elements drawn": sum(draws)}
    # the values: a spot check that the init ran (std 0.01 draws) on this rank's shard
    spread = float(np.std(net.layers[0].up.weight.asnumpy()))
    return {"memory (MiB)": equal({**report, "below model": peak < model,
                                   "within bound": peak <= bound},
                                  {**report, "below model": True, "within bound": True}),
            # every element of every matrix drawn, never more than a block (1 MiB, below the
            # smallest matrix's chunk) at a time: no rank draws a full parameter
            "no full parameter drawn": equal(draws_report, {
                "largest draw (elements)": max(meta_init.block_numel(p.slot, 4) for p in drawn),
                "elements drawn": sum(p.slot.numel for p in drawn)}),
            "draw below a parameter": equal(
                max(draws) < min(p.slot.numel for p in drawn), True),
            "initialised": equal(round(spread, 3), 0.01)}


def _mesh_case(name: str, config: dict) -> None:
    def case(ctx: Context) -> dict:
        import mesh_checks
        return mesh_checks.check_config(ctx, config, LOG_DIR)
    suite.add(name, case)


from installed import mindformers_installed  # noqa: E402

if mindformers_installed():
    _mesh_case("parallel_dims_hsdp_2x2", dict(dp_replicate=2, dp_shard=2, ep=1))
    _mesh_case("parallel_dims_fsdp4_ep2", dict(dp_replicate=1, dp_shard=4, ep=2))
    _mesh_case("parallel_dims_hsdp_2x2_ep2", dict(dp_replicate=2, dp_shard=2, ep=2))

    @suite.case
    def parallel_dims_dense_shard_2_of_4(ctx: Context) -> dict:
        import mesh_checks
        return mesh_checks.check_dense_shard_mesh(
            ctx, dict(dp_replicate=1, dp_shard=4, ep=1), 2, LOG_DIR)


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
