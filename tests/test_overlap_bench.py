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
from gradpool.testing import LatencyCommunicator

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


def test_overlap_benchmark_reports_its_three_modes():
    result = overlap.run(overlap.OverlapOptions(layers=2, steps=1, latency_ms=5.0))
    assert [m.name for m in result.modes] == ["sync", "async", "async, max_buckets_in_flight=1"]
    assert result.collectives_per_step == 3            # one fused bucket per unit
    assert all(m.collectives == [3] for m in result.modes)
    assert result.latency_seconds == 0.005 and result.layer_backward_seconds > 0
    lines = overlap.report_lines(result)
    assert re.fullmatch(r"overlap: sync \d+\.\d ms, async \d+\.\d ms, latency hidden -?\d+% "
                        r"\(net of the no-network control\)", lines[-1]), lines[-1]
    assert f"hidden {result.hidden_fraction_net * 100:.0f}% (net" in lines[-1]
    # 2 layers + the root: 3 collectives, of which only the last layer's can be hidden
    assert result.ideal_fraction == pytest.approx(1 / 3)
    assert lines[-2].startswith("  ideal for 2 layers: 33% (1 of 3 collectives")
    assert len(lines) == 7
