"""``gradpool bench --suite overlap``: how much collective latency the asynchronous reduce hides
behind backward compute, on a CPU, without an accelerator.

Every collective goes through :class:`gradpool.testing.LatencyCommunicator`: it completes a fixed
wall-clock latency L after it starts, one at a time (one link), using no CPU, like a network.
The tiny DeepSeek-V3 model trains at world size 1, in main_grad mode with ``comm_fusion`` (one
reduce bucket per unit), in three modes, their steps interleaved:

* ``sync``: ``async_reduce=False``: every unit waits for its reduce inside its backward;
* ``async``: each unit's backward only launches its reduce; the root's backward end waits;
* ``async, max_buckets_in_flight=1``: the same, with the pool's bound at one fenced input bucket.

L defaults to one decoder layer's backward compute, measured first (the time between two layers'
reduce hooks with L = 0, the device drained at each hook). The model has ``--layers`` decoder
layers (8 by default, where the shipped tiny config has 2): the root unit's reduce starts when
backward has nothing left to compute, and the last layer's has only the embedding's gradient
behind it, so at most
``(layers - 1) / (layers + 1)`` of the latency can be hidden (1/3 with 2 layers, 7/9 with 8).

Each timed step is followed by a control step of the same model with no network (L = 0). The
summary line reports the latency hidden net of that control: ((sync - async) - (the same
difference with no network)) / (collectives per step x L). The gross (sync - async) / (collectives
per step x L) is printed above it; it also counts the synchronous path's own cost. The three models start equal and see the same
batches, so after timing their parameters must be equal bit for bit (checked: a reduce
applied twice, lost or read early would show here).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "deepseek3_tiny.yaml"
MODES = (("sync", ["gradpool.async_reduce=false"]),
         ("async", []),
         ("async, max_buckets_in_flight=1", ["gradpool.max_buckets_in_flight=1"]))
BASE = ["fully_shard.comm_fusion=true", "fully_shard.apply_grad_on_fp32_main_grad=true",
        "fully_shard.reduce_dtype=float32", "gradpool.verify_gradients=false",
        "gradpool.poison_on_release=false", "gradpool.max_buckets_in_flight=2"]


class OverlapBenchmarkError(RuntimeError):
    """The benchmark's own check failed (the modes trained differently)."""


@dataclass(frozen=True)
class OverlapOptions:
    layers: int = 8
    steps: int = 8                     # timed steps per mode (after one warm-up step)
    latency_ms: Optional[float] = None    # None: one layer's backward compute, measured

    @classmethod
    def quick(cls) -> "OverlapOptions":
        return cls(steps=3)


@dataclass
class ModeResult:
    name: str
    step_seconds: list = field(default_factory=list)
    high_water_bytes: int = 0
    stalls: list = field(default_factory=list)        # per timed step
    collectives: list = field(default_factory=list)   # per timed step
    no_network_seconds: list = field(default_factory=list)   # the same steps at L = 0

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_seconds) * 1e3

    @property
    def no_network_median_ms(self) -> float:
        return statistics.median(self.no_network_seconds) * 1e3


@dataclass
class OverlapResult:
    options: OverlapOptions
    latency_seconds: float
    layer_backward_seconds: float
    modes: list

    def mode(self, name: str) -> ModeResult:
        return next(m for m in self.modes if m.name == name)

    @property
    def collectives_per_step(self) -> int:
        return self.mode("sync").collectives[-1]

    @property
    def hidden_fraction(self) -> float:
        saved = (self.mode("sync").median_ms - self.mode("async").median_ms) / 1e3
        return saved / (self.collectives_per_step * self.latency_seconds)

    @property
    def ideal_fraction(self) -> float:
        """What overlap could hide at most: every collective but the last two (the first
        layer's reduce and the root's run when no backward compute is left to hide them)."""
        return max(0, self.collectives_per_step - 2) / self.collectives_per_step

    @property
    def hidden_fraction_net(self) -> float:
        """The same, less the sync-async difference that remains with no network at all (a
        synchronous wait also stops the host from queueing compute ahead of the device)."""
        sync, asyn = self.mode("sync"), self.mode("async")
        saved = ((sync.median_ms - asyn.median_ms)
                 - (sync.no_network_median_ms - asyn.no_network_median_ms)) / 1e3
        return saved / (self.collectives_per_step * self.latency_seconds)


class _Trainer:
    """One model of one mode on its own runtime (pool + latency network)."""

    def __init__(self, overrides: list, latency_seconds: float):
        import mindspore as ms
        from gradpool.app.config import load_config
        from gradpool.app.train import build_sharded_model, optimizer_for
        from gradpool.comm import SingleProcessCommunicator
        from gradpool.runtime import install_runtime
        from gradpool.testing import LatencyCommunicator
        from gradpool.app.model import next_token_loss

        self.cfg = load_config(CONFIG, overrides)
        self.comm = LatencyCommunicator(SingleProcessCommunicator(), latency_seconds)
        self.runtime = install_runtime(self.cfg.gradpool, self.comm)
        self.model = build_sharded_model(self.cfg)
        self.params = self.model.trainable_params()
        self.grad_fn = ms.value_and_grad(lambda t: next_token_loss(self.model, t), None,
                                         self.params)
        self.optimizer = optimizer_for(self.cfg, self.params)

    def step(self, index: int) -> tuple:
        """(seconds, collectives, stalls) of one optimizer step."""
        import mindspore as ms
        from gradpool.app.model import make_batch_np
        from gradpool.app.train import optimizer_grads
        tokens = ms.Tensor(make_batch_np(self.cfg.model, index, 0, 1, seed=self.cfg.train.seed))
        launches, stalls = self.comm.launches, self.runtime.pool.stats().stalls
        start = time.perf_counter()
        self.model.zero_grad()
        _, grads = self.grad_fn(tokens)
        self.optimizer(optimizer_grads(self.cfg, self.params, grads))
        seconds = time.perf_counter() - start
        return seconds, self.comm.launches - launches, self.runtime.pool.stats().stalls - stalls

    def params_bytes(self) -> list:
        return [p.asnumpy().tobytes() for p in self.params]


def _layer_backward_seconds(layers: int) -> float:
    """Median time between two consecutive decoder layers' reduce hooks (their backward compute),
    with no latency, synchronous reduce: what one layer's backward costs on this machine."""
    from gradpool.device import synchronize
    from gradpool.runtime import reset_runtimes
    reset_runtimes()
    trainer = _Trainer(BASE + MODES[0][1] + [f"model.num_layers={layers}"], 0.0)
    entered, left = {}, {}
    for index, layer in enumerate(trainer.model.layers):
        steps = layer.__dict__["_hsdp_state"].steps

        def timed(grads, steps=steps, index=index):
            # PyNative queues kernels and runs them on its own threads: drained at both ends,
            # the gap is the layer's compute, not only the host's time to queue it
            synchronize()
            entered.setdefault(index, []).append(time.perf_counter())
            try:
                return type(steps).on_backward(steps, grads)
            finally:
                synchronize()
                left.setdefault(index, []).append(time.perf_counter())
        steps.on_backward = timed
    for step in range(3):
        trainer.step(step)
    gaps = [entered[i - 1][s] - left[i][s] for i in range(1, layers) for s in (1, 2)]
    reset_runtimes()
    return statistics.median(gaps)


def run(options: OverlapOptions = OverlapOptions()) -> OverlapResult:
    import mindspore as ms
    from gradpool.runtime import reset_runtimes
    ms.set_device("CPU")
    if options.layers < 2:
        raise OverlapBenchmarkError(f"--layers must be >= 2, got {options.layers}")
    if options.latency_ms is not None and not options.latency_ms > 0:
        raise OverlapBenchmarkError(f"--latency-ms must be > 0, got {options.latency_ms}")
    layer_seconds = _layer_backward_seconds(options.layers)
    latency = layer_seconds if options.latency_ms is None else options.latency_ms / 1e3
    reset_runtimes()
    trainers = {name: _Trainer(BASE + extra + [f"model.num_layers={options.layers}"], latency)
                for name, extra in MODES}
    results = {name: ModeResult(name) for name, _ in MODES}
    try:
        for step in range(1 + options.steps):
            for name, trainer in trainers.items():       # interleaved: same machine state
                trainer.comm.latency_seconds = latency
                seconds, collectives, stalls = trainer.step(2 * step)
                trainer.comm.latency_seconds = 0.0       # the control: no network
                control, _, _ = trainer.step(2 * step + 1)
                if step:                                  # step 0 warms up
                    results[name].step_seconds.append(seconds)
                    results[name].collectives.append(collectives)
                    results[name].stalls.append(stalls)
                    results[name].no_network_seconds.append(control)
        for name, trainer in trainers.items():
            results[name].high_water_bytes = trainer.runtime.pool.stats().high_water_bytes
        reference = trainers["sync"].params_bytes()
        for name, trainer in trainers.items():
            if trainer.params_bytes() != reference:
                raise OverlapBenchmarkError(
                    f"mode {name!r} trained other parameters than the synchronous mode")
    finally:
        reset_runtimes()
    return OverlapResult(options, latency, layer_seconds, [results[name] for name, _ in MODES])


def report_lines(result: OverlapResult) -> list:
    """What ``gradpool bench --suite overlap`` prints; the last line is the summary."""
    opts = result.options
    lines = [f"overlap: tiny DeepSeek-V3 model with {opts.layers} decoder layers, world size 1, "
             f"comm_fusion on, main_grad mode; {result.collectives_per_step} collectives per step, "
             f"each {result.latency_seconds * 1e3:.2f} ms on one link (one layer's backward "
             f"compute: {result.layer_backward_seconds * 1e3:.2f} ms); median of {opts.steps} "
             "steps per mode, interleaved"]
    width = max(len(m.name) for m in result.modes)
    for mode in result.modes:
        spread = (min(mode.step_seconds) * 1e3, max(mode.step_seconds) * 1e3)
        lines.append(f"  {mode.name:<{width}}  step {mode.median_ms:8.1f} ms "
                     f"(min {spread[0]:.1f}, max {spread[1]:.1f})  pool high-water "
                     f"{mode.high_water_bytes / 1024:.1f} KiB  stalls/step "
                     f"{statistics.fmean(mode.stalls):.1f}  (no network: "
                     f"{mode.no_network_median_ms:.1f} ms)")
    sync, asyn = result.mode("sync"), result.mode("async")
    lines.append(f"  gross (sync - async, {result.hidden_fraction * 100:.0f}% of the modelled "
                 f"latency) counts the synchronous path's own cost, which remains with no "
                 f"network (sync {sync.no_network_median_ms:.1f} ms, async "
                 f"{asyn.no_network_median_ms:.1f} ms); the figure below is net of it")
    lines.append(f"  ideal for {opts.layers} layers: {result.ideal_fraction * 100:.0f}% "
                 f"({result.collectives_per_step - 2} of {result.collectives_per_step} "
                 "collectives: the first layer's and the root's reduce have no later backward "
                 "compute to hide behind)")
    lines.append(f"overlap: sync {sync.median_ms:.1f} ms, async {asyn.median_ms:.1f} ms, latency "
                 f"hidden {result.hidden_fraction_net * 100:.0f}% (net of the no-network "
                 "control)")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 timed steps per mode")
    parser.add_argument("--layers", type=int, default=OverlapOptions.layers)
    parser.add_argument("--latency-ms", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the result as Markdown (docs/benchmarks/overlap.md)")
    args = parser.parse_args(argv)
    base = OverlapOptions.quick() if args.quick else OverlapOptions()
    options = OverlapOptions(layers=args.layers, steps=base.steps, latency_ms=args.latency_ms)
    load_before = os.getloadavg()[0]
    lines = report_lines(run(options))
    for line in lines:
        print(line, flush=True)
    if args.out is not None:
        command = "python -m benchmarks.overlap " + " ".join(argv if argv is not None
                                                             else sys.argv[1:])
        args.out.write_text(
            "# Overlap benchmark\n\n"
            f"`{command}` at commit {_commit()}, on {os.cpu_count()} CPU cores (load average "
            f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after: read the ratios, not "
            "the absolute times). What it measures: see `benchmarks/overlap.py`.\n\n"
            "```\n" + "\n".join(lines) + "\n```\n")
        print(f"wrote {args.out}")
    return 0


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
