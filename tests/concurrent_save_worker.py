"""One of two processes saving into one checkpoint directory at once
(tests/test_checkpoint_writers.py).

argv: CHECKPOINT_DIR WRITER SAVES GO_FILE OUT_JSON. Waits for GO_FILE (so the writers start
together), then saves SAVES times, each time with every value set to the save's step
(``WRITER * 1000 + i``), and writes each save's outcome to OUT_JSON: "committed", or the
CheckpointError's message."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, nn

from gradpool.errors import CheckpointError
from hyper_parallel import checkpoint


class Small(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(ms.Tensor(np.zeros((64, 64), np.float32)), name="w")
        self.b = Parameter(ms.Tensor(np.zeros(7, np.float16)), name="b")

    def construct(self, x):
        return x


def set_step(model: Small, step: int) -> None:
    for param in model.parameters_dict().values():
        param.set_data(ms.Tensor(np.full(param.shape, step, param.asnumpy().dtype)))


def main() -> None:
    root, writer, saves = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    go, out = Path(sys.argv[4]), Path(sys.argv[5])
    model = Small()
    while not go.exists():
        time.sleep(0.01)
    outcomes = []
    for i in range(saves):
        step = writer * 1000 + i
        set_step(model, step)
        try:
            checkpoint.save(root, model, step=step)
            outcomes.append("committed")
        except CheckpointError as exc:
            outcomes.append(str(exc))
    out.write_text(json.dumps(outcomes))


if __name__ == "__main__":
    main()
