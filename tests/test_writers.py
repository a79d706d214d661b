"""gradpool.writers: the one writer interface, a writer per pool device. writer_for's choice
(and a reducer's, once), the ``host=`` switch that tests the device path on CPU, an Ascend pool's
pack that never takes the host path, and what both writers must do alike, on both: bit copies of
a bucket's own dtype (NaN payloads included), an accumulate onto everything the bucket holds,
unpack_gathered's dtype, a lazily initialized gradient refused with nothing written."""
import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore.common.initializer import One

from gradpool import writers
from gradpool.comm import SingleProcessCommunicator
from gradpool.errors import InvalidArgumentError
from gradpool.host import writer as host_module
from gradpool.host.views import host_view
from gradpool.host.writer import HostWriter, host_writer
from gradpool.layout import ReduceScatterLayout
from gradpool.pack import DEVICE
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig
from gradpool.writers import writer_for
from npref import add_rounded, normal, np_pack, raw_bytes, round_to, values

ms.set_device("CPU")


def test_the_writer_is_chosen_by_the_pool_device_and_host_copies():
    """The host writer only for a CPU pool with host copies on; the device writer otherwise
    (Ascend, and the device path tested on CPU). A reducer chooses once, when it is made."""
    assert isinstance(writer_for("CPU"), HostWriter) and writer_for("CPU") is host_writer()
    assert writer_for("CPU", host=False) is DEVICE
    assert writer_for("Ascend") is DEVICE and writer_for("Ascend", host=False) is DEVICE
    for device, host, want in (("CPU", True, host_writer()), ("CPU", False, DEVICE),
                               ("Ascend", True, DEVICE)):
        reducer = GradReducer(BucketPool(device=device), SingleProcessCommunicator(),
                              ReducerConfig(reduce_dtype=ms.float32, host_copies=host))
        assert reducer.writer is want, (device, host)


@pytest.mark.parametrize("call", ["pack", "accumulate", "unpack_gathered"])
def test_host_false_never_takes_the_numpy_path(call, monkeypatch):
    """host=False is how the device (Ascend) path is tested on CPU: it must not reach the NumPy
    writer (pack, accumulate) or read the bucket through host memory (unpack_gathered); host=True
    on a CPU pool must. Both give NumPy's values."""
    # The host writer's entry points: pack/accumulate write through _write, unpack_gathered
    # reads the bucket's host memory (bucket_array).
    owner, hook = (HostWriter, "bucket_array" if call == "unpack_gathered" else "_write")
    layout = ReduceScatterLayout.build([(4, 3), (5,)], 2, 1)
    rng = np.random.default_rng(3)
    raw = [normal(rng, (4, 3)), normal(rng, (5,))]
    for host in (False, True):
        lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel,
                                                                    ms.float32)
        grads = [ms.Tensor(r) for r in raw]
        if call != "pack":
            writers.pack(lease, grads, layout, host=False)
        calls = []
        real = getattr(owner, hook)
        monkeypatch.setattr(owner, hook, lambda *a, **k: calls.append(a) or real(*a, **k))
        if call == "unpack_gathered":
            out = writers.unpack_gathered(lease, layout, host=host)
            for tensor, r in zip(out, raw):
                np.testing.assert_array_equal(values(tensor), r)
        else:
            written = getattr(writers, call)(lease, grads, layout, host=host)
            assert written.on_host is host
            times = 2 if call == "accumulate" else 1
            np.testing.assert_array_equal(values(lease.tensor),
                                          times * np_pack(raw, layout, "float32"))
        assert bool(calls) is host
        monkeypatch.undo()
        lease.release()


def test_a_host_pack_into_an_ascend_pool_never_drains_the_launch_queue(monkeypatch):
    """``host_copies`` may be on with an Ascend pool: its buckets are device memory, so a pack
    takes the device path, and draining the launch queue per pack would serialize the streams
    that overlap backward with the reduce."""
    drains = []
    monkeypatch.setattr(host_module, "drain_launch_queue", lambda: drains.append(1))
    layout = ReduceScatterLayout.build([(16,)], 1, 1)
    source = np.arange(16, dtype=np.float32)
    lease = BucketPool(device="Ascend", alignment_bytes=4).acquire(16, ms.float32)
    assert not writers.pack(lease, [ms.Tensor(source)], layout, host=True).on_host
    np.testing.assert_array_equal(values(lease.tensor), source)
    assert drains == []
    lease.release()
    cpu_lease = BucketPool(device="CPU", alignment_bytes=4).acquire(16, ms.float32)
    assert writers.pack(cpu_lease, [ms.Tensor(source)], layout, host=True).on_host
    assert drains == [1]
    cpu_lease.release()


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
def test_unpack_gathered_of_a_whole_bucket_keeps_the_dtype(host):
    layout = ReduceScatterLayout.build([(4, 6)], 2, 1)
    for dtype in (ms.float32, ms.float16, ms.bfloat16):
        full = normal(np.random.default_rng(1), (4, 6))
        lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel, dtype)
        writers.pack(lease, [ms.Tensor(full).astype(dtype)], layout, host=host)
        out, = writers.unpack_gathered(lease, layout, host=host)
        assert out.dtype == dtype and tuple(out.shape) == (4, 6)
        np.testing.assert_array_equal(values(out), round_to(full, dtype))
        lease.release()


def _payload_nans(dtype, shape, seed):
    """Random values of a 16-bit ``dtype`` with NaNs carrying payloads (not MindSpore's canonical
    NaN), as that dtype's uint16 bit patterns."""
    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(seed)
    bits = rng.standard_normal(shape).astype(np.float32).astype(np_dtype).view(np.uint16).copy()
    flat = bits.reshape(-1)
    flat[1] = 0x7E01 if dtype == "float16" else 0x7F81
    flat[-2] = 0xFD55 if dtype == "float16" else 0xFFC3
    return bits


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_same_dtype_pack_is_a_bit_copy_nans_included(dtype, host):
    """Packing 16-bit gradients into a bucket of their own dtype casts nothing, so every bit,
    NaN payloads included, lands as it was (NumPy's pack of the raw bits is the reference)."""
    ms_dtype = getattr(ms, dtype)
    shapes = [(5, 3), (4,)]
    bits = [_payload_nans(dtype, s, seed) for seed, s in enumerate(shapes)]
    grads = [ms.Tensor(b.view(np.int16)).view(ms_dtype) for b in bits]
    layout = ReduceScatterLayout.build(shapes, 2, 2)
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel, ms_dtype)
    writers.pack(lease, grads, layout, host=host)
    expected = np_pack_bits(bits, layout)
    assert raw_bytes(lease.tensor) == expected.tobytes()
    lease.release()


def np_pack_bits(bits, layout):
    """NumPy's pack of uint16 bit patterns (zero bits in every pad and gap)."""
    # np_pack works in float64: carry each 16-bit pattern as an exact integer value.
    return np_pack([b.astype(np.float64) for b in bits], layout).astype(np.uint16)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_accumulate_adds_onto_everything_the_bucket_holds(dtype, host):
    """accumulate is ``bucket += pack(grads)`` over the whole bucket: entries that are padding in
    the layout (uneven-shard rows, alignment gaps) keep what the bucket held, here random
    values written straight into its memory, on both write paths."""
    ms_dtype = getattr(ms, dtype)
    shapes = [(5, 3), (3,), (4, 5)]
    layout = ReduceScatterLayout.build(shapes, 2, 4, [0, 0, 1])
    assert layout.padding_numel > 0
    rng = np.random.default_rng(11)
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel, ms_dtype)
    held = round_to(normal(rng, (layout.total_numel,)), dtype)
    host_view(lease.allocation)[:layout.total_numel] = held      # CPU: the bucket's memory
    raw = [normal(rng, s) for s in shapes]
    writers.accumulate(lease, [ms.Tensor(r) for r in raw], layout, host=host)
    np.testing.assert_array_equal(values(lease.tensor),
                                  add_rounded(held, np_pack(raw, layout), dtype))
    lease.release()


@pytest.mark.parametrize("host", [True, False])
def test_a_lazily_initialized_gradient_is_refused_with_nothing_written(host):
    """A gradient made with ``init=`` has no memory until init_data(): its data pointer is 0, so
    the address path must not write from it, and every path names it instead of failing inside
    MindSpore ("Current Tensor has no device!")."""
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(16, ms.float32)
    layout = ReduceScatterLayout.build([(16,)], 1, 1)
    writers.pack(lease, [ms.Tensor(np.full(16, 2.5, np.float32))], layout, host=host)
    lazy = ms.Tensor(shape=(16,), dtype=ms.float32, init=One())
    with pytest.raises(InvalidArgumentError) as err:
        writers.pack(lease, [lazy], layout, host=host)
    assert str(err.value) == ("gradient 0 is lazily initialized (One) and has no memory yet; "
                              "call its init_data() before packing it")
    np.testing.assert_array_equal(values(lease.tensor), np.full(16, 2.5, np.float32))
    lazy.init_data()
    writers.pack(lease, [lazy], layout, host=host)
    np.testing.assert_array_equal(values(lease.tensor), np.ones(16, np.float32))
    lease.release()


def test_add_in_place_adds_into_the_same_tensor_exactly_as_mindspore_does():
    """main_grad's accumulate on CPU: the target object itself holds the sum afterwards (the
    values MindSpore's own add gives, bit for bit), the addend is untouched; a pair it cannot add
    through host memory (a strided view, another dtype or size) is left alone, False."""
    rng = np.random.default_rng(3)
    start = rng.standard_normal(1000).astype(np.float32)
    addend_np = rng.standard_normal(1000).astype(np.float32)
    target, addend = ms.Tensor(start.copy()), ms.Tensor(addend_np.copy())
    expected = ms.mint.add(ms.Tensor(start.copy()), ms.Tensor(addend_np.copy())).asnumpy()
    assert writers.add_in_place(target, addend) is True
    assert target.asnumpy().tobytes() == expected.tobytes()
    assert addend.asnumpy().tobytes() == addend_np.tobytes()
    strided = ms.Tensor(rng.standard_normal((10, 200)).astype(np.float32))[:, ::2]
    for other in (strided, ms.Tensor(addend_np[:999]), ms.Tensor(addend_np.astype(np.float16))):
        before = target.asnumpy().copy()
        assert writers.add_in_place(target, other) is False
        assert target.asnumpy().tobytes() == before.tobytes()
