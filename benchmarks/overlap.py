"""``python -m benchmarks.overlap``: how much collective latency the asynchronous reduce hides
behind backward compute, on CPU ranks, without an accelerator.

The network: every communicator of the run (the world's and each group's) is put behind one
:class:`gradpool.testing.LatencyNetwork`. The gradient reduce's collectives (the reduce-scatters;
under HSDP the replicate all-reduces, the collective the reducer leaves in flight, its
reduce-scatter being waited before the all-reduce reads it) complete a fixed wall-clock latency L
after they start, one at a time per group, using no CPU, like a network. Other collectives take
no time of their own, but a synchronous one (whose result the host reads at once, as
``check_unit_order: strict``'s agreement) waits until the links are idle: on a device the host's
read blocks until everything queued before it has run. The default order check adds no
collective: its tag rides inside the units' own.

The tiny DeepSeek-V3 model (``--layers`` decoder layers, 8 by default; main_grad mode,
``comm_fusion`` on: one reduce per unit; ``--batch-size`` 64 sequences of ``--seq-len`` 32 tokens
per rank by default, so that a layer's backward compute, and with it the latency, is large
against the step-to-step noise) trains on ``--ranks`` msrun ranks (FSDP; with
``--hsdp`` a (2, W/2) mesh) with blocking op launch, as ``gradpool train`` runs CPU ranks. Three
models train side by side in one process, stepped in turn, on the same batches:

* ``async, order check on`` (the default configuration) and ``async, order check off``: each
  step is taken twice in a row, once with the latency and once with no network (L = 0), their
  order alternating; the **exposed latency** is the median over the step pairs of
  (step with L) - (step with no network), and the latency **hidden** is
  1 - exposed / (L x the delayed collectives of the step). The same figure is also taken from
  the time the host slept waiting on the modelled network in the steps with latency (the
  network takes no CPU, so that is what the latency added; it needs no subtraction of two
  noisy step times, so it holds on a loaded machine where the step-time difference does not);
* ``sync`` (``async_reduce=False``): every unit waits for its reduce in its backward; one step
  a round with no network, beside the asynchronous steps with no network: the synchronous
  path's own cost.

After timing, the two asynchronous models' parameters must be equal bit for bit (they took the
same steps, one with a network and one without: a reduce applied twice, lost or read early
would show here).

L defaults to one decoder layer's backward compute, measured first (the time between two layers'
reduce hooks with no network, the device drained at each hook; the largest over the ranks). The
root unit's reduce starts when backward has nothing left to compute and the last layer's has only
the embedding's gradient behind it, so at most ``(layers - 1) / (layers + 1)`` of the latency can
be hidden (7/9 = 78 % with 8 layers): a figure above that is noise and is reported as such, never
as a result. ``--runs`` (3) separate launches give the spread of the figure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "deepseek3_tiny.yaml"
ORDER_ON, ORDER_OFF, SYNC = "async, order check on", "async, order check off", "sync"
VARIANTS = ((ORDER_ON, ["gradpool.check_unit_order=true"]),
            (ORDER_OFF, ["gradpool.check_unit_order=false"]),
            (SYNC, ["gradpool.async_reduce=false", "gradpool.check_unit_order=true"]))
TIMED_WITH_LATENCY = (ORDER_ON, ORDER_OFF)
BASE = ["fully_shard.comm_fusion=true", "fully_shard.apply_grad_on_fp32_main_grad=true",
        "fully_shard.reduce_dtype=float32", "gradpool.verify_gradients=false",
        "gradpool.poison_on_release=false", "gradpool.max_buckets_in_flight=2"]


# The command's batch: 2,048 tokens a rank make one layer's backward about 80 ms on 2 CPU cores
# (2 ranks), so the 9 delayed reduces inject about 0.7 s a step; with the tiny config's 32 tokens
# a layer takes about 27 ms and the step-time difference spread 31 points over 3 runs.
CLI_BATCH_SIZE, CLI_SEQ_LEN = 64, 32


class OverlapBenchmarkError(RuntimeError):
    """The benchmark's own check failed (the models trained differently) or bad options."""


@dataclass(frozen=True)
class OverlapOptions:
    layers: int = 8
    steps: int = 10                    # timed step pairs per model (after one warm-up pair)
    latency_ms: Optional[float] = None    # None: one layer's backward compute, measured
    hsdp: bool = False                 # a (2, W/2) mesh; the replicate all-reduce carries L
    batch_size: Optional[int] = None   # sequences per rank (None: the config's)
    seq_len: Optional[int] = None      # tokens per sequence (None: the config's)

    @classmethod
    def quick(cls) -> "OverlapOptions":
        return cls(steps=3)

    def overrides(self, world: int) -> list:
        out = BASE + [f"model.num_layers={self.layers}", f"launch.ranks={world}"]
        if self.batch_size is not None:
            out.append(f"model.batch_size={self.batch_size}")
        if self.seq_len is not None:
            out.append(f"model.seq_len={self.seq_len}")
        if self.hsdp:
            out += [f"fully_shard.mesh_shape=[2, {world // 2}]",
                    "fully_shard.mesh_dim_names=[dp_replicate, fsdp]"]
        return out

    @property
    def delayed(self) -> tuple:
        return ("all-reduce",) if self.hsdp else ("reduce-scatter",)


@dataclass
class VariantResult:
    name: str
    with_latency: list = field(default_factory=list)      # seconds per timed step
    no_network: list = field(default_factory=list)
    injected: list = field(default_factory=list)          # seconds of latency given per step
    blocked: list = field(default_factory=list)   # seconds the host waited for the network

    @property
    def exposed_seconds(self) -> float:
        return statistics.median(a - b for a, b in zip(self.with_latency, self.no_network))

    @property
    def injected_seconds(self) -> float:
        return statistics.median(self.injected)

    @property
    def hidden_fraction(self) -> float:
        return 1 - self.exposed_seconds / self.injected_seconds

    @property
    def blocked_hidden_fraction(self) -> float:
        """The same from the time the host waited on the network in the steps with latency
        (no subtraction of two noisy step times: the network takes no CPU)."""
        return 1 - statistics.median(self.blocked) / self.injected_seconds


@dataclass
class OverlapResult:
    options: OverlapOptions
    world: int
    latency_seconds: float
    layer_backward_seconds: float
    delayed_per_step: int
    variants: list

    def variant(self, name: str) -> VariantResult:
        return next(v for v in self.variants if v.name == name)

    @property
    def ideal_fraction(self) -> float:
        """What overlap could hide at most: every unit's reduce but the last two (the first
        layer's and the root's, with no later backward compute to hide behind)."""
        units = self.options.layers + 1
        return (units - 2) / units

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "OverlapResult":
        data = dict(data)
        data["options"] = OverlapOptions(**data["options"])
        data["variants"] = [VariantResult(**v) for v in data["variants"]]
        return cls(**data)


class _Trainer:
    """One model of one variant on its own runtime, behind its own latency network."""

    def __init__(self, overrides: list, delayed: tuple):
        import mindspore as ms
        from gradpool.app.config import load_config
        from gradpool.app.model import next_token_loss
        from gradpool.app.train import build_sharded_model, optimizer_for
        from gradpool.runtime import install_runtime
        from gradpool.testing import LatencyNetwork

        self.cfg = load_config(CONFIG, overrides)
        self.network = LatencyNetwork(0.0, delayed)
        self.runtime = install_runtime(self.cfg.gradpool, wrap=self.network.wrap)
        self.model = build_sharded_model(self.cfg)
        self.params = self.model.trainable_params()
        self.grad_fn = ms.value_and_grad(lambda t: next_token_loss(self.model, t), None,
                                         self.params)
        self.optimizer = optimizer_for(self.cfg, self.params)

    def step(self, index: int, latency: float) -> tuple:
        """(seconds, latency injected) of one optimizer step on batch ``index``."""
        import mindspore as ms
        from gradpool.app.model import make_batch_np
        from gradpool.app.train import optimizer_grads
        comm = self.runtime.comm
        tokens = ms.Tensor(make_batch_np(self.cfg.model, index, comm.rank, comm.world_size,
                                         seed=self.cfg.train.seed))
        self.network.latency_seconds = latency
        injected, blocked = self.network.injected_seconds, self.network.blocked_seconds
        start = time.perf_counter()
        self.model.zero_grad()
        _, grads = self.grad_fn(tokens)
        self.optimizer(optimizer_grads(self.cfg, self.params, grads))
        seconds = time.perf_counter() - start
        return (seconds, self.network.injected_seconds - injected,
                self.network.blocked_seconds - blocked)

    def params_bytes(self) -> list:
        return [p.asnumpy().tobytes() for p in self.params]


def _layer_backward_seconds(options: OverlapOptions, world: int) -> float:
    """Median time between two consecutive decoder layers' reduce hooks (their backward
    compute), with no latency, synchronous reduce: what one layer's backward costs here."""
    from gradpool.device import synchronize
    from gradpool.runtime import reset_runtimes
    reset_runtimes()
    trainer = _Trainer(options.overrides(world) + dict(VARIANTS)[SYNC], options.delayed)
    entered, left = {}, {}
    for index, layer in enumerate(trainer.model.layers):
        steps = layer.__dict__["_hsdp_state"].steps

        def timed(grads, steps=steps, index=index):
            # drained at both ends: the gap is the layer's compute, not only its queueing
            synchronize()
            entered.setdefault(index, []).append(time.perf_counter())
            try:
                return type(steps).on_backward(steps, grads)
            finally:
                synchronize()
                left.setdefault(index, []).append(time.perf_counter())
        steps.on_backward = timed
    for step in range(3):
        trainer.step(step, 0.0)
    gaps = [entered[i - 1][s] - left[i][s] for i in range(1, options.layers) for s in (1, 2)]
    seconds = _largest_over_ranks(trainer.runtime.comm, statistics.median(gaps))
    reset_runtimes()
    return seconds


def _largest_over_ranks(comm, values):
    """Each of ``values`` (a float or a list of them), its largest over the ranks."""
    many = isinstance(values, list)
    flat = list(values) if many else [values]
    if comm.world_size > 1:
        import mindspore as ms
        import numpy as np
        out = ms.Tensor(np.zeros(comm.world_size * len(flat), np.float32))
        comm.all_gather(out, ms.Tensor(np.array(flat, np.float32))).wait()
        flat = out.asnumpy().reshape(comm.world_size, len(flat)).max(axis=0).tolist()
    return [float(v) for v in flat] if many else float(flat[0])


def run(options: OverlapOptions = OverlapOptions()) -> OverlapResult:
    """One run on this process's ranks (world size 1 outside msrun)."""
    from gradpool.comm import init_distributed
    from gradpool.runtime import reset_runtimes
    if options.layers < 2:
        raise OverlapBenchmarkError(f"--layers must be >= 2, got {options.layers}")
    if options.latency_ms is not None and not options.latency_ms > 0:
        raise OverlapBenchmarkError(f"--latency-ms must be > 0, got {options.latency_ms}")
    _, world = init_distributed()
    if options.hsdp and (world < 4 or world % 2):
        raise OverlapBenchmarkError(f"--hsdp needs an even world size >= 4, got {world}")
    layer_seconds = _layer_backward_seconds(options, world)
    latency = layer_seconds if options.latency_ms is None else options.latency_ms / 1e3
    reset_runtimes()
    trainers = {name: _Trainer(options.overrides(world) + extra, options.delayed)
                for name, extra in VARIANTS}
    results = {name: VariantResult(name) for name, _ in VARIANTS}
    delayed_per_step = 0
    try:
        for round_ in range(1 + options.steps):
            for name, trainer in trainers.items():       # in turn: the same machine state
                result = results[name]
                # the L step and the no-network step alternate which goes first
                order = (latency, 0.0) if round_ % 2 == 0 else (0.0, latency)
                if name not in TIMED_WITH_LATENCY:
                    order = (0.0,)              # one step a round: its own cost only
                timed = []
                for k, given in enumerate(order):
                    timed.append((given,) + trainer.step(2 * round_ + k, given))
                if not round_:
                    continue                                # the warm-up pair
                for given, seconds, injected, blocked in timed:
                    if given > 0:
                        result.with_latency.append(seconds)
                        result.injected.append(injected)
                        result.blocked.append(blocked)
                        delayed_per_step = round(injected / latency)
                    else:
                        result.no_network.append(seconds)
        for name in TIMED_WITH_LATENCY:       # a rank's wait holds the others up in turn
            results[name].blocked = _largest_over_ranks(trainers[name].runtime.comm.inner,
                                                        results[name].blocked)
        if trainers[ORDER_ON].params_bytes() != trainers[ORDER_OFF].params_bytes():
            raise OverlapBenchmarkError("the models with the order check on and off trained "
                                        "other parameters")
    finally:
        reset_runtimes()
    return OverlapResult(options, world, latency, layer_seconds, delayed_per_step,
                         [results[name] for name, _ in VARIANTS])


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def _hidden_text(fraction: float, ideal: float) -> str:
    """The figure, unless it is above what overlap can hide: then it is noise, said so."""
    if fraction > ideal:
        return f"{_pct(fraction)}, above the ideal {_pct(ideal)} (noise, not a result)"
    return _pct(fraction)


def describe(options: OverlapOptions, world: int) -> str:
    mesh = f"HSDP (2, {world // 2})" if options.hsdp else "FSDP"
    return (f"{world} rank{'s' if world > 1 else ''} {mesh}, tiny DeepSeek-V3 with "
            f"{options.layers} decoder layers, comm_fusion on, main_grad mode")


def report_lines(result: OverlapResult, label: str = "overlap") -> list:
    """What one run prints; the last line is its summary."""
    opts, ideal = result.options, result.ideal_fraction
    kind = "replicate all-reduce" if opts.hsdp else "reduce-scatter"
    lines = [f"{label}: {describe(opts, result.world)}; latency {result.latency_seconds * 1e3:.1f}"
             f" ms on each {kind} ({result.delayed_per_step} per step; one layer's backward "
             f"compute {result.layer_backward_seconds * 1e3:.1f} ms); median of "
             f"{opts.steps} step pairs per model, stepped in turn"]
    width = max(len(v.name) for v in result.variants)
    for v in result.variants:
        if v.name in TIMED_WITH_LATENCY:
            lines.append(
                f"  {v.name:<{width}}  step {statistics.median(v.with_latency) * 1e3:7.1f} ms "
                f"with latency, {statistics.median(v.no_network) * 1e3:7.1f} ms with no network;"
                f" exposed {v.exposed_seconds * 1e3:6.1f} of {v.injected_seconds * 1e3:6.1f} ms "
                f"injected: hidden {_hidden_text(v.hidden_fraction, ideal)}; host waited on the "
                f"network {statistics.median(v.blocked) * 1e3:6.1f} ms a step: hidden "
                f"{_hidden_text(v.blocked_hidden_fraction, ideal)}")
    sync, asyn = result.variant(SYNC), result.variant(ORDER_ON)
    sync_ms = statistics.median(sync.no_network) * 1e3
    async_ms = statistics.median(asyn.no_network) * 1e3
    lines.append(f"  synchronous path, no network: step {sync_ms:.1f} ms against the "
                 f"asynchronous {async_ms:.1f} ms ({sync_ms / async_ms:.2f}x)")
    lines.append(f"  ideal for {opts.layers} layers: {_pct(ideal)} ({opts.layers - 1} of "
                 f"{opts.layers + 1} reduces: the first layer's and the root's have no later "
                 "backward compute to hide behind)")
    on, off = result.variant(ORDER_ON), result.variant(ORDER_OFF)
    lines.append(f"{label}: latency hidden {_hidden_text(on.hidden_fraction, ideal)} with the "
                 f"order check on (the default), {_hidden_text(off.hidden_fraction, ideal)} "
                 f"with it off (host waits: {_hidden_text(on.blocked_hidden_fraction, ideal)}, "
                 f"{_hidden_text(off.blocked_hidden_fraction, ideal)}); ideal {_pct(ideal)}")
    return lines


def summary_lines(results: list) -> list:
    """min / median / max of the hidden figure over the runs, per variant."""
    ideal = results[0].ideal_fraction
    lines = [f"overlap over {len(results)} runs: {describe(results[0].options, results[0].world)}"]
    for name in TIMED_WITH_LATENCY:
        for how, figure in (("step time with - without latency", "hidden_fraction"),
                            ("host waits on the network", "blocked_hidden_fraction")):
            figures = sorted(getattr(r.variant(name), figure) for r in results)
            spread = (figures[-1] - figures[0]) * 100
            shown = " / ".join(_hidden_text(f, ideal) for f in
                               (figures[0], statistics.median(figures), figures[-1]))
            lines.append(f"  {name}, {how}: latency hidden min / median / max {shown}; "
                         f"spread {spread:.0f} points; ideal {_pct(ideal)}")
    ratios = sorted(statistics.median(r.variant(SYNC).no_network)
                    / statistics.median(r.variant(ORDER_ON).no_network) for r in results)
    lines.append(f"  synchronous path, no network, against the asynchronous: "
                 f"{ratios[0]:.2f}x / {statistics.median(ratios):.2f}x / {ratios[-1]:.2f}x")
    return lines


def _rank_side(out: Path, options: OverlapOptions) -> None:
    import mindspore as ms
    from gradpool.comm import init_distributed
    from gradpool.device import block_launches
    ms.set_device("CPU")
    rank, _ = init_distributed()
    block_launches()            # as gradpool train runs CPU ranks
    result = run(options)
    if rank == 0:
        out.write_text(json.dumps(result.to_json()))


def run_launched(options: OverlapOptions, ranks: int, work: Path) -> OverlapResult:
    """One run on ``ranks`` msrun ranks (a process of its own: ``ranks`` 1 too)."""
    from gradpool.app.launch import run_ranks
    out = work / "result.json"
    args = ["--rank-side", str(out), "--layers", str(options.layers), "--steps",
            str(options.steps)] + (["--hsdp"] if options.hsdp else []) + (
        ["--latency-ms", str(options.latency_ms)] if options.latency_ms is not None else []) + (
        ["--batch-size", str(options.batch_size)] if options.batch_size is not None else []) + (
        ["--seq-len", str(options.seq_len)] if options.seq_len is not None else [])
    run_ranks(Path(__file__), args=args, nproc=ranks, log_dir=work / "logs", timeout=3600)
    return OverlapResult.from_json(json.loads(out.read_text()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 step pairs per model, one run")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hsdp", action="store_true", help="a (2, ranks/2) mesh")
    parser.add_argument("--layers", type=int, default=OverlapOptions.layers)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-ms", type=float, default=None,
                        help="default: one layer's backward compute, measured in the first run "
                             "and kept for the others")
    parser.add_argument("--batch-size", type=int, default=CLI_BATCH_SIZE,
                        help="sequences per rank (more: more backward compute per layer)")
    parser.add_argument("--seq-len", type=int, default=CLI_SEQ_LEN, help="tokens per sequence")
    parser.add_argument("--out", type=Path, default=None,
                        help="also append the result as Markdown to this file")
    parser.add_argument("--rank-side", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    base = OverlapOptions.quick() if args.quick else OverlapOptions()
    options = OverlapOptions(layers=args.layers, latency_ms=args.latency_ms, hsdp=args.hsdp,
                             steps=args.steps if args.steps is not None else base.steps,
                             batch_size=args.batch_size, seq_len=args.seq_len)
    if args.rank_side is not None:
        _rank_side(args.rank_side, options)
        return 0
    runs = 1 if args.quick else args.runs
    load_before = os.getloadavg()[0]
    results, lines = [], []
    for index in range(runs):
        with tempfile.TemporaryDirectory(prefix="gradpool-overlap-") as work:
            result = run_launched(options, args.ranks, Path(work))
        if options.latency_ms is None:      # the later runs take the first run's latency
            options = replace(options, latency_ms=round(result.latency_seconds * 1e3, 1))
        results.append(result)
        for line in report_lines(result, f"overlap run {index + 1}"):
            print(line, flush=True)
            lines.append(line)
    for line in summary_lines(results):
        print(line, flush=True)
        lines.append(line)
    if args.out is not None:
        command = "python -m benchmarks.overlap " + " ".join(argv if argv is not None
                                                             else sys.argv[1:])
        with args.out.open("a") as f:
            f.write(f"\n`{command}` at commit {_commit()}, on {os.cpu_count()} CPU cores "
                    f"(load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
                    "the machine was shared):\n\n```\n" + "\n".join(lines) + "\n```\n")
        print(f"appended to {args.out}")
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
