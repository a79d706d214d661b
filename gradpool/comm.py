"""Collectives over flat bucket tensors, each returning a handle the pool can use as a fence.

Three backends behind one :class:`Communicator` interface:

* :class:`SingleProcessCommunicator`: world size 1, no communication (unit tests, one device);
* :class:`CpuMcclCommunicator`: CPU ranks under ``msrun`` (MCCL), built from the only collectives
  MindSpore 2.10 runs on CPU (``ops.AllReduce`` / ``ops.AllGather`` called under ``@ms.jit``);
* :class:`AscendHcclCommunicator`: ``mindspore.mint.distributed`` over HCCL, with real async handles.

:mod:`gradpool.testing` wraps any of them to delay completion or fail ``wait()``.

Every tensor is a flat 1-D tensor of float32, float16 or bfloat16. Outputs may be pool lease
tensors, i.e. a prefix view (``bucket[0:n]``) of a larger allocation: on the CPU backend
``copy_`` into such a view raises ("InplaceCopy ... unexpected kernel", it sees the whole
storage) or, into a view at a non-zero offset, silently does nothing, and ``add_``/``div_`` are
out-of-place. So every result is computed out-of-place and written with slice-assignment through
:func:`gradpool.dtypes.overwrite`.
"""
from __future__ import annotations

import abc
import functools
import logging
import os
import threading
from typing import Callable, Optional

import ml_dtypes
import mindspore as ms
import numpy as np
from mindspore import mint, ops

from gradpool.device import SUPPORTED_DEVICES, device_target, drain_launch_queue, synchronize
from gradpool.dtypes import canonicalize_nans, check_dtype, host_alias, overwrite
from gradpool.errors import CommError, InvalidArgumentError

logger = logging.getLogger(__name__)

REDUCE_OPS = ("sum", "avg")

# Roles msrun gives the processes it starts (MS_ROLE): the workers, and a scheduler process that
# runs the same script and serves the cluster from inside ``communication.init()``.
_MSRUN_ROLES = ("MS_WORKER", "MS_SCHED")


# -- handles -----------------------------------------------------------------------------------
class CommHandle(abc.ABC):
    """A launched collective: ``wait()`` blocks until it is done (re-raising its failure);
    ``is_completed()`` asks without blocking. Satisfies ``gradpool.pool.Fence``."""

    @abc.abstractmethod
    def wait(self) -> None: ...

    @abc.abstractmethod
    def is_completed(self) -> bool: ...


class CompletedHandle(CommHandle):
    """The handle of work that had finished (and was written) before the call returned."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "CompletedHandle()"


class _WrappedHandle(CommHandle):
    """A MindSpore ``CommHandle`` plus an optional step to run once it is done (``after``).

    MindSpore 2.10's ``CommHandle`` has ``wait()`` only. Without a native ``is_completed`` the
    handle reports not-completed until someone has waited on it: a fence that says "not yet" too
    long costs the pool a new bucket, one that says "done" too early corrupts a gradient."""

    def __init__(self, handle, what: str, after: Optional[Callable[[], None]] = None):
        self._handle = handle
        self._what = what
        self._after = after
        self._done = False
        self._error: Optional[CommError] = None
        # wait() may be reached from two threads (a pool reaping from a monitoring thread, the
        # owner waiting for its result): ``after`` must run exactly once.
        self._lock = threading.Lock()

    def wait(self) -> None:
        with self._lock:
            if not self._done:
                try:
                    self._handle.wait()
                    if self._after is not None:
                        self._after()
                except Exception as exc:  # noqa: BLE001 - re-raised typed, on every wait()
                    self._error = CommError(f"{self._what} failed while waiting: {exc}")
                    self._error.__cause__ = exc
                self._done = True
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        """False while running; True once done; a collective that failed raises its
        :class:`CommError` here too (a pool must not recycle a failed collective's bucket)."""
        if not self._done:
            native = getattr(self._handle, "is_completed", None)
            if not (callable(native) and native()):
                return False
            self.wait()     # already done: does not block, only runs ``after`` (or raises)
        if self._error is not None:
            raise self._error
        return True


# -- helpers -----------------------------------------------------------------------------------
def check_reduce_op(op: str) -> None:
    if op not in REDUCE_OPS:
        raise InvalidArgumentError(
            f"reduce op {op!r} is not supported; use one of {', '.join(map(repr, REDUCE_OPS))}")


def _check_flat(name: str, what: str, tensor) -> None:
    """A 1-D MindSpore tensor; its dtype is checked by the caller (see _check_input)."""
    if not isinstance(tensor, ms.Tensor):
        raise CommError(f"{name} {what} must be a mindspore Tensor, got {type(tensor).__name__}")
    if tensor.ndim != 1:
        raise CommError(f"{name} {what} must be a flat 1-D tensor, got shape {tuple(tensor.shape)};"
                        " pass tensor.reshape(-1) or a pool lease tensor")


def _check_input(name: str, what: str, tensor) -> None:
    _check_flat(name, what, tensor)
    check_dtype(tensor.dtype)


def _check_output(name: str, output, input, expected_numel: int, how: str) -> None:
    """``output`` flat, of ``input``'s dtype and of ``expected_numel`` elements."""
    _check_flat(name, "output", output)
    if output.dtype != input.dtype:
        raise CommError(f"{name} output dtype {output.dtype} does not match input dtype "
                        f"{input.dtype}; give the output the input's dtype")
    if output.numel() != expected_numel:
        raise CommError(f"{name} output has {output.numel()} elements, expected {expected_numel} "
                        f"({how}); size the output accordingly")


# -- the interface -----------------------------------------------------------------------------
class Communicator(abc.ABC):
    """Collectives over flat 1-D tensors of one group; every method returns a :class:`CommHandle`.

    * ``reduce_scatter(output, input)``: ``input`` has ``W*n`` elements, ``output`` ``n``; rank r
      gets elements ``[r*n, (r+1)*n)`` of the elementwise reduction over ranks.
    * ``all_gather(output, input)``: ``output`` (``W*n``) is the concatenation of every rank's
      ``input`` (``n``), in rank order.
    * ``all_reduce(tensor)``: in place into ``tensor``.

    ``op`` is ``"sum"`` or ``"avg"`` (sum divided by the world size). The arguments are checked
    here, once, before any backend sees them.
    """

    @property
    @abc.abstractmethod
    def rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def world_size(self) -> int: ...

    def reduce_scatter(self, output: ms.Tensor, input: ms.Tensor, op: str = "sum",
                       async_op: bool = False) -> CommHandle:
        check_reduce_op(op)
        _check_input("reduce_scatter", "input", input)
        world = self.world_size
        if input.numel() % world:
            raise CommError(f"reduce_scatter input has {input.numel()} elements, not a multiple "
                            f"of world size {world}; pad the bucket to a multiple of {world}")
        _check_output("reduce_scatter", output, input, input.numel() // world,
                      f"input {input.numel()} / world size {world}")
        return self._reduce_scatter(output, input, op, async_op)

    def all_gather(self, output: ms.Tensor, input: ms.Tensor,
                   async_op: bool = False) -> CommHandle:
        _check_input("all_gather", "input", input)
        world = self.world_size
        _check_output("all_gather", output, input, input.numel() * world,
                      f"world size {world} x input {input.numel()}")
        return self._all_gather(output, input, async_op)

    def all_reduce(self, tensor: ms.Tensor, op: str = "sum", async_op: bool = False) -> CommHandle:
        check_reduce_op(op)
        _check_input("all_reduce", "tensor", tensor)
        return self._all_reduce(tensor, op, async_op)

    @abc.abstractmethod
    def _reduce_scatter(self, output, input, op: str, async_op: bool) -> CommHandle: ...

    @abc.abstractmethod
    def _all_gather(self, output, input, async_op: bool) -> CommHandle: ...

    @abc.abstractmethod
    def _all_reduce(self, tensor, op: str, async_op: bool) -> CommHandle: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


# -- world size 1 ------------------------------------------------------------------------------
class SingleProcessCommunicator(Communicator):
    """World size 1: every collective is the identity (an average over one rank included)."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        return self._copy(output, input)

    def _all_gather(self, output, input, async_op) -> CommHandle:
        return self._copy(output, input)

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        return CompletedHandle()

    @staticmethod
    def _copy(output, input) -> CommHandle:
        if output is not input and not _host_copy(output, input):
            overwrite(output, input)
            # The handle says the write has happened. On CPU the host path reads the output's
            # memory next: the queued copy must have run. On Ascend whatever reads it (an op,
            # the pool's next lease of the bucket) is queued after it on the same stream.
            if device_target() != "Ascend":
                synchronize()
        return CompletedHandle()


def _host_copy(output: ms.Tensor, input: ms.Tensor) -> bool:
    """Copy ``input`` into ``output`` (same length) through their host memory with NumPy, done on
    return; False, having done nothing, unless both are contiguous CPU tensors of one dtype.

    On CPU a slice-assignment into a lease's prefix view plus the ``synchronize`` it needs cost
    more than a whole small pack, and MindSpore's copy kernel runs well below memcpy bandwidth
    (docs/benchmarks/host-path.md#host-copy-of-a-result); a device's tensors take ``overwrite``."""
    if output.device != "CPU" or input.device != "CPU":
        return False
    # Queued ops writing either tensor run first (and have placed their outputs in memory).
    drain_launch_queue()
    dst = host_alias(output)
    src = host_alias(input) if dst is not None else None
    if src is None or src.dtype != dst.dtype:
        return False
    np.copyto(dst, src.reshape(dst.shape))
    return True


class _GroupCommunicator(Communicator):
    """A communicator over a real process group: rank and size are read once, at construction."""

    _rank: int
    _world: int

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world


# -- CPU: MCCL under msrun ---------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _jitted(kind: str, group: str):
    """A compiled sum-AllReduce or AllGather over ``group``, shared by every communicator.

    On CPU these primitives only run inside a graph (PyNative ``mint.distributed`` kernels are
    unregistered there), hence ``@ms.jit``; ``ReduceScatter`` has no CPU kernel even in a graph.
    Two separate functions: MindSpore warns when one jitted source function is compiled twice."""
    if kind == "all_reduce":
        all_reduce = ops.AllReduce(op=ops.ReduceOp.SUM, group=group)

        @ms.jit
        def run_all_reduce(x):
            return all_reduce(x)
        return run_all_reduce

    all_gather = ops.AllGather(group=group)

    @ms.jit
    def run_all_gather(x):
        return all_gather(x)
    return run_all_gather


# A compiled CPU collective keeps memory in proportion to the largest input it has run on, so
# each runs in pieces of at most this many elements (docs/benchmarks/memory.md#cpu-collectives).
CPU_PIECE_ELEMENTS = 1 << 18


def cpu_pieces(numel: int, limit: Optional[int] = None) -> list[tuple[int, int, int]]:
    """``(start, length, padded)`` pieces covering ``[0, numel)`` in order: ``length <= limit``
    elements each, sent as ``padded`` elements, a power of two (zero-filled past ``length``), so
    a process compiles at most one graph per power of two and every graph stays small."""
    limit = limit or CPU_PIECE_ELEMENTS
    pieces = []
    for start in range(0, numel, limit):
        length = min(limit, numel - start)
        pieces.append((start, length, 1 << (length - 1).bit_length()))
    return pieces


class CpuMcclCommunicator(_GroupCommunicator):
    """CPU ranks started by ``msrun`` (MCCL backend).

    MindSpore 2.10 has no CPU reduce-scatter kernel, so ``reduce_scatter`` is an **all-reduce of
    the whole input followed by keeping this rank's chunk**: it moves W times the bytes of a real
    reduce-scatter (fine for tests and CPU runs, not a performance model). In a sub-group (a mesh
    dim) ``all_gather`` is an all-reduce too, AllGather running over the world group only: each
    rank contributes its input at its own offset and zeros elsewhere. Every collective runs in
    pieces of at most :data:`CPU_PIECE_ELEMENTS` (see :func:`cpu_pieces`), each staged through
    host memory into a reused tensor of the wire dtype and written into the output when it
    returns. The CPU collectives reject bfloat16, so **bfloat16 travels as float32 on the wire**
    (exact for the values, sums are accumulated in float32) and is rounded back as MindSpore's
    cast rounds. ``"avg"`` is the sum divided by the world size. Collectives run synchronously:
    the handle is complete when returned.
    """

    def __init__(self, group: Optional[str] = None):
        from mindspore.communication import GlobalComm, get_group_size, get_rank
        self._world_group = GlobalComm.WORLD_COMM_GROUP
        self.group = group or GlobalComm.WORLD_COMM_GROUP
        self._rank = get_rank(self.group)
        self._world = get_group_size(self.group)
        # (padded length, source's host dtype) -> (tensor of the wire dtype, its host memory): a
        # piece is written into its stage with NumPy, cheaper than a slice, pad and cast as ops.
        self._stages: dict = {}

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        n = output.numel()
        mine = self._rank * n
        with _HostOutput(output) as dst:
            for start, total in self._summed("reduce_scatter", _host_input(input), 0,
                                             input.numel(), op):
                low, high = max(start, mine), min(start + total.size, mine + n)
                if low < high:
                    _cast_into(dst[low - mine:high - mine], total[low - start:high - start])
        return CompletedHandle()

    def _all_gather(self, output, input, async_op) -> CommHandle:
        n, src = input.numel(), _host_input(input)
        with _HostOutput(output) as dst:
            if self.group != self._world_group:
                # AllGather runs only over the world group on CPU ("AllGather only support
                # mccl_world_group"): the sum of every rank's input at its own offset, zeros
                # elsewhere (exact: every other addend is zero).
                for start, total in self._summed("all_gather", src, self._rank * n,
                                                 self._world * n, "sum"):
                    _cast_into(dst[start:start + total.size], total)
                return CompletedHandle()
            for piece in cpu_pieces(n):
                start, length, padded = piece
                gathered = self._run("all_gather", "all_gather", self._stage(piece, src, 0))
                rows = gathered.reshape(self._world, padded)
                for owner in range(self._world):
                    at = owner * n + start
                    _cast_into(dst[at:at + length], rows[owner, :length])
        return CompletedHandle()

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        src = _host_input(tensor)
        with _HostOutput(tensor) as dst:
            # piece by piece in place: a piece is staged (read) before its result is written
            for start, total in self._summed("all_reduce", src, 0, tensor.numel(), op):
                _cast_into(dst[start:start + total.size], total)
        return CompletedHandle()

    def _summed(self, name: str, src: np.ndarray, offset: int, numel: int, op: str):
        """``(start, values)`` per piece of the all-reduced sequence of ``numel`` elements that
        holds ``src`` at ``offset`` and zeros elsewhere (divided by the world size for "avg")."""
        for piece in cpu_pieces(numel):
            total = self._run(name, "all_reduce", self._stage(piece, src, offset))[:piece[1]]
            yield piece[0], (total / self._world if op == "avg" else total)

    def _stage(self, piece: tuple[int, int, int], src: np.ndarray, offset: int) -> ms.Tensor:
        """The tensor that carries ``piece`` of the sequence holding ``src`` at ``offset`` and
        zeros elsewhere: the wire dtype, zero-padded to the piece's padded length."""
        start, length, padded = piece
        key = (padded, src.dtype)
        if key not in self._stages:
            tensor = mint.zeros(padded, dtype=_WIRE_DTYPE[src.dtype])
            drain_launch_queue()        # allocated and filled before NumPy writes it
            self._stages[key] = (tensor, host_alias(tensor))
        tensor, stage = self._stages[key]
        # the part of the piece inside src, then zeros around it: each element written once
        low = min(max(start, offset), start + length)
        high = max(min(start + length, offset + src.size), low)
        np.copyto(stage[low - start:high - start], src[low - offset:high - offset],
                  casting="unsafe")              # bfloat16 -> float32 is exact
        stage[:low - start] = 0
        stage[high - start:] = 0
        return tensor

    def _run(self, name: str, kind: str, tensor: ms.Tensor) -> np.ndarray:
        """The collective ``kind`` over ``tensor``; its result's host memory, once written."""
        try:
            result = _jitted(kind, self.group)(tensor)
            drain_launch_queue()
        except Exception as exc:  # noqa: BLE001 - MindSpore raises RuntimeError/TypeError/...
            raise CommError(f"{name} of {tensor.numel()} x {tensor.dtype} over group "
                            f"{self.group!r} failed on rank {self._rank}: {exc}") from exc
        return host_alias(result)

    def __repr__(self) -> str:
        return (f"CpuMcclCommunicator(rank={self._rank}, world_size={self._world}, "
                f"group={self.group!r})")


def _host_input(tensor: ms.Tensor) -> np.ndarray:
    """A CPU tensor's values as a flat NumPy array, once every queued op writing it has run."""
    drain_launch_queue()
    array = host_alias(tensor)
    if array is None:
        tensor = tensor.contiguous()
        drain_launch_queue()
        array = host_alias(tensor)
    return array


class _HostOutput:
    """``with _HostOutput(tensor) as array``: ``tensor``'s host memory to write; a tensor that
    has none (not contiguous) is written from a temporary when the block ends."""

    def __init__(self, tensor: ms.Tensor):
        drain_launch_queue()        # queued ops writing the tensor run before NumPy writes
        self._tensor, self._staged = tensor, None
        self._array = host_alias(tensor)
        if self._array is None:
            self._staged = mint.zeros(tensor.numel(), dtype=tensor.dtype)
            drain_launch_queue()
            self._array = host_alias(self._staged)

    def __enter__(self) -> np.ndarray:
        return self._array

    def __exit__(self, kind, *_) -> None:
        if kind is None and self._staged is not None:
            overwrite(self._tensor, self._staged)
            drain_launch_queue()


def _cast_into(dst: np.ndarray, values: np.ndarray) -> None:
    """``values`` written into ``dst`` in its dtype, NaNs as MindSpore's cast writes them."""
    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(dst, values, casting="unsafe")
    if values.dtype != dst.dtype:
        canonicalize_nans(dst)


# The dtype a host array's values travel as: the CPU collectives reject bfloat16, and float32
# carries its values exactly.
_WIRE_DTYPE = {np.dtype(np.float32): ms.float32, np.dtype(np.float16): ms.float16,
               np.dtype(ml_dtypes.bfloat16): ms.float32}


# -- Ascend: HCCL through mint.distributed ----------------------------------------------------
class AscendHcclCommunicator(_GroupCommunicator):
    """Ascend ranks, through ``mindspore.mint.distributed`` (HCCL).

    ``async_op=True`` returns a handle wrapping MindSpore's ``CommHandle`` (``wait()`` only; see
    :class:`_WrappedHandle` for ``is_completed``); ``async_op=False`` is ordered on the device
    streams, so it returns a completed handle. MindSpore 2.10 documents ``"avg"`` for these calls;
    set ``native_avg = False`` for a stack without it, and "avg" becomes a sum divided by the world
    size after the wait. Cannot run on the CPU-only test machines; its checks and handle logic are
    shared with the CPU backends and tested there.
    """

    native_avg = True

    def __init__(self, group: Optional[str] = None, backend=None):
        """``backend``: ``mindspore.mint.distributed`` (None), or a stand-in with its functions
        for tests of this class's own logic on machines without an NPU."""
        if backend is None:
            if device_target() != "Ascend":
                raise CommError(f"AscendHcclCommunicator needs device target 'Ascend', the "
                                f"process runs on {device_target()!r}; use communicator_for()")
            from mindspore.mint import distributed as backend
        self._dist = backend
        self.group = group          # None: hccl_world_group
        self._rank = backend.get_rank(group)
        self._world = backend.get_world_size(group)

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        wire_op = self._wire_op(op)
        handle = self._dist.reduce_scatter_tensor(output, input, op=wire_op, group=self.group,
                                                  async_op=async_op)
        return self._handle("reduce_scatter", handle, output, op != wire_op)

    def _all_gather(self, output, input, async_op) -> CommHandle:
        handle = self._dist.all_gather_into_tensor(output, input, group=self.group,
                                                   async_op=async_op)
        return self._handle("all_gather", handle, output, False)

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        wire_op = self._wire_op(op)
        handle = self._dist.all_reduce(tensor, op=wire_op, group=self.group, async_op=async_op)
        return self._handle("all_reduce", handle, tensor, op != wire_op)

    def _wire_op(self, op: str) -> str:
        return "sum" if op == "avg" and not self.native_avg else op

    def _handle(self, name: str, handle, output, divide: bool) -> CommHandle:
        after = (lambda: overwrite(output, mint.div(output, self._world))) if divide else None
        if handle is None:          # async_op=False: already ordered on the stream
            if after is not None:
                after()
            return CompletedHandle()
        return _WrappedHandle(handle, f"{name} on rank {self._rank}", after)


# -- choosing a backend ------------------------------------------------------------------------
def launched_by_msrun() -> bool:
    """True in the processes msrun starts (it exports MS_ROLE, MS_WORKER_NUM, MS_SCHED_HOST, ...)."""
    return os.environ.get("MS_ROLE") in _MSRUN_ROLES


def init_distributed() -> tuple[int, int]:
    """Initialize MindSpore communication once if msrun started this process; ``(rank, world)``.

    Idempotent; also returns the group of a process whose communication the caller initialized
    already. Outside msrun it returns ``(0, 1)`` and initializes nothing. In msrun's scheduler
    process (``MS_ROLE=MS_SCHED``, which runs the same script) ``init()`` serves the cluster and
    exits the process when the workers are done: it never returns there."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank, init
    if not GlobalComm.INITED:
        if not launched_by_msrun():
            return 0, 1
        logger.info("initializing MindSpore communication (MS_ROLE=%s, MS_WORKER_NUM=%s)",
                    os.environ.get("MS_ROLE"), os.environ.get("MS_WORKER_NUM"))
        init()
    group = GlobalComm.WORLD_COMM_GROUP
    return get_rank(group), get_group_size(group)


def communicator_for(device: Optional[str] = None, group: Optional[str] = None) -> Communicator:
    """The communicator for this process: single-process unless launched with more than one rank,
    else MCCL on CPU or HCCL on Ascend (``device`` defaults to the context's device target)."""
    device = device or device_target()
    if device not in SUPPORTED_DEVICES:
        raise InvalidArgumentError(
            f"device {device!r} is not supported; use one of {', '.join(SUPPORTED_DEVICES)}")
    _, world = init_distributed()
    if world == 1:
        return SingleProcessCommunicator()
    if device == "CPU":
        return CpuMcclCommunicator(group)
    return AscendHcclCommunicator(group)
