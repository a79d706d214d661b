"""Tensors of the state that only some ranks hold: under expert parallelism each rank holds its
own experts (``layers.0.moe.experts.5.gate`` lives on the ranks of one EP position), so a full
state dict, which every rank gets whole, needs them from the ranks that hold them, and a key a
rank does not hold is not "unexpected" when another rank holds it.

Both questions are asked of the whole world: :func:`world_keys` exchanges the ranks' tensor
names (with shape and dtype; only a digest where every rank holds the same), and
:func:`share_full_tensors` sends each tensor some ranks lack from its first holder to every
rank. Every rank of the world calls them, in the same order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import mindspore as ms
import ml_dtypes
import numpy as np
import xxhash

from gradpool import StateMismatchError, all_sum, exchange_ints

# Values travel as float32 too: exact for these dtypes, which every parameter and optimizer
# state of a fully_shard model has.
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class WorldKey:
    shape: tuple
    dtype: str
    holders: tuple          # world ranks holding the whole tensor, ascending


def _world_comm():
    from gradpool import communicator_for
    return communicator_for()


def _digests(comm, payload: bytes) -> list[int]:
    """Every rank's 64-bit digest of its ``payload``, exactly."""
    digest = xxhash.xxh3_64_intdigest(payload)
    return [int(d) for d in exchange_ints(comm, [digest], unsigned=True)[:, 0]]


def world_keys(local: dict, comm=None) -> dict:
    """``{name: WorldKey}`` over every rank's ``local`` ``{name: (shape, dtype name)}``; a name
    two ranks give different shapes or dtypes is a :class:`StateMismatchError`.

    Ranks first compare digests of their name lists (one small all-reduce): where every rank
    holds the same tensors, as under plain FSDP, nothing more travels; otherwise only one rank of
    each distinct list sends it (under expert parallelism, one a position of the EP group)."""
    comm = comm or _world_comm()
    if comm.world_size == 1:
        return {name: WorldKey(tuple(shape), dtype, (0,)) for name, (shape, dtype) in local.items()}
    payload = json.dumps({name: [list(shape), dtype] for name, (shape, dtype) in local.items()},
                         sort_keys=True).encode()
    digests = _digests(comm, payload)
    if len(set(digests)) == 1:
        every = tuple(range(comm.world_size))
        return {name: WorldKey(tuple(shape), dtype, every)
                for name, (shape, dtype) in local.items()}
    senders = {digest: digests.index(digest) for digest in digests}     # first rank of each list
    sending = senders[digests[comm.rank]] == comm.rank
    sizes = [int(n) for n in exchange_ints(comm, [len(payload) if sending else 0])[:, 0]]
    start = sum(sizes[:comm.rank])
    # bytes travel as float32 sums, each byte from one rank and zeros from the others: exact
    data = np.zeros(sum(sizes), np.float32)
    if sizes[comm.rank]:
        data[start:start + len(payload)] = np.frombuffer(payload, np.uint8)
    data = all_sum(comm, data).astype(np.uint8)
    lists, offset = {}, 0
    for rank, size in enumerate(sizes):
        if size:
            lists[rank] = json.loads(bytes(data[offset:offset + size]))
        offset += size
    merged: dict = {}
    for rank, digest in enumerate(digests):
        for name, (shape, dtype) in lists[senders[digest]].items():
            key = merged.get(name)
            if key is not None and (key.shape, key.dtype) != (tuple(shape), dtype):
                raise StateMismatchError(
                    f"{name!r} is {dtype} {tuple(shape)} on rank {rank} but {key.dtype} "
                    f"{key.shape} on rank {key.holders[0]}; every rank must build the same model")
            holders = (key.holders if key else ()) + (rank,)
            merged[name] = WorldKey(tuple(shape), dtype, holders)
    return merged


def share_full_tensors(full: dict, comm=None) -> dict:
    """``full`` (this rank's whole tensors by name) with every tensor some other rank holds and
    this one lacks, sent by its first holder; the same dict on every rank."""
    comm = comm or _world_comm()
    if comm.world_size == 1:
        return full
    keys = world_keys({name: (tuple(t.shape), str(t.dtype).lower()) for name, t in full.items()},
                      comm)
    shared = dict(full)
    for name in sorted(keys):
        key = keys[name]
        if len(key.holders) == comm.world_size:
            continue
        if key.dtype not in _FLOAT_DTYPES:
            raise StateMismatchError(f"{name!r} ({key.dtype}) is held by ranks {key.holders} "
                                     f"only; a full state dict can share only {_FLOAT_DTYPES}")
        values = np.zeros(key.shape, np.float32)
        if comm.rank == key.holders[0]:
            values = _host_float32(full[name])
        total = all_sum(comm, values)
        if name not in full:
            shared[name] = _as_tensor(total, key.dtype)
    return shared


def _host_float32(tensor: ms.Tensor) -> np.ndarray:
    if tensor.dtype == ms.bfloat16:
        return np.array(tensor.asnumpy()).view(np.uint16).view(ml_dtypes.bfloat16) \
            .astype(np.float32)
    return np.array(tensor.asnumpy(), np.float32)


def _as_tensor(values: np.ndarray, dtype: str) -> ms.Tensor:
    if dtype == "bfloat16":
        return ms.Tensor(values, ms.float32).astype(ms.bfloat16)
    return ms.Tensor(values.astype(np.float16 if dtype == "float16" else np.float32))
