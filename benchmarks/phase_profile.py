"""Where a fused reduce step's time goes, per rank: pack, collective, average, result write.

The fused step of the pool and of zero-copy make the same calls (a fused bucket is never
borrowed) and differ in alignment only, so a gap between their step times is either the extra
bytes the pool's 512-byte alignment packs or where the peer happens to be when a rank reaches
the collective. This profile tells the two apart: both methods' steps interleaved, the ranks
lined up by an untimed all-reduce before every step, and each phase of a step timed on the
clock of the rank it runs on.

The phases are the reducer's and the communicator's own calls, timed by wrapping them on the
instances for the profile's duration (the instances are restored after):

* ``pack``: ``GradReducer._pack_one`` (a lease and the copy into it, or a borrow);
* ``reduce-scatter``: the communicator's ``_reduce_scatter``, all of the collective's work;
* within it, where the communicator has them (the CPU one): ``collective`` (``_run``: the jitted
  all-reduce, the wait for the peer included), ``average`` (``_average``) and ``result write``
  (``_finish``).

``step`` is the whole step as the reduce benchmark times it (results waited for and released).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Optional

from benchmarks.cases import REDUCE_METHODS, ReduceCase, make_reduce_step
from benchmarks.timing import Timing

PHASES = ("step", "pack", "reduce-scatter", "collective", "average", "result write")
_COMM_PHASES = (("_reduce_scatter", "reduce-scatter"), ("_run", "collective"),
                ("_average", "average"), ("_finish", "result write"))


class _PhaseClock:
    """Per-step sums of each phase's time for the method whose step is running (None: the
    lining-up all-reduce, which is not timed)."""

    def __init__(self):
        self.method: Optional[str] = None
        self.current: dict = {}
        self.samples: dict = {}

    def add(self, phase: str, seconds: float) -> None:
        if self.method is not None:
            self.current[phase] = self.current.get(phase, 0.0) + seconds

    def step(self, method: str, run: Callable[[], None]) -> None:
        self.method, self.current = method, {}
        start = time.perf_counter()
        try:
            run()
        finally:
            self.current["step"] = time.perf_counter() - start
            self.method = None
        per_method = self.samples.setdefault(method, {})
        for phase in PHASES:
            per_method.setdefault(phase, []).append(self.current.get(phase, 0.0))


@contextlib.contextmanager
def _timing(clock: _PhaseClock, obj, name: str, phase: str):
    """``obj.name`` timed into ``phase`` while the block runs, as an instance attribute over
    the method (nothing happens where ``obj`` has no such method)."""
    inner = getattr(obj, name, None)
    if inner is None:
        yield
        return

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            clock.add(phase, time.perf_counter() - start)
    had_own = name in vars(obj)
    setattr(obj, name, timed)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, inner)
        else:
            delattr(obj, name)


def profile_fused_step(comm, steps: int, warmup: int = 3) -> dict:
    """Each phase of ``steps`` fused reduce steps of the tiny model's gradients per method
    (:data:`benchmarks.cases.REDUCE_METHODS`), on this rank: ``{"world_size", "rank", "steps",
    "phases": {method: {phase: Timing dict}}}``. Every rank of ``comm`` must call it."""
    import mindspore as ms
    import numpy as np

    runs = {method: make_reduce_step(ReduceCase(method, True, comm.world_size), comm)
            for method in REDUCE_METHODS}
    for run in runs.values():
        run()                                   # step 1: the pool reserves its buckets
    clock = _PhaseClock()
    line_up = ms.Tensor(np.zeros(1, np.float32))
    with contextlib.ExitStack() as stack:
        for name, phase in _COMM_PHASES:
            stack.enter_context(_timing(clock, comm, name, phase))
        for run in runs.values():
            stack.enter_context(_timing(clock, run.reducer, "_pack_one", "pack"))
        for index in range(warmup + steps):
            for method, run in runs.items():
                comm.all_reduce(line_up).wait()   # untimed: both ranks start the step together
                clock.step(method, run)
            if index + 1 == warmup:
                clock.samples.clear()
    for run in runs.values():
        run.check()                             # the profiled steps reduced correctly
    # A phase this communicator does not have was never timed: left out, not reported as 0.
    return {"world_size": comm.world_size, "rank": comm.rank, "steps": steps,
            "communicator": type(comm).__name__,
            "phases": {method: {phase: Timing.of(values, warmup).to_dict()
                                for phase, values in phases.items() if any(values)}
                       for method, phases in clock.samples.items()}}
