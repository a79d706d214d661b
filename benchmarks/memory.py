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

    python -m benchmarks.memory [--quick] [--layers N --hidden H --batch B --steps S]
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

from gradpool.app.config import from_dict
from gradpool.app.model import ParamSpec
from gradpool.app.plan import plan_memory
from gradpool.app.rank_report import read_reports

MIB = 2 ** 20
WORKER = Path(__file__).with_name("memory_worker.py")


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

    @classmethod
    def quick(cls) -> "MemoryOptions":
        # the default stack's shape and both modes, fewer steps: the steady state is reached
        # after the first step (every buffer the step needs exists by then)
        return cls(steps=2)

    def worker_args(self) -> list:
        return ["--layers", str(self.layers), "--hidden", str(self.hidden),
                "--batch", str(self.batch), "--steps", str(self.steps)]

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
class MemoryResult:
    options: MemoryOptions
    runs: list
    controls: dict = field(default_factory=dict)     # world -> the collectives-only Run

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


def _launch(options: MemoryOptions, out_dir: Path, world: int, name: str, flags: list) -> list:
    from gradpool.app.launch import LaunchError, run_ranks
    try:
        run_ranks(WORKER, [str(out_dir), *flags, *options.worker_args()], nproc=world,
                  log_dir=out_dir / "logs", report_dir=out_dir, timeout=options.timeout)
    except LaunchError as exc:
        raise MemoryBenchmarkError(f"{name}: {exc}") from None
    return _records(out_dir, world, name)


def _run_sharded(options: MemoryOptions, out_dir: Path, world: int, reshard: bool) -> Run:
    name = f"W={world} reshard={reshard}"
    run = Run(name, world, reshard,
              _launch(options, out_dir, world, name, ["--reshard", str(reshard).lower()]))
    run.plan_bytes = predicted_bytes(options, world, reshard)
    return run


def _run_control(options: MemoryOptions, out_dir: Path, world: int) -> Run:
    name = f"W={world} collectives only"
    return Run(name, world, None, _launch(options, out_dir, world, name, ["--collectives-only"]))


def run(options: MemoryOptions = MemoryOptions(), out_dir=None) -> MemoryResult:
    """Every configuration, one after the other (they would share the cores)."""
    base = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="gp-memory-"))
    result = MemoryResult(options, [_run_unsharded(options, base / "unsharded")])
    for world in options.worlds:
        for reshard in options.reshard:
            result.runs.append(_run_sharded(options, base / f"w{world}-{str(reshard).lower()}",
                                            world, reshard))
        if options.control:
            result.controls[world] = _run_control(options, base / f"w{world}-control", world)
    return result


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
    # the headline is the default, reshard_after_forward=True, nothing subtracted
    lines.append("memory: " + ", ".join(
        f"W={w} {_mib(result.run(w).growth_bytes)} MiB ({result.ratio(w):.2f}x unsharded)"
        for w in o.worlds))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (under 3 minutes)")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="where the runs' reports and logs go (default: a new temp dir)")
    args = parser.parse_args(argv)
    options = options_from(args, MemoryOptions.quick() if args.quick else MemoryOptions())
    try:
        result = run(options, args.out_dir)
    except MemoryBenchmarkError as exc:
        print(f"memory bench: FAILED: {exc}", file=sys.stderr)
        return 1
    for line in report_lines(result):
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
