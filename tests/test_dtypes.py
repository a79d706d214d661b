"""gradpool.dtypes: the supported dtypes by name and by value (a copy of a dtype object is that
dtype), the refusal of any other, whole-storage tensors, and host_alias (the memory of a CPU
tensor, or None where there is none of a supported dtype), and MindSpore's NaNs written into a
16-bit float array."""
import copy
import gc
import weakref

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import mint
from mindspore.common.initializer import One

from gradpool import dtypes
from gradpool.dtypes import canonicalize_nans, dtype_named, host_alias, is_whole_storage
from gradpool.errors import UnsupportedDtypeError
from npref import round_to, values

ms.set_device("CPU")


def test_dtype_named_maps_every_name_and_refuses_others():
    assert [dtype_named(n) for n in ("float32", "float16", "bfloat16")] == \
        [ms.float32, ms.float16, ms.bfloat16]
    with pytest.raises(UnsupportedDtypeError) as err:
        dtype_named("int8")
    assert str(err.value) == ("dtype name 'int8' is not supported; use one of float32, float16, "
                              "bfloat16")


@pytest.mark.parametrize("call", ["itemsize", "check_dtype"])
def test_an_unsupported_dtype_is_refused_by_name(call):
    assert [dtypes.itemsize(d) for d in (ms.float32, ms.float16, ms.bfloat16)] == [4, 2, 2]
    with pytest.raises(UnsupportedDtypeError) as err:
        getattr(dtypes, call)(ms.int32)
    assert str(err.value) == ("dtype Int32 is not supported; supported dtypes: Float32, Float16, "
                              "BFloat16")


def test_a_dtype_equal_to_a_supported_one_but_another_object_is_supported():
    """MindSpore's dtypes compare by value: a copy of float32 (not the singleton) is float32 to
    gradpool too, with its item size."""
    for dtype, size in ((ms.float32, 4), (ms.float16, 2), (ms.bfloat16, 2)):
        twin = copy.deepcopy(dtype)
        assert twin == dtype and twin is not dtype
        dtypes.check_dtype(twin)
        assert dtypes.itemsize(twin) == size


def test_is_whole_storage_only_for_a_tensor_spanning_its_storage():
    for dtype in (ms.float32, ms.float16, ms.bfloat16):
        whole = mint.zeros(8, dtype=dtype)
        assert is_whole_storage(whole) is True
        assert is_whole_storage(whole[0:5]) is False          # a prefix of a larger storage
        assert is_whole_storage(whole[3:8]) is False          # an offset view
    assert is_whole_storage(ms.Tensor(np.zeros(4, np.int32))) is False   # not a managed dtype


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_host_alias_is_the_memory_of_any_contiguous_cpu_tensor(dtype):
    """host_alias gives the memory itself, of a whole tensor and of a contiguous view at an
    offset alike (a write lands in the tensor), and keeps the tensor alive unless told not to."""
    raw = round_to(np.random.default_rng(34).standard_normal(8), dtype)
    whole = ms.Tensor(raw).astype(getattr(ms, dtype))
    for tensor, start in ((whole, 0), (whole[2:6], 2)):
        array = host_alias(tensor)
        np.testing.assert_array_equal(array.astype(np.float32), raw[start:start + array.size])
        array[1] = 3.0
        assert values(whole)[start + 1] == 3.0
    kept = ms.Tensor(raw).astype(getattr(ms, dtype))
    alive, array = weakref.ref(kept), host_alias(kept)
    del kept
    gc.collect()
    assert alive() is not None, "the array must keep its tensor alive"
    np.testing.assert_array_equal(array.astype(np.float32), raw)
    loose = ms.Tensor(raw).astype(getattr(ms, dtype))
    alive, array = weakref.ref(loose), host_alias(loose, keep_alive=False)
    del loose, array
    gc.collect()
    assert alive() is None


def test_host_alias_refuses_what_has_no_host_memory_of_a_supported_dtype():
    transposed = ms.Tensor(np.zeros((3, 4), np.float32)).T
    assert not transposed.is_contiguous()
    for tensor in (ms.Tensor(np.zeros(4, np.int32)),                  # not a gradient dtype
                   transposed,                                        # not contiguous
                   ms.Tensor(np.zeros(0, np.float32)),               # no memory
                   ms.Tensor(shape=(4,), dtype=ms.float32, init=One())):   # not materialized
        assert host_alias(tensor) is None


def test_canonicalize_nans_edge_cases():
    """No-op for float32 and empty arrays; a one-element array is canonicalized too."""
    f32 = np.array([np.nan, 1.0], np.float32)
    before = f32.tobytes()
    canonicalize_nans(f32)
    assert f32.tobytes() == before
    canonicalize_nans(np.zeros(0, np.float16))
    canonicalize_nans(np.zeros(0, ml_dtypes.bfloat16))
    one = np.array([0xFE01], np.uint16).view(np.float16)         # a negative NaN with payload
    canonicalize_nans(one)
    assert one.view(np.uint16).tolist() == [0xFE00]
    one_bf16 = np.array([0xFF81], np.uint16).view(ml_dtypes.bfloat16)
    canonicalize_nans(one_bf16)
    assert one_bf16.view(np.uint16).tolist() == [0x7FC0]
