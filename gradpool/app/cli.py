"""``gradpool``: the command line.

    gradpool train --config FILE [--set section.key=value ...] [--reference] [--no-verify]
    gradpool check-config FILE [FILE ...] [--set section.key=value ...]
    gradpool launch-cmd --config FILE --node-rank K [--set section.key=value ...]
    gradpool plan --config FILE [--set ...] [--json] [--hbm-gbps G] [--copy-efficiency F]
                  [--intra-node-gbps G] [--inter-node-gbps G] [--dispatcher all-to-all|all-gather]
    gradpool export --checkpoint DIR --out model.safetensors [--no-verify]
    gradpool bench [--device CPU] [--nproc 2] [--out results.json] [--quick]
    gradpool bench --suite overlap [--quick]
    gradpool --version

Exit codes: 0 success; 1 the run failed (a rank failed, a loss was not finite, a gradient the reduce
path received was changed or freed, the reference check failed); 2 the command or the config is
wrong, or a checkpoint to resume from or export is missing, corrupt or does not fit the run (the
reason is printed as one line).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from gradpool.app.config import RunConfig, dump_yaml, load_config
from gradpool.device import SUPPORTED_DEVICES
from gradpool.errors import CheckpointError, InvalidArgumentError, StateMismatchError
from gradpool.app.errors import ConfigError
from gradpool.app.train_output import byte_text, print_summary, step_printer

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_REFERENCE_RTOL = 1e-3


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    try:
        return args.command(args)
    except _UsageError as exc:
        print(f"gradpool {args.command_name}: {exc}", file=sys.stderr)
        return EXIT_USAGE


class _UsageError(Exception):
    """A command-line value is out of range (argparse checks only types)."""


def _parser() -> argparse.ArgumentParser:
    # -v works before and after the subcommand: the subcommands share this parent
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log library details")
    parser = argparse.ArgumentParser(prog="gradpool", description=__doc__.split("\n\n")[0],
                                     parents=[verbose])
    parser.set_defaults(verbose=False)
    parser.add_argument("--version", action="version", version=f"gradpool {_version()}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    def command(name: str, **kwargs) -> argparse.ArgumentParser:
        sub_parser = sub.add_parser(name, parents=[verbose], **kwargs)
        sub_parser.set_defaults(command_name=name)
        return sub_parser

    for add in (_add_train, _add_check_config, _add_launch_cmd, _add_plan, _add_export,
                _add_bench):
        add(command)
    return parser


def _add_train(command: Callable[..., argparse.ArgumentParser]) -> None:
    train = command("train", help="train the tiny DeepSeek-V3 model with fully_shard")
    train.add_argument("--config", required=True, help="run config YAML")
    _add_overrides(train)
    train.add_argument("--reference", action="store_true",
                       help="also train the unsharded model in this process and compare losses")
    train.add_argument("--reference-rtol", type=float, default=DEFAULT_REFERENCE_RTOL,
                       help="fail when a step's loss differs from the reference by more than "
                            "this relative amount (default %(default)g)")
    train.add_argument("--timeout", type=float, default=3600, help="seconds before giving up")
    train.add_argument("--no-verify", action="store_true",
                       help="do not check train.resume_from's checksums (trusted storage; the "
                            "same as --set train.verify_checkpoint=false); sizes, save ids and "
                            "headers still are")
    train.set_defaults(command=_train)


def _add_check_config(command: Callable[..., argparse.ArgumentParser]) -> None:
    check = command("check-config", help="print the resolved config, or what is wrong")
    check.add_argument("files", nargs="+", metavar="FILE", help="run config YAML (one or more)")
    _add_overrides(check)
    check.set_defaults(command=_check_config)


def _add_launch_cmd(command: Callable[..., argparse.ArgumentParser]) -> None:
    launch_cmd = command("launch-cmd", help="print the msrun command and environment of one node "
                                            "(for Slurm, Kubernetes, ...)")
    launch_cmd.add_argument("--config", required=True, help="run config YAML")
    launch_cmd.add_argument("--node-rank", type=int, required=True, metavar="K",
                            help="the node to print (sets launch.node_rank)")
    _add_overrides(launch_cmd)
    launch_cmd.set_defaults(command=_launch_cmd)


def _add_plan(command: Callable[..., argparse.ArgumentParser]) -> None:
    plan = command("plan", help="per-rank memory, activations and communication of a run, "
                                "without a device")
    plan.add_argument("--config", required=True, help="run config YAML")
    _add_overrides(plan)
    plan.add_argument("--json", action="store_true", help="print JSON (bytes) instead of a table")
    plan.add_argument("--hbm-gbps", type=float, default=None,
                      help="device memory bandwidth for the copy-time estimate, GB/s (default: "
                           "the 910B's published 1600)")
    plan.add_argument("--copy-efficiency", type=float, default=None,
                      help="fraction of that bandwidth a copy reaches (default 0.7, assumed)")
    plan.add_argument("--device-memory-gib", type=float, default=None,
                      help="card memory to compare with (default: 64 on Ascend)")
    plan.add_argument("--intra-node-gbps", type=float, default=None,
                      help="per-card bandwidth between the cards of a node, GB/s (default on "
                           "Ascend: HCCS 392, as published for the Atlas 800T A2; CPU: none)")
    plan.add_argument("--inter-node-gbps", type=float, default=None,
                      help="per-card bandwidth between nodes, GB/s (default on Ascend: 25, one "
                           "200 Gb/s RoCE port per card; CPU: none)")
    plan.add_argument("--dispatcher", default=None,
                      help="expert parallelism's token dispatcher to cost, all-to-all or "
                           "all-gather (default: the run's, model.moe_dispatcher)")
    plan.set_defaults(command=_plan)


def _add_export(command: Callable[..., argparse.ArgumentParser]) -> None:
    export = command("export", help="write a checkpoint's model as one safetensors file that "
                                    "plain MindSpore loads into the unsharded model")
    export.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="a checkpoint directory (train.save_dir/step-<N>)")
    export.add_argument("--out", required=True, metavar="FILE", help="the safetensors file")
    export.add_argument("--no-verify", action="store_true",
                        help="do not check the checksums (trusted storage); sizes, save ids "
                             "and headers still are")
    export.set_defaults(command=_export)


def _add_bench(command: Callable[..., argparse.ArgumentParser]) -> None:
    bench = command("bench", help="copy-overhead and reduce-step benchmarks, then report")
    bench.add_argument("--device", default="CPU", choices=SUPPORTED_DEVICES)
    bench.add_argument("--nproc", type=int, default=2, help="ranks of the reduce-step suite")
    bench.add_argument("--out", default="bench-results.json", help="results JSON")
    bench.add_argument("--quick", action="store_true", help="small sweep (smoke run)")
    bench.add_argument("--suite", default="copy-reduce",
                       choices=("copy-reduce", "overlap", "memory"),
                       help="copy-reduce: copy-in and reduce-step suites, JSON and report; "
                            "overlap: latency the asynchronous reduce hides (2 msrun ranks); "
                            "memory: per-rank peak memory of a dense stack, unsharded and on 2 "
                            "and 4 msrun ranks, and of an MoE stack at 4 ranks with expert "
                            "parallelism 1, 2 and 4, each beside the plan")
    bench.set_defaults(command=_bench)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("gradpool")
    except PackageNotFoundError:      # run from a source tree that was never installed
        import gradpool
        return gradpool.__version__


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise _UsageError(f"{name} must be > 0, got {value:g}")


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")


def _load(path: str, overrides: list) -> Optional[RunConfig]:
    """The config, or None after printing why not (one line)."""
    try:
        return load_config(path, overrides)
    except ConfigError as exc:
        print(f"gradpool: config error: {_one_line(exc)}", file=sys.stderr)
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# -- check-config ------------------------------------------------------------------------------
def _check_config(args) -> int:
    """Every file is checked; the resolved configs are printed, one YAML document each."""
    status = EXIT_OK
    for index, path in enumerate(args.files):
        cfg = _load(path, args.overrides)
        if cfg is None:
            status = EXIT_USAGE
            continue
        if len(args.files) > 1:
            print(f"--- # {path}" if index else f"# {path}")
        print(dump_yaml(cfg), end="")
    return status


def _checked_launch(path: str, overrides: list) -> Optional[RunConfig]:
    """The config, refused (one line, None) also for what only fails at launch: a privileged or
    busy port, a master host name that does not resolve (nothing is created before this)."""
    cfg = _load(path, overrides)
    if cfg is None:
        return None
    from gradpool.app.launch import check_launch
    try:
        check_launch(cfg.launch)
    except ConfigError as exc:
        print(f"gradpool: config error: {path}: {_one_line(exc)}", file=sys.stderr)
        return None
    return cfg


# -- train -------------------------------------------------------------------------------------
def _train(args) -> int:
    checked = _train_config(args)
    if checked is None:
        return EXIT_USAGE
    cfg, resume, notes = checked
    from gradpool.app.job import TrainJobError, run_job
    _announce_train(args, cfg, resume, notes)
    log_dir = _log_dir_or_none(cfg, args.config)
    if log_dir is None:
        return EXIT_USAGE
    try:
        result = run_job(cfg, on_step=step_printer(cfg.train.steps), timeout=args.timeout,
                         log_dir=log_dir)
    except TrainJobError as exc:
        print(f"gradpool train: FAILED: {exc.reason}", file=sys.stderr)
        if exc.details:
            print(exc.details, file=sys.stderr)
        return EXIT_FAILED
    print(f"logs and step records in {result.log_dir}")
    if result.node_rank != 0:
        _print_other_node(result, args.reference)
        return EXIT_OK
    print_summary(result)
    return _compare_with_reference(cfg, result, args.reference_rtol) if args.reference \
        else EXIT_OK


def _train_config(args) -> Optional[tuple]:
    """``(cfg, resume, notes)`` of ``gradpool train``'s arguments, checked before anything
    starts (the checkpoint paths absolute, ``latest`` resolved); None after a usage error was
    printed."""
    _positive("--timeout", args.timeout)
    _positive("--reference-rtol", args.reference_rtol)
    overrides = [*args.overrides, "train.verify_checkpoint=false"] if args.no_verify else \
        args.overrides
    cfg = _checked_launch(args.config, overrides)
    if cfg is None:
        return None
    cfg = _checkpoint_paths(cfg)
    cfg, resume, notes = _checked_resume(cfg)
    if resume is False or not _save_dir_writable(cfg, args.config):
        return None
    return cfg, resume, notes


def _announce_train(args, cfg: RunConfig, resume, notes: list) -> None:
    """What is about to run, where, from which config (and checkpoint)."""
    launch = cfg.launch
    where = "in this process" if launch.ranks == 1 else "under msrun"
    given = f" with {', '.join(args.overrides)}" if args.overrides else ""
    if launch.nodes > 1:
        last = launch.first_rank + launch.local_ranks - 1
        print(f"gradpool train: node {launch.node_rank} of {launch.nodes}: ranks "
              f"{launch.first_rank}-{last} of {launch.ranks} {launch.device} rank(s), master "
              f"{launch.master_addr}:{launch.master_port}, config {args.config}" + given,
              flush=True)
    else:
        print(f"gradpool train: {launch.ranks} {launch.device} rank(s) {where}, config "
              f"{args.config}" + given, flush=True)
    for note in notes:
        print(f"gradpool train: {note}", flush=True)
    if resume is not None:
        print(f"gradpool train: resuming from {resume.path} at step {resume.step} of "
              f"{cfg.train.steps} (saved at {resume.world_size} rank(s))", flush=True)


def _log_dir_or_none(cfg: RunConfig, config_path) -> Optional[Path]:
    """The run's log directory, made and printed before anything starts (a run that hangs must
    not hide where its logs are); None after a usage error was printed."""
    from gradpool.app.job import prepare_log_dir
    launch = cfg.launch
    try:
        log_dir = prepare_log_dir(cfg)
    except OSError as exc:
        print(f"gradpool: config error: {config_path}: launch.log_dir = {launch.log_dir!r} "
              f"cannot be written ({exc.strerror or exc}); give a writable directory",
              file=sys.stderr)
        return None
    print(f"gradpool train: logs in {log_dir}", flush=True)
    if launch.ranks > 1 and launch.node_rank == 0:
        print(f"(step lines: time of the slowest rank; copied, copy rate and high-water per "
              f"rank, the largest / slowest; new allocations of all {launch.ranks} ranks)",
              flush=True)
    return log_dir


def _print_other_node(result, reference: bool) -> None:
    """A node other than 0 says its ranks finished; node 0 prints the job's steps."""
    print(f"node {result.node_rank}: ranks {', '.join(str(o.rank) for o in result.outcomes)} "
          f"finished {min(o.steps for o in result.outcomes)} steps each, ok; node 0 prints "
          "the job's steps and summary")
    if reference:
        print("reference: run by node 0 only")


def _compare_with_reference(cfg: RunConfig, result, rtol: float) -> int:
    """``--reference``: the unsharded model trained here on the same batches; the exit code."""
    from gradpool.app.job import compare_with_reference
    print("reference: training the unsharded model in this process on the same batches ...",
          flush=True)
    comparison = compare_with_reference(cfg, result.records)
    print(f"reference: largest loss difference {comparison.max_abs_diff:.3g} absolute, "
          f"{comparison.max_rel_diff:.3g} relative over {len(comparison.reference_losses)} steps "
          f"(tolerance {rtol:g} relative)")
    if not comparison.within(rtol):
        print(f"gradpool train: FAILED: sharded losses {list(comparison.sharded_losses)} differ "
              f"from the reference {list(comparison.reference_losses)} by more than "
              f"{rtol:g} relative", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _checkpoint_paths(cfg: RunConfig) -> RunConfig:
    """``train.save_dir`` and ``train.resume_from`` made absolute: the ranks, and the messages,
    then name the directories the user meant, whatever directory a rank runs in."""
    train = cfg.train
    from gradpool.app.checkpoints import LATEST
    paths = {key: os.path.abspath(value) for key, value in (("save_dir", train.save_dir),
                                                             ("resume_from", train.resume_from))
             if value is not None and not (key == "resume_from" and value == LATEST)}
    return dataclasses.replace(cfg, train=dataclasses.replace(train, **paths)) if paths else cfg


def _checked_resume(cfg: RunConfig):
    """``(cfg, checkpoint, notes)``: the checkpoint ``train.resume_from`` names, checked against
    the run before anything is launched (None: no resume; False: refused, after printing why in
    one line). ``latest`` is resolved here, so the ranks load the step found now (``cfg`` names
    it) and ``notes`` say which, and which newer directories were skipped and why."""
    from gradpool.app.checkpoints import check_resume, read_checkpoint, resolve_latest
    try:
        cfg, info, notes = resolve_latest(cfg)
        if cfg.train.resume_from is None:
            return cfg, None, notes
        info = info or read_checkpoint(cfg.train.resume_from,
                                       checksums=cfg.train.verify_checkpoint)
        check_resume(cfg, info, cfg.launch.ranks)
    except (CheckpointError, StateMismatchError, ConfigError) as exc:
        print(f"gradpool train: cannot resume: {_one_line(exc)}", file=sys.stderr)
        return cfg, False, []
    if not cfg.train.verify_checkpoint:     # an opt-out is said, never silent
        notes.append(f"train.verify_checkpoint = false: the checksums of {info.path} are not "
                     "verified (trusted storage), here or by the ranks; sizes, save ids and "
                     "headers are")
    return cfg, info, notes


def _save_dir_writable(cfg: RunConfig, config: str) -> bool:
    """Made now, so a directory that cannot be written fails here, not after the first steps."""
    save_dir = cfg.train.save_dir
    if save_dir is None:
        return True
    try:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        if not os.access(save_dir, os.W_OK | os.X_OK):
            raise PermissionError("permission denied")
    except OSError as exc:
        print(f"gradpool: config error: {config}: train.save_dir = {save_dir!r} cannot be "
              f"written ({exc.strerror or exc}); give a writable directory", file=sys.stderr)
        return False
    return True


# -- launch-cmd --------------------------------------------------------------------------------
def _launch_cmd(args) -> int:
    """The commands ``gradpool train`` would run on node K, for a scheduler that starts them."""
    import shlex
    overrides = [*args.overrides, f"launch.node_rank={args.node_rank}"]
    cfg = _load(args.config, overrides)
    if cfg is None:
        return EXIT_USAGE
    from pathlib import PurePath
    from gradpool.app.job import node_dir, node_launch

    launch = cfg.launch
    base = launch.log_dir or "gradpool-logs"
    log_dir = Path(node_dir(base, launch.node_rank) if launch.nodes > 1 else base)
    node = node_launch(cfg, log_dir)
    print(f"# gradpool launch-cmd: {args.config}, node {launch.node_rank} of {launch.nodes}")
    if launch.log_dir is None:
        print(f"# launch.log_dir is null: the commands use ./{PurePath(base)}")
    if launch.master_port is None:
        print(f"# launch.master_port is null: picked {node.spec.master_port}, free on this host "
              "now")
    # the ranks load the resolved config, exactly as gradpool train writes it
    check = [sys.executable, "-m", "gradpool", "check-config", args.config]
    for item in overrides:
        check += ["--set", item]
    print(f"mkdir -p {shlex.quote(str(log_dir))}")
    print(f"{shlex.join(check)} > {shlex.quote(str(log_dir / 'config.yaml'))}")
    print(node.shell())
    return EXIT_OK


# -- export ------------------------------------------------------------------------------------
def _export(args) -> int:
    """The full model of a checkpoint as one file, read on this host (no launch)."""
    from safetensors import SafetensorError
    from gradpool.app.checkpoints import read_checkpoint
    if Path(args.out).is_dir():
        # the file is written beside its name first: a directory would leave DIR.tmp behind
        raise _UsageError(f"--out {args.out} is a directory; give the file to write, e.g. "
                          f"{Path(args.out) / 'model.safetensors'}")
    try:
        info = read_checkpoint(args.checkpoint)     # the clear "no checkpoint" error first
        if args.no_verify:      # an opt-out is said, never silent
            print(f"gradpool export: --no-verify: the checksums of {info.path} are not verified "
                  "(trusted storage); sizes, save ids and headers are", flush=True)
        from hyper_parallel.checkpoint import export_full
        written = export_full(args.checkpoint, args.out, verify=not args.no_verify)
    except CheckpointError as exc:
        print(f"gradpool export: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, SafetensorError) as exc:      # safetensors' own when it cannot write
        print(f"gradpool export: --out {args.out} cannot be written: {_one_line(exc)}",
              file=sys.stderr)
        return EXIT_USAGE
    print(f"gradpool export: wrote {args.out}: {written['tensors']} tensors, "
          f"{byte_text(written['bytes'])}, {written['seconds']:.2f} s (step {info.step} of "
          f"{info.path}, saved at {info.world_size} rank(s))")
    return EXIT_OK


# -- plan --------------------------------------------------------------------------------------
def _plan(args) -> int:
    import json
    from gradpool.app.plan import PlanOptions, format_plan, plan_memory

    cfg = _load(args.config, args.overrides)
    if cfg is None:
        return EXIT_USAGE
    given = {name: value for name, value in (("hbm_gbps", args.hbm_gbps),
                                             ("copy_efficiency", args.copy_efficiency),
                                             ("device_memory_gib", args.device_memory_gib),
                                             ("intra_node_gbps", args.intra_node_gbps),
                                             ("inter_node_gbps", args.inter_node_gbps),
                                             ("dispatcher", args.dispatcher))
             if value is not None}
    try:
        options = PlanOptions(**given)
    except InvalidArgumentError as exc:
        raise _UsageError(f"--{_one_line(exc).replace('_', '-', 2)}") from None
    plan = plan_memory(cfg, options)
    if args.json:
        print(json.dumps({"config": args.config, **plan.to_dict()}, indent=2))
    else:
        print(format_plan(plan, args.config))
    return EXIT_OK


# -- bench -------------------------------------------------------------------------------------
def _bench(args) -> int:
    """Run the benchmarks as their own modules (``python -m benchmarks ...``) from the source
    checkout: the application does not import them, and the wheel does not ship them."""
    if args.nproc < 1:
        raise _UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if args.suite in ("overlap", "memory") and args.device != "CPU":
        where = ("CPU ranks, a modelled network" if args.suite == "overlap" else
                 "on Ascend launch benchmarks/memory_worker.py under msrun with --device Ascend "
                 "(docs/benchmarks/memory.md)")
        raise _UsageError(f"--suite {args.suite} runs on CPU from this command ({where}); got "
                          f"--device {args.device}")
    root = _source_root()
    quick = ["--quick"] if args.quick else []
    if args.suite != "copy-reduce":
        return _run_module(root, [f"benchmarks.{args.suite}", *quick])
    status = _run_module(root, ["benchmarks", "run", "--device", args.device, "--nproc",
                                str(args.nproc), "--out", str(Path(args.out).resolve()), *quick])
    if status != EXIT_OK:
        return status
    return _run_module(root, ["benchmarks", "report", str(Path(args.out).resolve())])


def _source_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise _UsageError(f"gradpool bench runs the benchmarks of a source checkout; {root} has "
                          "no benchmarks/ (install with pip install -e '.[bench]' from a clone)")
    return root


def _run_module(root: Path, module_args: list) -> int:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", *module_args], cwd=root, env=env, check=False)
    if done.returncode != 0:
        print(f"gradpool bench: FAILED: python -m {' '.join(module_args)} exited "
              f"{done.returncode}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
