"""Forward prefetch setters (upstream's argument checks) and a prefetching model at world size 1.
The order of the all-gathers prefetch launches is checked on 2 msrun ranks (fsdp_cases.py:
``forward_prefetch_launches_the_next_units_gathers_first``), where all-gathers exist."""
import mindspore as ms
import numpy as np
import pytest

from gradpool.app.config import from_dict
from gradpool.app.model import TinyDeepSeekV3, make_batch, next_token_loss
from gradpool.app.train import build_sharded_model
from gradpool.errors import InvalidArgumentError

ms.set_device("CPU")
FIELD = ["fully_shard.reduce_dtype=float32", "fully_shard.apply_grad_on_fp32_main_grad=true",
         "fully_shard.comm_fusion=true"]


def test_prefetch_setters_check_their_argument():
    model = build_sharded_model(from_dict({}, FIELD))
    for setter in (model.set_modules_to_forward_prefetch, model.set_modules_to_backward_prefetch):
        with pytest.raises(ValueError, match="list of fully_shard modules, got tuple"):
            setter((model.layers[0],))
        with pytest.raises(InvalidArgumentError, match="entry 1 is a Attention, not a module "
                                                       "fully_shard was applied to"):
            setter([model.layers[0], model.layers[1].attn])
    model.set_modules_to_forward_prefetch([model.layers[0]])
    model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
    first = model.layers[0].__dict__["_hsdp_state"]
    assert model.__dict__["_hsdp_state"].forward_prefetch == [first]
    assert model.layers[1].__dict__["_hsdp_state"].backward_prefetch == [first]


def test_a_prefetching_model_trains_like_the_reference():
    cfg = from_dict({}, FIELD)
    model = build_sharded_model(cfg)
    model.set_modules_to_forward_prefetch([model.layers[0]])
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
    ref = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
    batch = make_batch(cfg.model, 0, seed=cfg.train.seed)
    _, want = ms.value_and_grad(lambda t: next_token_loss(ref, t), None,
                                ref.trainable_params())(batch)
    for _ in range(2):
        model.zero_grad()
        params = model.trainable_params()
        ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)(batch)
        for param, expected in zip(model.trainable_params(), want):
            np.testing.assert_array_equal(param.main_grad.asnumpy(), expected.asnumpy())
    assert all(u.memory.prefetched is None for u in model._hsdp_units())
