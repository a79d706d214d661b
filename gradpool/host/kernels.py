"""The compiled host loops of the CPU pack path (numba): the float32 -> bfloat16 cast, and the
single-gradient writes between two host addresses. Code generation (LLVM IR, numba intrinsics),
compiled once per process (:func:`compile_host_loops`); without numba every function here returns
None and the callers take their NumPy / ml-dtypes path (same bits).
"""
from __future__ import annotations

import functools
import logging
import platform
from typing import Callable, NamedTuple, Optional

import numpy as np

from gradpool.host import caches

logger = logging.getLogger(__name__)

_NO_NUMBA = ("numba cannot be imported (%s): host casts fall back to NumPy and ml-dtypes, same "
             "bits, several times slower; pip install 'numba>=0.60,<0.69'")


# From how many bytes written the compiled writers use non-temporal stores: a third of this
# machine's last-level cache share (gradpool.host.caches), past which a bucket leaves the cache
# anyway and an ordinary store reads each line before overwriting it. Read by every call, so
# tests can replace them.
_THRESHOLDS = caches.stream_thresholds()
STREAM_FROM_BYTES = _THRESHOLDS.cast_from_bytes
COPY_STREAM_FROM_BYTES = _THRESHOLDS.copy_from_bytes

_STREAM_LANES = 16          # elements per vector store: 32 bytes, one AVX2 register
_PAGE_BYTES = 4096
# Pages a streaming copy walks at once, a read and a write stream each: more write streams than
# the core's write-combining buffers hold slow it (docs/benchmarks/host-path.md#streams-per-copy).
_STREAM_PAGES = 4
_STREAM_BLOCK = _STREAM_PAGES * _PAGE_BYTES


@functools.lru_cache(maxsize=1)
def compile_host_loops() -> bool:
    """Import numba and compile every loop here, once per process
    (docs/benchmarks/host-path.md#compile-time); False without numba. Called when the host writer
    is made, not in a training step, where a Ctrl-C once left numba half-imported for good."""
    writers = _address_writers()
    if writers is None:
        return False
    words, halves = np.zeros(2 * _STREAM_LANES, np.uint32), np.zeros(2 * _STREAM_LANES, np.uint16)
    sources = {"float32": words, "float16": halves, "bfloat16": halves}
    for (src, dst), write in writers.items():
        out = np.zeros_like(sources[dst])
        write(out.ctypes.data, sources[src].ctypes.data, 2 * _STREAM_LANES)
    _bfloat16_kernel()(words, halves.copy(), STREAM_FROM_BYTES)
    return True


def _stream_rounded_intrinsic(lanes: int):  # pragma: no mutate block
    """The intrinsic ``stream_rounded(words, out, start)`` of :func:`_bfloat16_kernel`."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic

    @intrinsic
    def stream_rounded(typingctx, words, out, start):
        """out[start:start + lanes] = the rounded words (round_one's rounding), as one vector
        non-temporal store at a 32-byte aligned out + start: vector IR, since numba has no
        non-temporal store and LLVM vectorizes no loop that has one."""
        def codegen(context, builder, signature, args):
            words_ty, out_ty, _ = signature.args
            src = context.make_array(words_ty)(context, builder, args[0]).data
            dst = context.make_array(out_ty)(context, builder, args[1]).data
            word_vec = ir.VectorType(ir.IntType(32), lanes)

            def splat(value):
                return ir.Constant(word_vec, [value] * lanes)
            x = builder.load(builder.bitcast(builder.gep(src, [args[2]]), word_vec.as_pointer()),
                             align=4)
            is_nan = builder.icmp_unsigned(">", builder.and_(x, splat(0x7FFFFFFF)),
                                           splat(0x7F800000))
            odd = builder.and_(builder.lshr(x, splat(16)), splat(1))
            rounded = builder.lshr(builder.add(builder.add(x, splat(0x7FFF)), odd), splat(16))
            bits = builder.trunc(builder.select(is_nan, splat(0x7FC0), rounded),
                                 ir.VectorType(ir.IntType(16), lanes))
            target = builder.bitcast(builder.gep(dst, [args[2]]), bits.type.as_pointer())
            store = builder.store(bits, target, align=2 * lanes)
            store.set_metadata("nontemporal",
                               builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()
        return types.void(words, out, start), codegen
    return stream_rounded


@functools.lru_cache(maxsize=1)
def _bfloat16_kernel():  # pragma: no mutate block
    """The compiled float32-bits -> bfloat16-bits loop ``kernel(words, out, stream_from_bytes)``,
    None without numba; compiled on first use (docs/benchmarks/host-path.md#compile-time)."""
    try:
        import numba
        import llvmlite  # noqa: F401 - numba's code generator, needed by the intrinsics
    except ImportError as exc:
        logger.warning(_NO_NUMBA, exc)
        return None

    lanes = _STREAM_LANES
    stream_rounded = _stream_rounded_intrinsic(lanes)
    store_fence = _store_fence()

    @numba.njit(nogil=True, cache=False, inline="always")
    def round_one(word):
        if (word & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            return np.uint16(0x7FC0)
        # Round to nearest even on the 16 bits dropped; a carry into the exponent is correct
        # (up to inf). Cannot overflow: only NaN words reach 0xFFFF8000.
        return np.uint16((word + np.uint32(0x7FFF) + ((word >> np.uint32(16)) & np.uint32(1)))
                         >> np.uint32(16))

    @numba.njit(nogil=True, cache=False)
    def round_to_bfloat16(words, out, stream_from_bytes):
        count = words.size
        address = out.ctypes.data
        if count * 2 < stream_from_bytes or address & 1:
            for i in range(count):
                out[i] = round_one(words[i])
            return
        head = min(count, ((32 - (address & 31)) & 31) // 2)   # up to the first 32-byte line
        for i in range(head):
            out[i] = round_one(words[i])
        # Two halves in one loop: two read streams keep more loads in flight than one
        # (docs/benchmarks/host-path.md#cast-read-streams).
        vectors = (count - head) // lanes
        half = vectors // 2
        first, second = head, head + half * lanes
        for _ in range(half):
            stream_rounded(words, out, first)
            stream_rounded(words, out, second)
            first += lanes
            second += lanes
        for i in range(second, count):       # an odd last vector and the tail
            out[i] = round_one(words[i])
        store_fence()
    logger.debug("compiled the float32 -> bfloat16 cast with numba %s", numba.__version__)
    return round_to_bfloat16


# The public name, which tests replace; address writers and compile_host_loops keep the real one.
bfloat16_kernel = _bfloat16_kernel


@functools.lru_cache(maxsize=1)
def _store_fence():  # pragma: no mutate block
    """The numba intrinsic ``store_fence()`` ending a run of streaming stores (needs numba)."""
    from llvmlite import ir
    from numba.core import types
    from numba.extending import intrinsic
    x86 = platform.machine().lower() in ("x86_64", "amd64")

    @intrinsic
    def store_fence(typingctx):
        """Order the streaming stores before every later memory access (they bypass the normal
        store ordering; the collective that reads the bucket may run on another thread)."""
        def codegen(context, builder, signature, args):
            if x86:
                # LLVM lowers a seq_cst fence on x86 to a locked instruction, which vendors do
                # not all document as ordering streaming stores; sfence is what does.
                sfence = builder.module.declare_intrinsic(
                    "llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
                builder.call(sfence, [])
            else:
                builder.fence("seq_cst")
            return context.get_dummy_value()
        return types.void(), codegen
    return store_fence


# Element sizes of the address writers' dtypes (the key of address_writer's table).
_WIDTH = {"float32": 4, "float16": 2, "bfloat16": 2}


def address_writer(src_dtype: str, dst_dtype: str) -> Optional[Callable[[int, int, int], None]]:
    """The compiled ``write(dst_address, src_address, numel)`` of ``numel`` contiguous elements
    from ``src_dtype`` into ``dst_dtype`` memory, for a same-dtype copy (ranges may overlap),
    bfloat16 -> float32 (exact, NaN payloads kept, as MindSpore widens) and float32 -> bfloat16
    (:func:`bfloat16_kernel`; no overlap); None for another pair or without numba. Stores stream
    from :data:`COPY_STREAM_FROM_BYTES` (copy) or :data:`STREAM_FROM_BYTES` (cast), read per call.

    Why addresses: a small pack is mostly the Python around its copy, and building two NumPy
    arrays over the memory was the largest part of it
    (docs/benchmarks/host-path.md#address-call-dispatch). Why not memcpy: up to glibc's streaming
    threshold, far above the cache sizes, a copy larger than the cache reads each destination
    line before overwriting it (docs/benchmarks/host-path.md#compiled-copy-vs-memcpy)."""
    writers = _address_writers()
    return None if writers is None else writers.get((src_dtype, dst_dtype))


@functools.lru_cache(maxsize=1)
def _address_writers():  # pragma: no mutate block
    """``{(src dtype, dst dtype): write}`` of :func:`address_writer`; None without numba."""
    narrow = _bfloat16_kernel()
    if narrow is None:
        return None
    ops = _address_ops()
    copy_bytes = _compile_copy_bytes(ops)
    writers = {(name, name): _copier(copy_bytes, width) for name, width in _WIDTH.items()}
    writers.update(_compile_casts(ops, narrow))
    logger.debug("compiled the host address writers")
    return writers


class _AddressOps(NamedTuple):
    """The intrinsics the address writers are compiled from (numba and llvmlite present)."""
    words_at: Callable          # address -> uint32 pointer
    halves_at: Callable         # address -> uint16 pointer
    move_bytes: Callable        # (dst, src, nbytes): memmove
    stream_line: Callable       # (dst, src): 32 bytes as one non-temporal vector store
    store_fence: Callable       # () orders the streaming stores before later accesses


def _address_ops() -> _AddressOps:  # pragma: no mutate block
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    def pointer_to(element):
        @intrinsic
        def as_pointer(typingctx, address):
            pointer = types.CPointer(element)

            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(pointer))
            return pointer(address), codegen
        return as_pointer

    @intrinsic
    def move_bytes(typingctx, dst, src, nbytes):
        def codegen(context, builder, signature, args):
            cgutils.raw_memmove(builder, builder.inttoptr(args[0], cgutils.voidptr_t),
                                builder.inttoptr(args[1], cgutils.voidptr_t), args[2], 1)
            return context.get_dummy_value()
        return types.void(dst, src, nbytes), codegen

    @intrinsic
    def stream_line(typingctx, dst, src):
        """32 bytes from ``src`` to 32-byte aligned ``dst`` as one vector non-temporal store."""
        def codegen(context, builder, signature, args):
            line = ir.VectorType(ir.IntType(8), 32)
            value = builder.load(builder.inttoptr(args[1], line.as_pointer()), align=1)
            store = builder.store(value, builder.inttoptr(args[0], line.as_pointer()), align=32)
            store.set_metadata("nontemporal",
                               builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()
        return types.void(dst, src), codegen

    return _AddressOps(pointer_to(types.uint32), pointer_to(types.uint16), move_bytes,
                       stream_line, _store_fence())


def _compile_copy_bytes(ops: _AddressOps):  # pragma: no mutate block
    """The compiled ``copy_bytes(dst, src, nbytes, stream_from_bytes)``: memmove below
    ``stream_from_bytes`` or where the ranges overlap, else streaming stores."""
    import numba
    # numba compiles the closure's free variables as constants: the intrinsics, not ``ops``
    move_bytes, stream_line, store_fence = ops.move_bytes, ops.stream_line, ops.store_fence

    @numba.njit(nogil=True, cache=False)
    def copy_bytes(dst, src, nbytes, stream_from_bytes):
        if nbytes < stream_from_bytes or (src < dst + nbytes and dst < src + nbytes):
            move_bytes(dst, src, nbytes)
            return
        # The plain head brings the source to a page boundary, then the bucket to a cache line,
        # so the blocks fill whole lines and each read stream keeps to one page
        # (docs/benchmarks/host-path.md#copy-head-alignment).
        head = (_PAGE_BYTES - (src & (_PAGE_BYTES - 1))) & (_PAGE_BYTES - 1)
        head = min(nbytes, head + ((64 - ((dst + head) & 63)) & 63))
        move_bytes(dst, src, head)
        # Blocks of _STREAM_PAGES pages, one 64-byte line of each in turn: that many streams in
        # flight, each within a page (docs/benchmarks/host-path.md#streams-per-copy).
        at = head
        while at + _STREAM_BLOCK <= nbytes:
            for line in range(at, at + _PAGE_BYTES, 64):
                for page in range(line, line + _STREAM_BLOCK, _PAGE_BYTES):
                    stream_line(dst + page, src + page)
                    stream_line(dst + page + 32, src + page + 32)
            at += _STREAM_BLOCK
        end = at + (nbytes - at) // 32 * 32
        for line in range(at, end, 32):
            stream_line(dst + line, src + line)
        move_bytes(dst + end, src + end, nbytes - end)
        store_fence()
    return copy_bytes


def _copier(copy_bytes, width: int) -> Callable[[int, int, int], None]:
    def copy(dst: int, src: int, numel: int) -> None:
        copy_bytes(dst, src, numel * width, COPY_STREAM_FROM_BYTES)
    return copy


def _compile_casts(ops: _AddressOps, narrow) -> dict:  # pragma: no mutate block
    """The bfloat16 <-> float32 address writers: widening by a shift, narrowing by ``narrow``
    (:func:`_bfloat16_kernel`)."""
    import numba
    words_at, halves_at = ops.words_at, ops.halves_at

    @numba.njit(nogil=True, cache=False)
    def widen(dst, src, numel):
        halves = numba.carray(halves_at(src), numel)
        words = numba.carray(words_at(dst), numel)
        for i in range(numel):
            words[i] = np.uint32(halves[i]) << np.uint32(16)

    @numba.njit(nogil=True, cache=False)
    def narrow_at(dst, src, numel, stream_from_bytes):
        narrow(numba.carray(words_at(src), numel), numba.carray(halves_at(dst), numel),
               stream_from_bytes)

    def narrowing(dst: int, src: int, numel: int) -> None:
        narrow_at(dst, src, numel, STREAM_FROM_BYTES)

    return {("bfloat16", "float32"): widen, ("float32", "bfloat16"): narrowing}
