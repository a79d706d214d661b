"""The overlap benchmark's network model and a smoke run of the benchmark (no timing asserted:
the run checks that every mode trained the same parameters; this checks what it reports)."""
import re
import time

import mindspore as ms
import numpy as np
import pytest

from benchmarks import overlap
from gradpool.comm import SingleProcessCommunicator
from gradpool.errors import InvalidArgumentError
from gradpool.testing import LatencyCommunicator, LatencyNetwork

ms.set_device("CPU")


def test_latency_communicator_runs_one_collective_at_a_time():
    comm = LatencyCommunicator(SingleProcessCommunicator(), latency_seconds=10.0)
    a, b = ms.Tensor(np.arange(4, dtype=np.float32)), ms.Tensor(np.zeros(4, np.float32))
    first = comm.all_reduce(a, op="sum", async_op=True)
    second = comm.reduce_scatter(b, a, op="sum", async_op=True)
    # the second starts when the first completes: one link
    assert second._ready_at - first._ready_at == pytest.approx(10.0)
    assert not first.is_completed() and not second.is_completed()
    np.testing.assert_array_equal(b.asnumpy(), np.arange(4))      # data written at launch
    assert comm.launches == 2
    quick = LatencyCommunicator(SingleProcessCommunicator(), latency_seconds=0.05)
    start = time.monotonic()
    quick.all_reduce(a, op="sum", async_op=False)                  # synchronous: pays it
    assert time.monotonic() - start >= 0.05
    with pytest.raises(InvalidArgumentError, match="latency_seconds"):
        LatencyCommunicator(SingleProcessCommunicator(), latency_seconds=-1)


def test_latency_network_delays_the_chosen_collectives_one_at_a_time_per_group():
    network = LatencyNetwork(10.0, delayed=("reduce-scatter",))
    shard = network.wrap(SingleProcessCommunicator(), "shard")
    other = network.wrap(SingleProcessCommunicator(), "replicate")
    a, b = ms.Tensor(np.arange(4, dtype=np.float32)), ms.Tensor(np.zeros(4, np.float32))
    first = shard.reduce_scatter(b, a, op="sum", async_op=True)
    second = shard.reduce_scatter(b, a, op="sum", async_op=True)
    elsewhere = other.reduce_scatter(b, a, op="sum", async_op=True)
    assert second._ready_at - first._ready_at == pytest.approx(10.0)        # one link a group
    assert elsewhere._ready_at == pytest.approx(first._ready_at, abs=0.5)   # its own link
    gather = shard.all_gather(b, a, async_op=True)       # not delayed, queues on no link
    assert gather.is_completed()
    assert network.injected_seconds == 30.0
    network.latency_seconds = 0.05
    quick = network.wrap(SingleProcessCommunicator(), "quick")
    quick.reduce_scatter(b, a, op="sum", async_op=True)
    network._links.update(shard=0.0, replicate=0.0)      # the 10 s links: as if idle
    start = time.monotonic()
    quick.all_gather(b, a, async_op=False)     # synchronous: waits for every link to drain
    assert time.monotonic() - start >= 0.04
    assert 0.04 <= network.blocked_seconds <= time.monotonic() - start     # and counts the wait
    with pytest.raises(InvalidArgumentError, match="delayed"):
        LatencyNetwork(1.0, delayed=("broadcast",))


def test_overlap_benchmark_reports_exposed_latency_of_the_asynchronous_step():
    result = overlap.run(overlap.OverlapOptions(layers=2, steps=1, latency_ms=5.0))
    assert [v.name for v in result.variants] == [overlap.ORDER_ON, overlap.ORDER_OFF,
                                                 overlap.SYNC]
    assert result.delayed_per_step == 3            # one fused reduce per unit
    for name in overlap.TIMED_WITH_LATENCY:
        v = result.variant(name)
        assert len(v.with_latency) == len(v.no_network) == 1
        assert v.injected == [pytest.approx(3 * 0.005)]
        assert v.hidden_fraction == pytest.approx(
            1 - (v.with_latency[0] - v.no_network[0]) / 0.015)
        assert 0 <= v.blocked[0] <= v.with_latency[0]
        assert v.blocked_hidden_fraction == pytest.approx(1 - v.blocked[0] / 0.015)
    assert result.latency_seconds == 0.005 and result.layer_backward_seconds > 0
    # 2 layers + the root: 3 reduces, of which only the last layer's can be hidden
    assert result.ideal_fraction == pytest.approx(1 / 3)
    lines = overlap.report_lines(result)
    assert lines[-2].startswith("  ideal for 2 layers: 33% (1 of 3 reduces")
    assert lines[-1].startswith("overlap: latency hidden ")
    assert "synchronous path, no network" in lines[-3]


def test_a_figure_above_the_ideal_is_reported_as_noise():
    opts = overlap.OverlapOptions(layers=8)
    fine = overlap.VariantResult(overlap.ORDER_ON, [1.30, 1.32], [1.00, 1.00], [0.9, 0.9],
                                 [0.3, 0.31])
    noisy = overlap.VariantResult(overlap.ORDER_OFF, [0.95, 1.0], [1.00, 1.00], [0.9, 0.9],
                                  [0.25, 0.25])
    sync = overlap.VariantResult(overlap.SYNC, [], [1.0, 1.0], [])
    result = overlap.OverlapResult(opts, 2, 0.1, 0.1, 9, [fine, noisy, sync])
    assert fine.hidden_fraction == pytest.approx(1 - 0.31 / 0.9)
    assert noisy.hidden_fraction > result.ideal_fraction
    lines = overlap.report_lines(result)
    assert lines[-1] == ("overlap: latency hidden 66% with the order check on (the default), "
                         "103%, above the ideal 78% (noise, not a result) with it off (host "
                         "waits: 66%, 72%); ideal 78%")
    summary = overlap.summary_lines([result, result, result])
    assert "noise, not a result" in summary[3] and "spread 0 points" in summary[1]
    assert fine.blocked_hidden_fraction == pytest.approx(1 - 0.305 / 0.9)
