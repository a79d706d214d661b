"""One rank of the checkpoint benchmark (:mod:`benchmarks.checkpoint`): saves a model
``--repeats`` times synchronously and asynchronously, in turn in this one process, with a
training stand-in between the saves, then loads it ``--repeats`` times, and publishes the
seconds and bytes of each into its rank report (``runs``).

Per repeat, every phase starting at a barrier: the stand-in alone (``work_alone``); a
synchronous save (the training loop is blocked for all of it); an asynchronous save (blocked
for the call: prepare and the copy to host), the stand-in while the file is written in the
background (``work_during``), then the wait that commits it (blocked again). The stand-in is a
fixed number of 1024 x 1024 float32 matmuls (``--work-seconds`` of them, calibrated alone):
how much the background write slows training down is ``work_during - work_alone``.

Where a save's time goes (``profile``): the snapshot copy, the checksums, safetensors'
``save_file`` (header and data into the page cache), the fsync and rename of the rank file,
rank 0's index (build, write, fsync) and the removal of the superseded generation, timed by
wrapping those functions of :mod:`hyper_parallel.checkpoint.files` in this process.

    python benchmarks/checkpoint_worker.py OUT_DIR CHECKPOINT_DIR --model {tiny,stack}
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("snapshot", "checksum", "save_file", "fsync_rename", "index", "remove_superseded")


def build(model: str, layers: int, hidden: int):
    from hyper_parallel import fully_shard
    if model == "tiny":
        from gradpool.app.config import from_dict
        from gradpool.app.train import build_sharded_model
        return build_sharded_model(from_dict({}, []))
    from benchmarks.memory_worker import build_stack
    stack = build_stack(layers, hidden, seed=0)
    for layer in stack.layers:
        fully_shard(layer)
    return fully_shard(stack)


def _barrier(comm) -> None:
    import mindspore as ms
    import numpy as np
    if comm.world_size > 1:
        buf = ms.Tensor(np.zeros(1, np.float32))
        comm.all_reduce(buf).wait()
        buf.asnumpy()


class Profile:
    """Seconds spent in each phase of a save on this rank, by wrapping the functions that do
    them (benchmark-only instrumentation; the library is unchanged)."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def install(self) -> None:
        from hyper_parallel.checkpoint import files, saving
        self._wrap(saving, "_snapshot", "snapshot")
        self._wrap(files, "checksum", "checksum")
        self._wrap(files, "save_file", "save_file")
        self._wrap(files, "_commit", "fsync_rename", skip_index=True)
        self._wrap(files, "write_index", "index")
        self._wrap(saving, "_build_index", "index")
        self._wrap(files, "remove_superseded", "remove_superseded")

    def _wrap(self, module, name: str, phase: str, skip_index: bool = False) -> None:
        original = getattr(module, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                # the index's own fsync and rename are inside write_index's time
                if not (skip_index and str(args[1]).endswith("index.json")):
                    self.seconds[phase] += time.perf_counter() - start
        setattr(module, name, timed)

    def take(self) -> dict:
        taken = {phase: self.seconds.get(phase, 0.0) for phase in PHASES}
        self.seconds.clear()
        return taken


class Work:
    """The training stand-in: ``n`` MindSpore matmuls of 1024 x 1024 float32."""

    def __init__(self, seconds: float):
        import mindspore as ms
        import numpy as np
        from mindspore import mint
        self._mint = mint
        self._a = ms.Tensor(np.random.default_rng(0).standard_normal((1024, 1024), np.float32))
        self.n = 1
        if seconds > 0:
            once = self.run(5) / 5
            self.n = max(1, int(seconds / once))
        else:
            self.n = 0

    def run(self, n=None) -> float:
        start = time.perf_counter()
        out = self._a
        for _ in range(self.n if n is None else n):
            out = self._mint.matmul(self._a, self._a)
        out.asnumpy()
        return time.perf_counter() - start


def measure(model, root: Path, repeats: int, comm, work_seconds: float) -> dict:
    from hyper_parallel import checkpoint
    profile = Profile()
    profile.install()
    work = Work(work_seconds)
    rows = defaultdict(list)
    written = total = read = 0
    for _ in range(repeats):
        _barrier(comm)
        rows["work_alone"].append(work.run())
        _barrier(comm)           # every rank starts together: the slowest rank's time counts
        profile.take()
        start = time.perf_counter()
        result = checkpoint.save(root / "sync", model)
        rows["sync_blocked"].append(time.perf_counter() - start)
        rows["sync_write"].append(result.write_seconds)
        rows["sync_profile"].append(profile.take())
        written, total = result.bytes_written, result.total_bytes
        _barrier(comm)
        start = time.perf_counter()
        handle = checkpoint.save(root / "async", model, async_save=True)
        rows["async_call"].append(time.perf_counter() - start)
        rows["work_during"].append(work.run())
        start = time.perf_counter()
        done = handle.wait()
        rows["async_wait"].append(time.perf_counter() - start)
        rows["async_blocked"].append(done.blocked_seconds)
        rows["async_write"].append(done.write_seconds)
        rows["async_profile"].append(profile.take())
    for _ in range(repeats):
        _barrier(comm)
        start = time.perf_counter()
        loaded = checkpoint.load(root / "sync", model)
        rows["load"].append(time.perf_counter() - start)
        read = loaded["bytes_read"]
    medians = {key: statistics.median(values) for key, values in rows.items()
               if not key.endswith("_profile")}
    for mode in ("sync", "async"):
        medians[f"{mode}_profile"] = {phase: statistics.median(p[phase] for p in rows[
            f"{mode}_profile"]) for phase in PHASES}
    return {**medians, "bytes_written": written, "total_bytes": total, "bytes_read": read,
            "work_matmuls": work.n, "all": {k: v for k, v in rows.items()
                                            if not k.endswith("_profile")}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("--model", choices=("tiny", "stack"), default="tiny")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    from gradpool.app import rank_report
    from gradpool.comm import communicator_for, init_distributed
    rank, world = init_distributed()      # first: msrun's scheduler process serves from here
    comm = communicator_for()
    model = build(args.model, args.layers, args.hidden)
    record = measure(model, args.checkpoint_dir / args.model, args.repeats, comm,
                     args.work_seconds)
    rank_report.reporter_for(args.out_dir, rank, world).publish_entry("runs", args.model, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
