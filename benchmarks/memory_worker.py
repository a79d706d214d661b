"""One process of ``gradpool bench --suite memory``: trains the dense stack, measures its memory.

    python benchmarks/memory_worker.py OUT_DIR --unsharded [options]       # one process
    msrun ... python -m gradpool.app._rank_entry benchmarks/memory_worker.py OUT_DIR \\
        --reshard true [options]                                            # every rank

The model (:class:`DenseStack`): ``layers`` square ``hidden x hidden`` float32 weights, each
layer ``x = tanh(x @ W_i)``, then the root's own ``scale`` vector (``y = x * scale``, so the root
unit has a parameter and a backward of its own), loss ``sum(y ** 2)``. Trained ``steps`` steps
with plain SGD, no momentum, written by hand (``ops.assign(p, p - lr * g)``: ``nn.SGD`` would
add two parameter-sized buffers, ``accum`` and ``stat``, even without momentum).

What is measured, per process (VmHWM is per process, so one configuration per process):

* ``baseline``: VmRSS (``/proc/self/status``) right after the model is built, before
  ``fully_shard``; then the high-water mark is reset to it (``5`` into ``/proc/self/clear_refs``)
  so the peak of building (NumPy temporaries, imports) is not counted;
* ``peak``: VmHWM after the last step; ``growth = peak - baseline``.

On Ascend the same figures come from MindSpore's device memory statistics
(``mindspore.runtime.memory_allocated`` after the build, ``reset_peak_memory_stats``, then
``max_memory_allocated``). The pool's high-water is the sum over this process's runtimes.
The record is published into this rank's report (:mod:`gradpool.app.rank_report`).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from pathlib import Path

MIB = 2 ** 20
LEARNING_RATE = 1e-4


def read_status(keys=("VmRSS", "VmHWM")) -> dict:
    """Fields of ``/proc/self/status`` in bytes (the file gives kB)."""
    found = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in keys:
                found[name] = int(value.split()[0]) * 1024
    return found


def reset_high_water() -> bool:
    """Reset VmHWM to the current VmRSS (Linux >= 4.0); False when the kernel refuses it."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
    except OSError:
        return False
    status = read_status()
    return status["VmHWM"] <= status["VmRSS"] + 4 * MIB     # pages may fault in meanwhile


class Meter:
    """Baseline now, peak later: host RSS on CPU, MindSpore's device statistics on Ascend."""

    def __init__(self, device: str):
        self.device = device
        if device == "Ascend":
            import mindspore as ms
            ms.runtime.synchronize()
            self.baseline = ms.runtime.memory_allocated()
            ms.runtime.reset_peak_memory_stats()
            self.source = "mindspore.runtime.max_memory_allocated"
            self.reset = True
        else:
            self.baseline = read_status()["VmRSS"]
            self.reset = reset_high_water()
            self.source = "VmHWM" if self.reset else "VmHWM (not reset: includes the build)"

    def peak(self) -> int:
        if self.device == "Ascend":
            import mindspore as ms
            ms.runtime.synchronize()
            return ms.runtime.max_memory_allocated()
        return read_status()["VmHWM"]


def prepay_library() -> int:
    """Pay the library's fixed cost (imports, the host writer's compiled loops, made with the
    first reducer on a CPU pool) before the baseline, and return it: it does not scale with the
    model, and the unsharded run does not pay it."""
    before = read_status()["VmRSS"]
    import hyper_parallel  # noqa: F401
    from gradpool.runtime import GradPoolConfig, runtime_for
    runtime_for(GradPoolConfig()).reducer()
    return read_status()["VmRSS"] - before


def build_stack(layers: int, hidden: int, seed: int):
    """The dense stack with fixed weights (every rank builds the same ones)."""
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, mint, nn

    class Dense(nn.Cell):
        def __init__(self, weight):
            super().__init__()
            self.weight = Parameter(ms.Tensor(weight), name="weight")

        def construct(self, x):
            # x @ W, not x @ W.T: a transposed operand is saved as its own copy for backward
            return mint.tanh(mint.matmul(x, self.weight))

    class DenseStack(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(seed)
            scale = 1.0 / math.sqrt(hidden)
            self.layers = nn.CellList([
                Dense(rng.standard_normal((hidden, hidden), dtype=np.float32) * np.float32(scale))
                for _ in range(layers)])
            self.scale = Parameter(ms.Tensor(np.ones(hidden, np.float32)), name="scale")

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x * self.scale

    return DenseStack()


def _sync() -> None:
    from gradpool.device import synchronize
    synchronize()


def run_one(*, layers: int, hidden: int, batch: int, steps: int, sharded: bool,
            reshard_after_forward: bool, main_grad: bool, prefetch: bool, rank: int,
            world: int, device: str) -> dict:
    """Build, measure the baseline, shard (or not), train; the record of this configuration."""
    import mindspore as ms
    import numpy as np
    from mindspore import mint, ops

    library_bytes = prepay_library() if sharded else 0
    model = build_stack(layers, hidden, seed=0)
    x = ms.Tensor(np.random.default_rng(1 + rank).standard_normal((batch, hidden),
                                                                   dtype=np.float32))
    gc.collect()
    _sync()
    meter = Meter(device)
    start = time.perf_counter()
    if sharded:
        from hyper_parallel import fully_shard
        from hyper_parallel.core.fully_shard.api import MixedPrecisionPolicy
        policy = MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=main_grad)
        for layer in model.layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        if prefetch:
            units = list(model.layers)
            for index, layer in enumerate(units):
                if index + 1 < len(units):
                    layer.set_modules_to_forward_prefetch([units[index + 1]])
                if index > 0:
                    layer.set_modules_to_backward_prefetch([units[index - 1]])
    params = model.trainable_params()

    def loss_fn(inputs):
        y = model(inputs)
        return mint.sum(y * y)

    grad_fn = ms.value_and_grad(loss_fn, None, params)
    losses, step_seconds = [], []
    for _ in range(steps):
        began = time.perf_counter()
        if sharded:
            model.zero_grad()
        loss, grads = grad_fn(x)
        if sharded and main_grad:
            grads = [p.main_grad for p in params]
        for param, grad in zip(params, grads):
            ops.assign(param, param - LEARNING_RATE * grad)
        del grads
        _sync()
        losses.append(float(loss.asnumpy()))
        step_seconds.append(time.perf_counter() - began)
    peak = meter.peak()
    end_rss = read_status()["VmRSS"] if device != "Ascend" else None
    from gradpool.runtime import all_runtimes
    high_water = sum(rt.pool.stats().high_water_bytes for rt in all_runtimes())
    return {
        "rank": rank, "world": world, "sharded": sharded,
        "reshard_after_forward": reshard_after_forward if sharded else None,
        "main_grad": main_grad, "prefetch": prefetch and sharded,
        "layers": layers, "hidden": hidden, "batch": batch, "steps": steps,
        "baseline_bytes": meter.baseline, "peak_bytes": peak,
        "growth_bytes": peak - meter.baseline, "end_rss_bytes": end_rss,
        "source": meter.source, "high_water_reset": meter.reset,
        "pool_high_water_bytes": high_water, "library_bytes": library_bytes,
        "losses": losses, "finite": all(math.isfinite(v) for v in losses),
        "step_seconds": step_seconds, "seconds": time.perf_counter() - start,
        "pid": os.getpid(),
    }


def run_collectives_only(*, layers: int, hidden: int, steps: int, rank: int, world: int,
                         device: str) -> dict:
    """The control: no model, only the collectives a resharding step of the stack runs, on
    buffers made before the baseline (per layer and step: the forward's all-gather, the
    backward's all-gather and the gradient's reduce-scatter, with the stack's shapes). What it
    grows is what the backend's collectives themselves hold (MindSpore's CPU collectives run as
    compiled graphs and keep memory per graph and shape)."""
    import mindspore as ms
    from mindspore import mint
    from gradpool.comm import communicator_for
    library_bytes = prepay_library()
    comm = communicator_for()
    full = hidden * hidden
    shard = -(-full // world)
    gathered = mint.zeros(shard * world, dtype=ms.float32)
    local = mint.zeros(shard, dtype=ms.float32)
    gradient = mint.ones(shard * world, dtype=ms.float32)
    reduced = mint.zeros(shard, dtype=ms.float32)
    gc.collect()
    _sync()
    meter = Meter(device)
    start = time.perf_counter()
    for _ in range(steps):
        for _ in range(layers):
            comm.all_gather(gathered, local)
        for _ in range(layers):
            comm.all_gather(gathered, local)
            comm.reduce_scatter(reduced, gradient, op="avg")
    _sync()
    peak = meter.peak()
    return {"rank": rank, "world": world, "sharded": True, "collectives_only": True,
            "layers": layers, "hidden": hidden, "steps": steps,
            "baseline_bytes": meter.baseline, "peak_bytes": peak,
            "growth_bytes": peak - meter.baseline, "source": meter.source,
            "high_water_reset": meter.reset, "pool_high_water_bytes": 0,
            "library_bytes": library_bytes, "losses": [], "finite": True,
            "seconds": time.perf_counter() - start, "pid": os.getpid()}


def _flag(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--unsharded", action="store_true",
                        help="no fully_shard (run it in one process, not under msrun)")
    parser.add_argument("--reshard", type=_flag, default=True,
                        help="reshard_after_forward of every unit (true/false)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--collectives-only", action="store_true",
                        help="the control: the stack's collectives without a model")
    parser.add_argument("--main-grad", action="store_true",
                        help="MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="no forward/backward prefetch of the neighbouring layer")
    parser.add_argument("--device", default="CPU", choices=("CPU", "Ascend"))
    args = parser.parse_args(argv)

    import mindspore as ms
    ms.set_device(args.device)
    from gradpool.app import rank_report
    from gradpool.comm import init_distributed
    # first: in msrun's scheduler process this serves the cluster and never returns
    rank, world = (0, 1) if args.unsharded else init_distributed()
    if args.device == "CPU":
        # CPU ranks share the machine's cores: PyNative's queue threads of every rank would
        # compete for them (see gradpool.device.block_launches); also what gradpool train does
        from gradpool.device import block_launches
        block_launches()
    reporter = rank_report.reporter_for(args.out_dir, rank, world)
    if args.collectives_only:
        name = f"W={world} collectives only"
        record = run_collectives_only(layers=args.layers, hidden=args.hidden, steps=args.steps,
                                      rank=rank, world=world, device=args.device)
    else:
        name = "unsharded" if args.unsharded else f"W={world} reshard={args.reshard}"
        record = run_one(layers=args.layers, hidden=args.hidden, batch=args.batch,
                         steps=args.steps, sharded=not args.unsharded,
                         reshard_after_forward=args.reshard, main_grad=args.main_grad,
                         prefetch=not args.no_prefetch, rank=rank, world=world,
                         device=args.device)
    reporter.publish_entry("runs", name, record)
    print(f"{name} rank {rank}: growth {record['growth_bytes'] / MIB:.1f} MiB (baseline "
          f"{record['baseline_bytes'] / MIB:.1f}, peak {record['peak_bytes'] / MIB:.1f}), pool "
          f"high-water {record['pool_high_water_bytes'] / MIB:.1f} MiB, "
          f"{record['seconds']:.2f} s", flush=True)
    return 0 if record["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
