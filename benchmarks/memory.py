"""``gradpool bench --suite memory``: per-rank memory of a dense stack, unsharded and sharded.

One process per configuration (VmHWM is per process): the stack unsharded in one process, then
under ``fully_shard`` on each world size in ``worlds`` (msrun ranks), with
``reshard_after_forward`` on and off, and the control: the same world's collectives, with the
stack's shapes and counts, and no model (MindSpore's CPU collectives run as compiled graphs that
keep memory of their own; the control measures it). Each process is
:mod:`benchmarks.memory_worker`; it publishes its record into its rank report, read back here. Next to each measured figure stands
the memory plan's prediction (:func:`gradpool.app.plan.plan_memory`) for the same model.

What is compared: ``growth`` is a process's peak above its RSS right after the model was built
(the built full parameters are in that baseline; ``fully_shard`` releases them). The plan
predicts all the model holds at the peak, so it is set against ``growth + full model bytes``
(activations, ``batch x hidden`` per layer, are left out of both: 128 KiB a layer at the
defaults).

The recompute row: on the first world size, a second model, one whose activations dominate
(:func:`benchmarks.memory_worker.build_block_stack`: many rows through narrow blocks that widen
inside, each block a unit), trained with ``Cell.recompute()`` on every block and then without in
the same ranks, both peaks above one baseline, next to the activations recompute drops: each
block's saved intermediates, counted with MindSpore's saved-tensor hooks, times the blocks. One
block's are rebuilt at a time in backward, so the peaks should differ by about ``blocks - 1``
blocks' worth. The full run gives the pair ranks of its own; ``--quick`` runs it in the control's
ranks after the control (a launch costs ~14 s): the same difference, both peaks lower by what the
control leaves that the pair reuses (docs/benchmarks/memory.md).

The main_grad row: the same stack in main_grad mode (``apply_grad_on_fp32_main_grad``, the
asynchronous reduce, the optimizer fed from ``p.main_grad``), as a user measures a job: each
process's peak above its RSS before anything of the run (the library's fixed cost and the build
included), less the same measurement of a tiny model (the stack at ``tiny_hidden``: imports,
compiled host loops, kernels and collective graphs, which do not scale with the model), against
the same difference for the unsharded process. Four processes per world size (the stack and the
tiny one, unsharded and sharded); the full run only. ``--main-grad-only`` runs nothing else.

The MoE rows (:mod:`benchmarks.memory_moe`): the tiny DeepSeek model with expert-heavy sizes at
4 ranks, expert parallelism 1 (plain FSDP) against 2 and 4, each its own launch, the model memory
at the peak beside the plan's prediction for the same config (with its activation estimate).
``--quick`` runs EP 1 and 4 only, 2 steps; ``--moe-only`` runs nothing else.

    python -m benchmarks.memory [--quick] [--moe-only] [--main-grad-only]
                                [--layers N --hidden H --batch B --steps S]
"""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from benchmarks.memory_moe import MoeOptions, MoeRun, predicted as moe_predicted
from benchmarks.memory_moe import report_lines as moe_report_lines
from gradpool.app.config import from_dict
from gradpool.app.model import ParamSpec
from gradpool.app.plan import plan_memory
from gradpool.app.rank_report import read_reports

MIB = 2 ** 20
WORKER = Path(__file__).with_name("memory_worker.py")
MOE_WORKER = Path(__file__).with_name("memory_moe.py")


class MemoryBenchmarkError(RuntimeError):
    """A run failed or trained to a non-finite loss."""


@dataclass(frozen=True)
class MemoryOptions:
    layers: int = 8
    hidden: int = 2048
    batch: int = 16
    steps: int = 3
    worlds: tuple = (2, 4)
    reshard: tuple = (True, False)
    control: bool = True               # also run each world's collectives without a model
    timeout: float = 900.0
    # the recompute row (None: left out): the block stack's blocks, width, inner width, rows a
    # rank and steps; 8 x 4096 x 512 float32 intermediates are 8 MiB a block, 64 MiB a rank,
    # against 128 KiB of weights a block
    recompute_layers: Optional[int] = 8
    recompute_hidden: int = 32
    recompute_ffn: int = 512
    recompute_rows: int = 4096
    recompute_steps: int = 2
    # ranks of its own for the pair (~20 s more on 2 cores); else it runs in the first world's
    # control ranks, after the control: the same difference, both peaks ~10 MiB lower (what the
    # control leaves that the pair reuses; docs/benchmarks/memory.md)
    recompute_alone: bool = True
    # the MoE rows (None: left out): the tiny DeepSeek model, expert-heavy, EP 1 against E > 1
    # at one world size, each EP its own launch (benchmarks/memory_moe.py)
    moe: Optional[MoeOptions] = MoeOptions()
    # the main_grad row (False: left out): the stack in main_grad mode against the unsharded
    # process, each net of the same run of the stack at tiny_hidden (its fixed cost)
    main_grad_row: bool = True
    tiny_hidden: int = 64

    @classmethod
    def quick(cls) -> "MemoryOptions":
        # the default stack's shape and both modes, fewer steps: the steady state is reached
        # after the first step (every buffer the step needs exists by then); the recompute
        # pair's peak is its first step's too (the same activations every step), and it rides
        # in the control's ranks rather than pay a launch; no main_grad row (its figure is
        # the full run's: four more processes per world size)
        return cls(steps=2, recompute_steps=1, recompute_alone=False, moe=MoeOptions.quick(),
                   main_grad_row=False)

    def worker_args(self, hidden: Optional[int] = None) -> list:
        return ["--layers", str(self.layers), "--hidden", str(hidden or self.hidden),
                "--batch", str(self.batch), "--steps", str(self.steps)]

    def recompute_args(self) -> list:
        return ["--recompute-pair", "--recompute-layers", str(self.recompute_layers),
                "--recompute-hidden", str(self.recompute_hidden),
                "--recompute-ffn", str(self.recompute_ffn),
                "--recompute-rows", str(self.recompute_rows),
                "--recompute-steps", str(self.recompute_steps)]

    @property
    def model_bytes(self) -> int:
        return (self.layers * self.hidden + 1) * self.hidden * 4


@dataclass
class Run:
    """One configuration: its per-rank records and the plan's prediction."""
    name: str
    world: int
    reshard_after_forward: Optional[bool]
    records: list = field(default_factory=list)
    plan_bytes: Optional[int] = None

    @property
    def growth_bytes(self) -> int:
        """The largest rank's growth: what a card must hold."""
        return max(r["growth_bytes"] for r in self.records)

    @property
    def pool_high_water_bytes(self) -> int:
        return max(r["pool_high_water_bytes"] for r in self.records)


@dataclass
class RecomputeRow:
    """The block stack trained with and without recompute on every block, in the same ranks."""
    world: int
    with_recompute: Run
    without: Run
    alone: bool = True          # ranks of its own, or after the collectives-only control

    @property
    def saved_per_block_bytes(self) -> int:
        """Counted per rank on that rank's rows; the largest (every rank has as many rows)."""
        return max(r["saved_per_block_bytes"] for r in self.without.records)

    @property
    def blocks(self) -> int:
        return self.without.records[0]["layers"]

    @property
    def saved_bytes(self) -> int:
        """The activations recompute drops from what the forward keeps: every block's."""
        return self.blocks * self.saved_per_block_bytes

    @property
    def expected_drop_bytes(self) -> int:
        """What the peak should lose: backward rebuilds one block's at a time."""
        return (self.blocks - 1) * self.saved_per_block_bytes

    @property
    def drop_bytes(self) -> int:
        """Measured, on the largest rank of each (what a card must hold)."""
        return self.without.growth_bytes - self.with_recompute.growth_bytes


@dataclass
class MainGradRow:
    """The stack and the tiny stack in main_grad mode, growth from the start of each process:
    ``runs[(world, tiny)]``, world 1 the unsharded process."""
    runs: dict = field(default_factory=dict)

    @property
    def worlds(self) -> list:
        return sorted({world for world, _ in self.runs if world > 1})

    def net_bytes(self, world: int) -> int:
        """The largest rank's growth less the tiny model's on the same rank: what scales with
        the model on a card."""
        big, tiny = self.runs[(world, False)].records, self.runs[(world, True)].records
        return max(b["growth_bytes"] - t["growth_bytes"] for b, t in zip(big, tiny))

    def ratio(self, world: int) -> float:
        return self.net_bytes(world) / self.net_bytes(1)


@dataclass
class MemoryResult:
    options: MemoryOptions
    runs: list
    controls: dict = field(default_factory=dict)     # world -> the collectives-only Run
    recompute: Optional[RecomputeRow] = None
    main_grad: Optional[MainGradRow] = None
    moe: list = field(default_factory=list)          # of MoeRun, in options.moe.eps order

    def run(self, world: int, reshard: Optional[bool] = True) -> Run:
        return next(r for r in self.runs
                    if r.world == world and r.reshard_after_forward == reshard)

    @property
    def unsharded(self) -> Run:
        return self.run(1, None)

    def ratio(self, world: int) -> float:
        return self.run(world).growth_bytes / self.unsharded.growth_bytes


def stack_specs(layers: int, hidden: int) -> list:
    """The parameters of :func:`benchmarks.memory_worker.build_stack`, by unit."""
    return ([ParamSpec("scale", (hidden,), "root")]
            + [ParamSpec(f"layers.{i}.weight", (hidden, hidden), f"layers.{i}")
               for i in range(layers)])


def predicted_bytes(options: MemoryOptions, world: int, reshard: bool) -> int:
    """The plan's "as implemented" bytes for the stack as the worker trains it."""
    cfg = from_dict({}, [f"launch.ranks={world}", f"fully_shard.reshard_after_forward={reshard}",
                         "fully_shard.apply_grad_on_fp32_main_grad=false",
                         "fully_shard.reduce_dtype=float32", "train.optimizer=sgd"])
    plan = plan_memory(cfg, specs=stack_specs(options.layers, options.hidden))
    return plan.context.as_implemented_bytes


def _records(out_dir: Path, world: int, name: str) -> list:
    records = []
    for rank, report in enumerate(read_reports(out_dir, world)):
        record = (report.results.get("runs", {}).get(name) if report else None)
        if record is None:
            raise MemoryBenchmarkError(f"{name}: rank {rank} published no record in {out_dir}")
        if not record["finite"]:
            raise MemoryBenchmarkError(f"{name}: rank {rank} trained to a non-finite loss "
                                       f"{record['losses']}")
        records.append(record)
    return records


def _run_unsharded(options: MemoryOptions, out_dir: Path) -> Run:
    done = subprocess.run([sys.executable, str(WORKER), str(out_dir), "--unsharded",
                           *options.worker_args()], capture_output=True, text=True,
                          timeout=options.timeout, check=False)
    if done.returncode != 0:
        raise MemoryBenchmarkError(f"the unsharded run failed (exit {done.returncode}): "
                                   f"{done.stderr[-2000:]}")
    return Run("unsharded", 1, None, _records(out_dir, 1, "unsharded"))


def _launch(options: MemoryOptions, out_dir: Path, world: int, name: Optional[str],
            flags: list, label: Optional[str] = None, worker: Path = WORKER,
            sizes: Optional[list] = None) -> list:
    """Run ``worker`` on ``world`` ranks; the records published under ``name`` (None: none
    read here). ``label`` names the launch in errors (default ``name``); ``sizes`` the model's
    arguments (default the dense stack's)."""
    from gradpool.app.launch import LaunchError, run_ranks
    sizes = options.worker_args() if sizes is None else sizes
    try:
        run_ranks(worker, [str(out_dir), *flags, *sizes], nproc=world,
                  log_dir=out_dir / "logs", report_dir=out_dir, timeout=options.timeout)
    except LaunchError as exc:
        raise MemoryBenchmarkError(f"{label or name}: {exc}") from None
    return _records(out_dir, world, name) if name is not None else []


def _run_sharded(options: MemoryOptions, out_dir: Path, world: int, reshard: bool) -> Run:
    name = f"W={world} reshard={reshard}"
    run = Run(name, world, reshard,
              _launch(options, out_dir, world, name, ["--reshard", str(reshard).lower()]))
    run.plan_bytes = predicted_bytes(options, world, reshard)
    return run


def _pair(out_dir: Path, world: int) -> RecomputeRow:
    runs = {on: Run(f"W={world} recompute={on}", world, True,
                    _records(out_dir, world, f"W={world} recompute={on}"))
            for on in (True, False)}
    return RecomputeRow(world, runs[True], runs[False],
                        alone=not runs[True].records[0].get("after_control", False))


def _run_control(options: MemoryOptions, out_dir: Path, world: int, recompute: bool = False):
    """The control's Run, and with ``recompute`` the RecomputeRow its ranks ran after it."""
    name = f"W={world} collectives only"
    flags = ["--collectives-only"] + (options.recompute_args() if recompute else [])
    control = Run(name, world, None, _launch(options, out_dir, world, name, flags))
    return control, (_pair(out_dir, world) if recompute else None)


def _run_recompute_alone(options: MemoryOptions, out_dir: Path, world: int) -> RecomputeRow:
    _launch(options, out_dir, world, None, options.recompute_args(),
            label=f"W={world} recompute pair")
    return _pair(out_dir, world)


def _main_grad_name(world: int, tiny: bool) -> str:
    return f"main_grad W={world}" + (" tiny" if tiny else "")


def _run_main_grad_one(options: MemoryOptions, out_dir: Path, world: int, tiny: bool) -> Run:
    name = _main_grad_name(world, tiny)
    flags = ["--main-grad", "--from-start", "--name", name]
    sizes = options.worker_args(options.tiny_hidden if tiny else None)
    if world > 1:
        return Run(name, world, True, _launch(options, out_dir, world, name, flags, sizes=sizes))
    done = subprocess.run([sys.executable, str(WORKER), str(out_dir), "--unsharded", *flags,
                           *sizes], capture_output=True, text=True, timeout=options.timeout,
                          check=False)
    if done.returncode != 0:
        raise MemoryBenchmarkError(f"{name} failed (exit {done.returncode}): "
                                   f"{done.stderr[-2000:]}")
    return Run(name, 1, None, _records(out_dir, 1, name))


def run_main_grad_row(options: MemoryOptions, out_dir=None) -> MainGradRow:
    """The main_grad row alone: unsharded, then each world size, the tiny stack after the
    stack (every run a process of its own: VmHWM is per process)."""
    base = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="gp-mg-"))
    row = MainGradRow()
    for world in (1, *options.worlds):
        for tiny in (False, True):
            row.runs[(world, tiny)] = _run_main_grad_one(
                options, base / f"main-grad-w{world}{'-tiny' if tiny else ''}", world, tiny)
    return row


def _run_moe(options: MemoryOptions, out_dir: Path, ep: int) -> MoeRun:
    moe = options.moe
    run = MoeRun(ep, moe.world)
    run.records = _launch(options, out_dir, moe.world, run.name, ["--ep", str(ep)],
                          worker=MOE_WORKER, sizes=moe.args())
    run.plan = moe_predicted(moe, ep)
    return run


def run(options: MemoryOptions = MemoryOptions(), out_dir=None) -> MemoryResult:
    """Every configuration, one after the other (they would share the cores)."""
    base = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="gp-memory-"))
    result = MemoryResult(options, [_run_unsharded(options, base / "unsharded")])
    pair_world = options.worlds[0] if options.recompute_layers is not None else None
    for world in options.worlds:
        for reshard in options.reshard:
            result.runs.append(_run_sharded(options, base / f"w{world}-{str(reshard).lower()}",
                                            world, reshard))
        ride = world == pair_world and not options.recompute_alone
        if options.control:
            result.controls[world], row = _run_control(options, base / f"w{world}-control",
                                                       world, recompute=ride)
            result.recompute = result.recompute or row
        if world == pair_world and result.recompute is None:
            result.recompute = _run_recompute_alone(options, base / f"w{world}-recompute",
                                                    world)
    if options.main_grad_row:
        result.main_grad = run_main_grad_row(options, base)
    result.moe = run_moe_rows(options, base)
    return result


def run_moe_rows(options: MemoryOptions, out_dir=None) -> list:
    """The MoE rows alone, one launch per EP (none without ``options.moe``)."""
    base = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="gp-moe-"))
    moe = options.moe
    return [_run_moe(options, base / f"moe-w{moe.world}-ep{ep}", ep)
            for ep in (moe.eps if moe is not None else ())]


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f}"


def report_lines(result: MemoryResult) -> list:
    o = result.options
    unsharded = result.unsharded.growth_bytes
    lines = [f"memory bench: {o.layers} x {o.hidden} x {o.hidden} float32 "
             f"({_mib(o.model_bytes)} MiB of parameters), batch {o.batch}, {o.steps} steps, "
             f"hand-written SGD; peak above the after-build baseline "
             f"({result.unsharded.records[0]['source']})"]
    for run in result.runs:
        per_rank = ", ".join(_mib(r["growth_bytes"]) for r in run.records)
        line = (f"  {run.name:<22} growth per rank {per_rank} MiB "
                f"({run.growth_bytes / unsharded:.2f}x unsharded)")
        if run.plan_bytes is not None:
            held = run.growth_bytes + o.model_bytes
            line += (f"; pool high-water {_mib(run.pool_high_water_bytes)} MiB; model memory "
                     f"at peak {_mib(held)} MiB, plan {_mib(run.plan_bytes)} MiB "
                     f"({run.plan_bytes / held - 1:+.0%})")
        lines.append(line)
    for world, control in result.controls.items():
        held = control.growth_bytes
        net = result.run(world).growth_bytes - held
        lines.append(f"  W={world} collectives only: growth {_mib(held)} MiB with no model (the "
                     f"stack's all-gathers and reduce-scatters on buffers made before the "
                     f"baseline); reshard=True net of it {_mib(net)} MiB "
                     f"({net / unsharded:.2f}x unsharded, a diagnostic, not the headline)")
    if result.recompute is not None:
        lines.extend(recompute_lines(result.recompute))
    if result.main_grad is not None:
        lines.extend(main_grad_lines(o, result.main_grad))
    if result.moe:
        lines.extend(moe_report_lines(o.moe, result.moe))
    # the headline is the default, reshard_after_forward=True, nothing subtracted
    lines.append("memory: " + ", ".join(
        f"W={w} {_mib(result.run(w).growth_bytes)} MiB ({result.ratio(w):.2f}x unsharded)"
        for w in o.worlds))
    return lines


def main_grad_lines(o: MemoryOptions, row: MainGradRow) -> list:
    """The main_grad row: per world size, each rank's growth from the process's start, the tiny
    stack's, and the largest rank's difference against the unsharded process's."""
    lines = [f"  main_grad mode, {o.layers} x {o.hidden} x {o.hidden} float32, {o.steps} steps, "
             f"peak above each process's start, net of the same run of {o.layers} x "
             f"{o.tiny_hidden} x {o.tiny_hidden} (its fixed cost):"]
    for world in (1, *row.worlds):
        big, tiny = row.runs[(world, False)], row.runs[(world, True)]
        label = "unsharded" if world == 1 else f"W={world}"
        lines.append(
            f"    {label:<9} growth per rank {', '.join(_mib(r['growth_bytes']) for r in big.records)}"
            f" MiB, tiny {', '.join(_mib(r['growth_bytes']) for r in tiny.records)} MiB: net "
            f"{_mib(row.net_bytes(world))} MiB ({row.ratio(world):.2f}x unsharded)")
    lines.append("main_grad: " + ", ".join(
        f"W={w} {_mib(row.net_bytes(w))} MiB ({row.ratio(w):.2f}x unsharded)"
        for w in row.worlds) + f", net of the tiny model; unsharded {_mib(row.net_bytes(1))} MiB")
    return lines


def recompute_lines(row: RecomputeRow) -> list:
    first = row.without.records[0]
    on = ", ".join(_mib(r["growth_bytes"]) for r in row.with_recompute.records)
    off = ", ".join(_mib(r["growth_bytes"]) for r in row.without.records)
    return [
        f"  W={row.world} recompute: {row.blocks} blocks {first['hidden']} -> {first['ffn']} -> "
        f"{first['hidden']}, {first['rows']} rows a rank, {first['steps']} step(s), "
        f"{'ranks of its own' if row.alone else 'after the control in its ranks'}; peak per "
        f"rank with Cell.recompute() {on} MiB, without {off} MiB: "
        f"{_mib(row.drop_bytes)} MiB less",
        f"    activations recompute drops {_mib(row.saved_bytes)} MiB a rank ({row.blocks} x "
        f"{_mib(row.saved_per_block_bytes)} MiB, a block's saved intermediates counted with "
        f"saved-tensor hooks); backward rebuilds one block's at a time, so the peak should "
        f"lose about {_mib(row.expected_drop_bytes)} MiB"
        + (f" (measured {row.drop_bytes / row.expected_drop_bytes:.0%} of that)"
           if row.expected_drop_bytes else "")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps; the recompute pair in the control's ranks; MoE EP 1 "
                             "and 4 only")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--moe-only", action="store_true",
                        help="only the MoE rows (EP 1 against E > 1), not the dense stack")
    parser.add_argument("--main-grad-only", action="store_true",
                        help="only the main_grad row (net of a tiny model), not the rest")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the runs' reports and logs go (default: a new temp dir)")
    args = parser.parse_args(argv)
    options = options_from(args, MemoryOptions.quick() if args.quick else MemoryOptions())
    try:
        if args.moe_only:
            lines = moe_report_lines(options.moe, run_moe_rows(options, args.out_dir))
        elif args.main_grad_only:
            lines = main_grad_lines(options, run_main_grad_row(options, args.out_dir))
        else:
            lines = report_lines(run(options, args.out_dir))
    except MemoryBenchmarkError as exc:
        print(f"memory bench: FAILED: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    return 0


def options_from(args, base: MemoryOptions) -> MemoryOptions:
    """``base`` with the sizes ``args`` gives (None keeps the base's), checked."""
    values = {}
    for key in ("layers", "hidden", "batch", "steps"):
        value = getattr(args, key, None)
        if value is not None:
            if value < 1:
                raise SystemExit(f"memory bench: --{key} must be >= 1, got {value}")
            values[key] = value
    worlds = getattr(args, "worlds", None)
    if worlds:
        if any(w < 2 for w in worlds):
            raise SystemExit(f"memory bench: --worlds must be >= 2 (1 is the unsharded run), "
                             f"got {worlds}")
        values["worlds"] = tuple(worlds)
    return dataclasses.replace(base, **values)


if __name__ == "__main__":
    sys.exit(main())
