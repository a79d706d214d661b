"""A process that saves a checkpoint and is killed (SIGKILL) at a chosen point of a second save
(tests/test_checkpoint.py::test_a_save_killed_at_any_point_leaves_a_loadable_checkpoint).

argv: CHECKPOINT_DIR DUMP_DIR POINT. Saves step 1, dumps its values, changes every value, dumps
them as step 2 and saves step 2, killing itself at POINT (or never, with POINT ``none``)."""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn

from hyper_parallel import checkpoint
from hyper_parallel.checkpoint import files


class Small(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), name="w")
        self.b = Parameter(ms.Tensor(np.ones(5, np.float16)), name="b")

    def construct(self, x):
        return x


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str) -> None:
    """Replace one step of the save with: do part of it, then die."""
    if point == "rank_file_half_written":
        original = files.save_file

        def half(arrays, path, metadata=None):
            original(arrays, path, metadata=metadata)
            data = Path(path).read_bytes()
            Path(path).write_bytes(data[: len(data) // 2])
            _die()
        files.save_file = half
    elif point == "before_index":
        files.write_index = lambda root, index: _die()
    elif point == "index_written_not_renamed":
        original_commit = files._commit

        def commit(tmp, final):
            if final.name == files.INDEX:
                _die()
            original_commit(tmp, final)
        files._commit = commit
    elif point == "after_commit_before_cleanup":
        files.remove_superseded = lambda root, generation: _die()
    elif point != "none":
        raise SystemExit(f"unknown kill point {point!r}")


def main() -> None:
    root, dumps, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    model = Small()
    checkpoint.save(root, model, step=1)
    np.savez(dumps / "step1.npz", **{k: p.asnumpy() for k, p in model.parameters_dict().items()})
    for param in model.parameters_dict().values():
        param.set_data(ms.Tensor(param.asnumpy() * 3 + 1))
    np.savez(dumps / "step2.npz", **{k: p.asnumpy() for k, p in model.parameters_dict().items()})
    arm(point)
    checkpoint.save(root, model, step=2)


if __name__ == "__main__":
    main()
