"""The one-time device check that ``main_grad``'s in-place add takes effect: on the CPU backend
``Tensor.add_`` of a plain tensor is known to leave it unchanged (shared/notes), so the check
must refuse there, by a typed error naming the option that adds out of place."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, mint, nn

from gradpool import GradPoolConfig, InPlaceOpError, check_in_place_add
from hyper_parallel import fully_shard
from hyper_parallel.core.fully_shard.api import MixedPrecisionPolicy


class Lin(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4) / 10), name="w")

    def construct(self, x):
        return (mint.matmul(x, self.w.T) ** 2).mean()


def test_the_cpu_in_place_add_is_refused_naming_the_out_of_place_option():
    with pytest.raises(InPlaceOpError, match="main_grad_in_place"):
        check_in_place_add()


@pytest.mark.parametrize("in_place", [True, False])
def test_main_grad_accumulation_relying_on_add_is_refused_before_it_drops_a_gradient(in_place):
    """The Ascend path (``Tensor.add_`` into main_grad) forced on CPU: the first landing after
    fully_shard allocates main_grad (a copy of the reduced shard, no add), so it runs; the
    first accumulation into it (a second micro-step) raises before it runs, main_grad left at
    the first gradient; with ``main_grad_in_place=False`` two micro-steps sum exactly."""
    net = Lin()
    mp = MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
    fully_shard(net, mp_policy=mp, pool_config=GradPoolConfig(
        async_reduce=False, main_grad_in_place=in_place))
    (param,) = net.trainable_params()
    param.hsdp_param._add_in_place = in_place     # pylint: disable=protected-access  (Ascend's)
    grad_fn = ms.value_and_grad(net, None, [param])
    x = ms.Tensor(np.ones((2, 4), np.float32))
    w = param.asnumpy()
    want = (2 * (np.ones((2, 4)) @ w.T)[:, :, None] * np.ones((2, 1, 4))).mean(axis=0)
    net.set_is_last_backward(False)
    grad_fn(x)
    np.testing.assert_allclose(param.main_grad.asnumpy(), want / 3, rtol=1e-6)
    if in_place:
        with pytest.raises(InPlaceOpError, match="Tensor.add_ left its target unchanged on CPU"):
            grad_fn(x)
        np.testing.assert_allclose(param.main_grad.asnumpy(), want / 3, rtol=1e-6)
    else:
        grad_fn(x)
        np.testing.assert_allclose(param.main_grad.asnumpy(), 2 * want / 3, rtol=1e-6)
