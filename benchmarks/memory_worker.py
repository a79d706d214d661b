"""One process of ``gradpool bench --suite memory``: trains a stack, measures its memory.

    python benchmarks/memory_worker.py OUT_DIR --unsharded [options]       # one process
    msrun ... python -m gradpool.app._rank_entry benchmarks/memory_worker.py OUT_DIR \\
        --reshard true [options]                                            # every rank

The model (:func:`build_stack`): ``layers`` square ``hidden x hidden`` float32 weights, each
layer ``x = tanh(x @ W_i)``, then the root's own ``scale`` vector (``y = x * scale``, so the root
unit has a parameter and a backward of its own), loss ``sum(y ** 2)``. Trained ``steps`` steps
with plain SGD, no momentum, written by hand (``ops.assign(p, p - lr * g)``: ``nn.SGD`` would
add two parameter-sized buffers, ``accum`` and ``stat``, even without momentum).

What is measured, per process (VmHWM is per process, so one configuration per process):

* ``baseline``: VmRSS (``/proc/self/status``) right after the model is built, before
  ``fully_shard``; then the high-water mark is reset to it (``5`` into ``/proc/self/clear_refs``)
  so the peak of building (NumPy temporaries, imports) is not counted;
* ``peak``: VmHWM after the last step; ``growth = peak - baseline``.

``--recompute-pair`` compares activation recompute, in ranks of its own or after the
``--collectives-only`` control in its ranks (a launch costs ~14 s; never after a model run: on
CPU MindSpore keeps the memory freed tensors held, and the pair would grow into the model's
unseen): :func:`build_block_stack`, a stack whose activations dominate (many rows through narrow
blocks, each ``tanh(tanh(x @ W_in) @ W_out)`` widening to ``ffn`` inside, each a
``fully_shard`` unit), trained with ``Cell.recompute()`` on every block, then a fresh copy
without. Both are measured from one baseline taken before either, without resetting the
high-water mark in between (:func:`run_recompute_pair` says why). The activations recompute
drops are counted, not guessed: the bytes of the tensors MindSpore's autograd saves during one
block's forward (its saved-tensor hooks), less the block's input, its output and its
parameters, which are held with recompute too (:func:`saved_intermediate_bytes`).

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
from typing import Optional

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

    rng = np.random.default_rng(seed)
    scale = 1.0 / math.sqrt(hidden)
    return _stack([Dense(rng.standard_normal((hidden, hidden), dtype=np.float32)
                         * np.float32(scale)) for _ in range(layers)], hidden)


def build_block_stack(layers: int, hidden: int, ffn: int, seed: int):
    """The activation-dominated stack: ``layers`` blocks ``y = tanh(tanh(x @ W_in) @ W_out)``
    with ``W_in`` ``hidden x ffn`` and ``W_out`` ``ffn x hidden``, then the root's ``scale``.
    With many rows and a narrow ``hidden`` the ``rows x ffn`` intermediate each block saves for
    backward outweighs its parameters many times over: what recompute trades for compute."""
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, mint, nn

    class Block(nn.Cell):
        def __init__(self, rng):
            super().__init__()
            self.w_in = Parameter(ms.Tensor(
                rng.standard_normal((hidden, ffn), dtype=np.float32)
                * np.float32(1.0 / math.sqrt(hidden))), name="w_in")
            self.w_out = Parameter(ms.Tensor(
                rng.standard_normal((ffn, hidden), dtype=np.float32)
                * np.float32(1.0 / math.sqrt(ffn))), name="w_out")

        def construct(self, x):
            # autograd saves x, tanh(x @ W_in) (for TanhGrad and the second matmul's grad) and
            # the output; the matmul outputs are not saved (their grads need only the operands)
            return mint.tanh(mint.matmul(mint.tanh(mint.matmul(x, self.w_in)), self.w_out))

    rng = np.random.default_rng(seed)
    return _stack([Block(rng) for _ in range(layers)], hidden)


def _stack(blocks: list, hidden: int):
    """``blocks`` applied in turn (each a ``fully_shard`` unit in the sharded runs), then the
    root's own ``scale`` (so the root unit holds a parameter)."""
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, nn

    class Stack(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList(blocks)
            self.scale = Parameter(ms.Tensor(np.ones(hidden, np.float32)), name="scale")

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x * self.scale

    return Stack()


def saved_intermediate_bytes(block, x) -> int:
    """Bytes of the tensors autograd saves in one forward of ``block`` on ``x`` that recompute
    would drop: every tensor MindSpore's saved-tensor hooks see, each storage once, less ``x``,
    the output and the block's parameters (recompute keeps the input to re-run from; the output
    is the next block's input; the parameters exist anyway)."""
    import mindspore as ms
    from mindspore import mint
    from mindspore.graph.api import saved_tensors_hooks
    saved = {}

    def pack(tensor):
        saved[tensor.data_ptr()] = tensor.nbytes     # a tensor saved by two ops counts once
        return tensor

    held = {x.data_ptr()} | {p.data_ptr() for p in block.get_parameters()}
    outputs = []

    def forward(inputs):
        with saved_tensors_hooks(pack, lambda tensor: tensor):
            out = block(inputs)
        outputs.append(out)
        return mint.sum(out)

    ms.value_and_grad(forward, None, block.trainable_params())(x)
    held.add(outputs[0].data_ptr())
    return sum(nbytes for ptr, nbytes in saved.items() if ptr not in held)


def _sync() -> None:
    from gradpool.device import synchronize
    synchronize()


def run_one(*, layers: int, hidden: int, batch: int, steps: int, sharded: bool,
            reshard_after_forward: bool, main_grad: bool, prefetch: bool, rank: int,
            world: int, device: str, from_start: bool = False) -> dict:
    """Build, measure the baseline, shard (or not), train; the record of this configuration.

    ``from_start``: the baseline is taken before anything of the run (the library's fixed
    cost, the build): the growth is all the process adds, as a user measures it, and the
    main_grad row subtracts a tiny model's run to leave what scales with the model."""
    import mindspore as ms
    import numpy as np
    from mindspore import mint, ops

    if from_start:
        gc.collect()
        meter = Meter(device)
    library_bytes = prepay_library() if sharded else 0
    model = build_stack(layers, hidden, seed=0)
    x = ms.Tensor(np.random.default_rng(1 + rank).standard_normal((batch, hidden),
                                                                   dtype=np.float32))
    gc.collect()
    _sync()
    if not from_start:
        meter = Meter(device)
    start = time.perf_counter()
    if sharded:
        _shard_units(model, reshard_after_forward=reshard_after_forward, main_grad=main_grad,
                     prefetch=prefetch)
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
        "main_grad": main_grad, "prefetch": prefetch and sharded, "from_start": from_start,
        "layers": layers, "hidden": hidden, "batch": batch, "steps": steps,
        "baseline_bytes": meter.baseline, "peak_bytes": peak,
        "growth_bytes": peak - meter.baseline, "end_rss_bytes": end_rss,
        "source": meter.source, "high_water_reset": meter.reset,
        "pool_high_water_bytes": high_water, "library_bytes": library_bytes,
        "losses": losses, "finite": all(math.isfinite(v) for v in losses),
        "step_seconds": step_seconds, "seconds": time.perf_counter() - start,
        "pid": os.getpid(),
    }


def _shard_units(model, *, reshard_after_forward: bool, main_grad: bool, prefetch: bool):
    """``fully_shard`` on every layer, then the root; each layer prefetches its neighbour."""
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


def run_recompute_pair(*, layers: int, hidden: int, ffn: int, rows: int, steps: int,
                       rank: int, world: int, device: str, order=(True, False),
                       after_control: bool = False) -> dict:
    """:class:`BlockStack` sharded (resharding, prefetch, plain mode: the suite's defaults) and
    trained ``steps`` steps with ``Cell.recompute()`` on every block, then a fresh copy without
    (``order``). One baseline for both, and the high-water mark is not reset between them: on
    CPU MindSpore keeps the memory its tensors freed (neither ``malloc_trim`` nor
    ``mindspore.runtime.empty_cache`` returns it) and the second model reuses it, so after a
    reset the second would show only its excess over the first. The lighter configuration goes
    first: each record's growth is the process's peak so far above the baseline, so the
    heavier one's is its own peak, plus whatever the first left that it could not reuse (that
    would favour recompute; measured: none, each configuration alone in its own ranks peaked
    within 5 MiB of this, docs/benchmarks/memory.md). The one-time costs (kernels for new
    shapes, collective graphs) fall in the first and stay, so both carry them. Both records,
    by name."""
    import mindspore as ms
    import numpy as np
    from mindspore import mint, ops

    start = time.perf_counter()
    prepay_library()        # fixed costs, outside both (the first would pay them otherwise)
    x = ms.Tensor(np.random.default_rng(1 + rank).standard_normal((rows, hidden),
                                                                   dtype=np.float32))
    probe = build_block_stack(1, hidden, ffn, seed=0).layers[0]
    saved_per_block = saved_intermediate_bytes(probe, x)
    del probe
    gc.collect()
    _sync()
    meter = Meter(device)
    records = {}
    for recompute in order:
        model = build_block_stack(layers, hidden, ffn, seed=0)
        if recompute:
            for layer in model.layers:
                # MindSpore's own switch, as users set it; inside a unit fully_shard runs it
                # as MindSpore's non-reentrant recompute (docs/using-fully-shard.md)
                layer.recompute()
        _shard_units(model, reshard_after_forward=True, main_grad=False, prefetch=True)
        params = model.trainable_params()

        def loss_fn(inputs, model=model):
            y = model(inputs)
            return mint.mean(y * y)     # a mean: a sum over this many rows would diverge

        grad_fn = ms.value_and_grad(loss_fn, None, params)
        losses, step_seconds = [], []
        for _ in range(steps):
            began = time.perf_counter()
            model.zero_grad()
            loss, grads = grad_fn(x)
            for param, grad in zip(params, grads):
                ops.assign(param, param - LEARNING_RATE * grad)
            del grads
            _sync()
            step_seconds.append(time.perf_counter() - began)
            losses.append(float(loss.asnumpy()))
        peak = meter.peak()
        records[f"W={world} recompute={recompute}"] = {
            "rank": rank, "world": world, "sharded": True, "recompute": recompute,
            "order": [bool(v) for v in order], "layers": layers, "hidden": hidden, "ffn": ffn,
            "rows": rows, "steps": steps, "after_control": after_control,
            "baseline_bytes": meter.baseline,
            "peak_bytes": peak, "growth_bytes": peak - meter.baseline,
            "saved_per_block_bytes": saved_per_block, "source": meter.source,
            "high_water_reset": meter.reset, "losses": losses,
            "finite": all(math.isfinite(v) for v in losses), "step_seconds": step_seconds,
            "seconds": time.perf_counter() - start, "pid": os.getpid()}
        del model, grad_fn, params, loss_fn
        gc.collect()
    return records


def run_collectives_only(*, layers: int, hidden: int, steps: int, rank: int, world: int,
                         device: str, hold: Optional[list] = None) -> dict:
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
    if hold is not None:
        # the caller measures more in this process: freed, these buffers would stay in
        # MindSpore's cache and the next model would grow into them unseen
        hold.extend((gathered, local, gradient, reduced))
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
    parser.add_argument("--from-start", action="store_true",
                        help="baseline before the library's fixed cost and the build (the "
                             "main_grad row), not after the build")
    parser.add_argument("--name", default=None, help="the record's name (default from the run)")
    parser.add_argument("--no-prefetch", action="store_true",
                        help="no forward/backward prefetch of the neighbouring layer")
    parser.add_argument("--recompute-pair", action="store_true",
                        help="the block stack with and without recompute: alone, or after "
                             "--collectives-only")
    parser.add_argument("--recompute-order", type=_flag, nargs="+", default=[True, False],
                        help="which of the pair to train, in order (true: with recompute)")
    parser.add_argument("--recompute-layers", type=int, default=8)
    parser.add_argument("--recompute-hidden", type=int, default=32)
    parser.add_argument("--recompute-ffn", type=int, default=512)
    parser.add_argument("--recompute-rows", type=int, default=4096)
    parser.add_argument("--recompute-steps", type=int, default=2)
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
    held = []
    if args.collectives_only:
        name = f"W={world} collectives only"
        record = run_collectives_only(layers=args.layers, hidden=args.hidden, steps=args.steps,
                                      rank=rank, world=world, device=args.device, hold=held)
    elif not args.recompute_pair:
        name = args.name or ("unsharded" if args.unsharded
                             else f"W={world} reshard={args.reshard}")
        record = run_one(layers=args.layers, hidden=args.hidden, batch=args.batch,
                         steps=args.steps, sharded=not args.unsharded,
                         reshard_after_forward=args.reshard, main_grad=args.main_grad,
                         prefetch=not args.no_prefetch, rank=rank, world=world,
                         device=args.device, from_start=args.from_start)
    else:
        name = record = None
    finite = True
    if record is not None:
        reporter.publish_entry("runs", name, record)
        print(f"{name} rank {rank}: growth {record['growth_bytes'] / MIB:.1f} MiB (baseline "
              f"{record['baseline_bytes'] / MIB:.1f}, peak {record['peak_bytes'] / MIB:.1f}), "
              f"pool high-water {record['pool_high_water_bytes'] / MIB:.1f} MiB, "
              f"{record['seconds']:.2f} s", flush=True)
        finite = record["finite"]
    if args.recompute_pair and not args.unsharded:
        # alone, or after the control (a launch costs ~14 s): the control leaves its buffers
        # held and its collectives' graphs, and no freed model memory the pair could grow into
        # unseen (after a model run it would: MindSpore keeps freed tensor memory on CPU)
        pair = run_recompute_pair(layers=args.recompute_layers, hidden=args.recompute_hidden,
                                  ffn=args.recompute_ffn, rows=args.recompute_rows,
                                  steps=args.recompute_steps, rank=rank, world=world,
                                  device=args.device, order=tuple(args.recompute_order),
                                  after_control=args.collectives_only)
        for pair_name, pair_record in pair.items():
            reporter.publish_entry("runs", pair_name, pair_record)
            print(f"{pair_name} rank {rank}: growth {pair_record['growth_bytes'] / MIB:.1f} MiB,"
                  f" steps {', '.join(f'{t:.2f}' for t in pair_record['step_seconds'])} s, "
                  f"{pair_record['seconds']:.2f} s since the pair began", flush=True)
            finite = finite and pair_record["finite"]
    del held
    return 0 if finite else 1


if __name__ == "__main__":
    sys.exit(main())
