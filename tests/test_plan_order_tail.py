"""`gradpool plan` lays out the buckets as the code does with the unit-order check's tag: 48
elements at the end of every row of one reduce bucket per unit (the reducer's smallest) and of
the fused all-gather's bucket, when ``check_unit_order`` is on (not in strict mode, not off).
The plan's layouts are compared with what the reducer's own ``_plan`` and the fused gather's
launch (``param._launch_bucket_gather``, its pool leases recorded) build for the same units, at
2 ranks with uneven shards (11 vocabulary rows, 3 experts, 5 expert rows)."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import mindspore as ms
import pytest
from mindspore import mint

from gradpool import BucketPool, CompletedHandle, GradReducer, ReducerConfig
from gradpool import SingleProcessCommunicator, dtype_named
from gradpool.app.config import load_config
from gradpool.app.plan import plan_memory
from gradpool.app.plan.geometry import _geometry
from hyper_parallel.platform.mindspore.fully_shard import param as param_module
from hyper_parallel.platform.mindspore.fully_shard.order import TAG_NUMEL, tag_of, REDUCE
from hyper_parallel.platform.mindspore.fully_shard.order_flag import OrderFlag, UnitTag

TINY = Path(__file__).resolve().parents[1] / "configs" / "deepseek3_tiny.yaml"
UNEVEN = ["launch.ranks=2", "model.vocab_size=11", "model.hidden_size=12", "model.num_layers=2",
          "model.num_heads=3", "model.num_experts=3", "model.experts_per_token=1",
          "model.expert_hidden=5"]
MODES = {"on": "true", "off": "false", "strict": "strict"}


def _config(check: str, fused: bool, *more):
    return load_config(TINY, UNEVEN + [f"gradpool.check_unit_order={MODES[check]}",
                                       f"fully_shard.comm_fusion={str(fused).lower()}", *more])


def _tag():
    return UnitTag(OrderFlag(), tag_of(5, REDUCE))


@pytest.mark.parametrize("alignment", ["512", "4"])
@pytest.mark.parametrize("fused", [False, True], ids=["per-gradient", "fused"])
@pytest.mark.parametrize("check", list(MODES))
def test_the_plans_reduce_buckets_are_the_reducers(check, fused, alignment):
    cfg = _config(check, fused, "fully_shard.reduce_dtype=float32",
                  "gradpool.bucket_cap_mib=0.001", f"gradpool.alignment_bytes={alignment}")
    geo = _geometry(cfg)
    reducer = GradReducer(BucketPool(device="CPU", alignment_bytes=cfg.gradpool.alignment_bytes),
                          SingleProcessCommunicator(),
                          ReducerConfig(reduce_dtype=dtype_named(geo.reduce_dtype),
                                        comm_fusion=fused,
                                        bucket_cap_mib=cfg.gradpool.bucket_cap_mib))
    tails = []
    for unit in geo.units:
        assert unit.shards == 2
        grads = [mint.zeros(spec.shape, dtype=ms.float32) for spec in unit.specs]
        # the unit's reduce is a collective: it carries the unit's tag when the check is on
        built = reducer._plan(grads, [0] * len(grads), unit.shards,      # pylint: disable=protected-access
                              _tag() if check == "on" else None)
        assert [layout for _, _, layout, _ in built] == [r.layout for r in unit.reduces], unit.name
        tails.append(sorted(r.layout.tail_numel for r in unit.reduces))
    if not fused:
        assert any(len(t) > 1 for t in tails)     # the tag picks one bucket among several
    want = TAG_NUMEL if check == "on" else 0
    assert all(t[-1] == want and sum(t) == want for t in tails)


class _Gathering:
    """A 2-rank communicator stand-in for one fused gather's launch: complete at once."""

    world_size = 2

    def all_gather(self, output, input, async_op=False):
        return CompletedHandle()


@pytest.mark.parametrize("alignment", ["512", "4"])     # at 4 bytes no padding absorbs the tag
@pytest.mark.parametrize("check", list(MODES))
def test_the_plans_fused_gather_buckets_are_the_ones_the_gather_leases(check, alignment):
    cfg = _config(check, True, f"gradpool.alignment_bytes={alignment}")
    geo = _geometry(cfg)
    comm = _Gathering()
    for unit in geo.units:
        members = [SimpleNamespace(
            comm=comm, orig_shape=spec.shape, shard_dim=0,
            local_shape=(math.ceil(spec.shape[0] / unit.shards),) + tuple(spec.shape[1:]))
            for spec in unit.specs]
        pool = BucketPool(device="CPU", alignment_bytes=cfg.gradpool.alignment_bytes)
        leased = []
        acquire = pool.acquire
        pool.acquire = lambda numel, dtype, **kw: leased.append(numel) or acquire(numel, dtype,
                                                                                  **kw)
        locals_ = [mint.zeros(m.local_shape, dtype=ms.float32) for m in members]
        _, abandon = param_module._launch_bucket_gather(      # pylint: disable=protected-access
            members, locals_, ms.float32, pool, True, _tag() if check == "on" else None)
        abandon()
        assert tuple(leased) == unit.gather, unit.name


def test_the_tag_is_in_the_planned_figures_only_with_the_check_on():
    """At an alignment of one element nothing absorbs the tag: every unit collective's rows
    grow by 48 elements per rank, in the communication table and in the pool."""
    plans = {check: plan_memory(_config(check, True, "gradpool.alignment_bytes=4",
                                        "fully_shard.reduce_dtype=float32"))
             for check in MODES}
    units = len(_geometry(_config("on", True)).units)
    ranks = 2

    def full_bytes(plan, collective):
        return sum(r.full_bytes for r in plan.comm.rows if r.collective == collective)

    gathers_on = [r.collectives for r in plans["on"].comm.rows if r.collective == "all-gather"]
    assert full_bytes(plans["on"], "reduce-scatter") - full_bytes(plans["off"], "reduce-scatter") \
        == units * ranks * TAG_NUMEL * 4
    assert full_bytes(plans["on"], "all-gather") - full_bytes(plans["off"], "all-gather") \
        == sum(gathers_on) * ranks * TAG_NUMEL * 4
    assert plans["on"].pool.high_water_bytes > plans["off"].pool.high_water_bytes
    assert plans["on"].copy.bytes_copied_per_step > plans["off"].copy.bytes_copied_per_step
    assert plans["strict"].to_dict()["pool"] == plans["off"].to_dict()["pool"]
    assert plans["strict"].to_dict()["comm"]["rows"] == plans["off"].to_dict()["comm"]["rows"]
