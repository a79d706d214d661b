"""A complete fully_shard run: a small MLP sharded over every rank, gradients reduced on pool
memory into each shard's float32 ``main_grad``, the optimizer fed from ``main_grad``.

    python examples/fully_shard_mlp.py [CHECKPOINT_DIR]       # one process
    msrun --worker_num=2 --local_worker_num=2 --master_port=8123 --log_dir=msrun-logs \\
          --join=True python examples/fully_shard_mlp.py      # 2 ranks (CPU: MCCL)

Each rank trains on its own slice of a fixed global batch and prints the loss of its slice;
gradients are averaged over ranks, so every run takes the optimizer steps one process would take
on the whole batch. Exits non-zero if the loss does not fall. With ``CHECKPOINT_DIR`` the trained
model and optimizer are saved there (every rank its shards), loaded into a freshly built model,
and the two full state dicts compared.
"""
import sys

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn

from gradpool import GradPoolConfig, init_distributed
from hyper_parallel import checkpoint, clip_grad_norm_, fully_shard, get_model_state_dict
from hyper_parallel.core.fully_shard.api import MixedPrecisionPolicy

STEPS, GLOBAL_BATCH, WIDTH = 6, 8, 16


class Layer(nn.Cell):
    def __init__(self, rng, fan_in, fan_out):
        super().__init__()
        weight = rng.standard_normal((fan_out, fan_in)).astype(np.float32) / np.sqrt(fan_in)
        self.weight = Parameter(ms.Tensor(weight), name=f"weight_{fan_in}x{fan_out}")
        self.bias = Parameter(ms.Tensor(np.zeros(fan_out, np.float32)), name=f"bias_{fan_out}")

    def construct(self, x):
        return mint.matmul(x, self.weight.T) + self.bias


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        # 7 and 5 wide: uneven shards on 2 ranks (dim 0 padded)
        self.layers = nn.CellList([Layer(rng, WIDTH, 7), Layer(rng, 7, 5), Layer(rng, 5, 1)])

    def construct(self, x):
        for layer in self.layers[:-1]:
            x = mint.tanh(layer(x))
        return self.layers[-1](x)


MP = MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
POOL = GradPoolConfig(poison_on_release=True)   # recycled buckets read NaN: a stale read shows


def sharded_mlp() -> MLP:
    model = MLP()
    last_bias = model.layers[-1].bias        # kept whole on every rank, all-reduced
    for layer in model.layers:
        fully_shard(layer, mp_policy=MP, pool_config=POOL, replicate_params={last_bias})
    return fully_shard(model, mp_policy=MP, pool_config=POOL)


def save_and_reload(model, optimizer, path: str, rank: int) -> bool:
    """Save, load into a new model and optimizer, and compare the full state dicts."""
    saved = checkpoint.save(path, model, optimizer, step=STEPS)
    fresh = sharded_mlp()
    info = checkpoint.load(path, fresh, nn.SGD(fresh.trainable_params(), learning_rate=0.1))
    before = get_model_state_dict(model, full_state_dict=True)
    after = get_model_state_dict(fresh, full_state_dict=True)
    same = all(np.array_equal(before[k].asnumpy(), after[k].asnumpy()) for k in before)
    print(f"rank {rank} checkpoint: wrote {saved.bytes_written} bytes, read "
          f"{info['bytes_read']}, step {info['step']}, identical {same}", flush=True)
    return same


def main() -> int:
    ms.set_device("CPU")
    rank, world = init_distributed()              # (0, 1) outside msrun
    model = sharded_mlp()

    data = np.random.default_rng(1).standard_normal((GLOBAL_BATCH, WIDTH)).astype(np.float32)
    target = np.sin(data.sum(axis=1, keepdims=True)).astype(np.float32)
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    x, y = ms.Tensor(data[rows]), ms.Tensor(target[rows])

    params = model.trainable_params()              # this rank's shards
    grad_fn = ms.value_and_grad(lambda x, y: ((model(x) - y) ** 2).mean(), None, params)
    optimizer = nn.SGD(params, learning_rate=0.1)
    losses = []
    for step in range(STEPS):
        model.zero_grad()                          # clears main_grad
        # main_grad mode reduces asynchronously: autograd's gradients are zeros, and every
        # p.main_grad holds the reduced (averaged) shard once grad_fn returns
        loss, _ = grad_fn(x, y)
        # the unsharded model's gradient norm: the same on every rank and for any world size
        # (clip_grad_norm_ keeps it on the device; reading it for the log is this script's read)
        norm = float(clip_grad_norm_(params, max_norm=1.0).asnumpy())
        optimizer(tuple(p.main_grad for p in params))
        losses.append(float(loss.asnumpy()))
        print(f"rank {rank}/{world} step {step + 1}/{STEPS} loss {losses[-1]:.6f} "
              f"grad_norm {norm:.6f}", flush=True)
    if not losses[-1] < losses[0]:
        print(f"rank {rank}: loss did not fall ({losses[0]:.6f} -> {losses[-1]:.6f})",
              file=sys.stderr)
        return 1
    if len(sys.argv) > 1 and not save_and_reload(model, optimizer, sys.argv[1], rank):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
