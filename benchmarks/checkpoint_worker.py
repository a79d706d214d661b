"""One rank of the checkpoint benchmark (:mod:`benchmarks.checkpoint`): saves and loads a model
``--repeats`` times with ``hyper_parallel.checkpoint`` and publishes the seconds and bytes of
each into its rank report (``runs``).

    python benchmarks/checkpoint_worker.py OUT_DIR CHECKPOINT_DIR --model {tiny,stack}
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


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


def measure(model, root: Path, repeats: int, comm) -> dict:
    from hyper_parallel import checkpoint
    saves, loads = [], []
    written = read = 0
    for _ in range(repeats):
        _barrier(comm)           # every rank starts together: the slowest rank's time counts
        start = time.perf_counter()
        result = checkpoint.save(root, model)
        saves.append(time.perf_counter() - start)
        written = result.bytes_written
    for _ in range(repeats):
        _barrier(comm)
        start = time.perf_counter()
        loaded = checkpoint.load(root, model)
        loads.append(time.perf_counter() - start)
        read = loaded["bytes_read"]
    return {"save_seconds": statistics.median(saves), "load_seconds": statistics.median(loads),
            "bytes_written": written, "bytes_read": read, "total_bytes": result.total_bytes,
            "save_all": saves, "load_all": loads}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("--model", choices=("tiny", "stack"), default="tiny")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from gradpool.app import rank_report
    from gradpool.comm import communicator_for, init_distributed
    rank, world = init_distributed()      # first: msrun's scheduler process serves from here
    comm = communicator_for()
    model = build(args.model, args.layers, args.hidden)
    record = measure(model, args.checkpoint_dir / args.model, args.repeats, comm)
    rank_report.reporter_for(args.out_dir, rank, world).publish_entry("runs", args.model, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
