"""A plain timing loop: warm up, then the median of N timed calls (``time.perf_counter``).

The callables time one complete iteration (they synchronize the device themselves), so no
statistics beyond median/min/max are needed; the median resists the noise of a shared machine.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    max_s: float
    repeats: int
    warmup: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Budget:
    """How long to time a case: ``warmup`` calls, then enough calls to fill ``seconds`` (judged
    from the last warm-up call), at least ``min_repeats`` and at most ``max_repeats``."""

    warmup: int = 2
    seconds: float = 1.0
    min_repeats: int = 5
    max_repeats: int = 100

    def repeats_for(self, call_seconds: float) -> int:
        if call_seconds <= 0:
            return self.max_repeats
        wanted = math.ceil(self.seconds / call_seconds)
        return max(self.min_repeats, min(self.max_repeats, wanted))


def measure(fn: Callable[[], object], warmup: int, repeats: int) -> Timing:
    """``warmup`` untimed calls, then ``repeats`` timed ones. Deterministic in its call count:
    use it where ranks must make the same calls (collectives)."""
    for _ in range(warmup):
        fn()
    return _timed(fn, repeats, warmup)


def measure_budget(fn: Callable[[], object], budget: Budget) -> Timing:
    """Like :func:`measure`, with the repeat count fitted to the budget (one process only: the
    count depends on this process's speed)."""
    last = 0.0
    for _ in range(max(1, budget.warmup)):
        start = time.perf_counter()
        fn()
        last = time.perf_counter() - start
    return _timed(fn, budget.repeats_for(last), max(1, budget.warmup))


def _timed(fn: Callable[[], object], repeats: int, warmup: int) -> Timing:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples),
                  repeats=repeats, warmup=warmup)
