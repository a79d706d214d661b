"""A plain timing loop: warm up, then N timed calls (``time.perf_counter``), summarized with
pytest-benchmark's own statistics (``pytest_benchmark.stats.Stats``: median, IQR, stddev, ...).

The callables time one complete iteration (they wait for the device themselves). Every case
records its spread, not only a median: on a shared machine one slow call in twenty is normal, and
a reader needs to see how far apart the rounds were to judge a ratio.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

# What each result row records (seconds unless named otherwise).
FIELDS = ("median", "mean", "stddev", "iqr", "q1", "q3", "min", "max")


@dataclass(frozen=True)
class Timing:
    median_s: float
    mean_s: float
    stddev_s: float
    iqr_s: float
    q1_s: float
    q3_s: float
    min_s: float
    max_s: float
    rounds: int
    warmup: int

    @property
    def repeats(self) -> int:
        return self.rounds

    def to_dict(self) -> dict:
        # ``repeats`` is the name the schema-1 files used for ``rounds``.
        return {**asdict(self), "repeats": self.rounds}

    @classmethod
    def of(cls, samples: list, warmup: int) -> "Timing":
        from pytest_benchmark.stats import Stats
        stats = Stats()
        for sample in samples:
            stats.update(sample)
        return cls(**{f"{name}_s": float(getattr(stats, name)) for name in FIELDS},
                   rounds=stats.rounds, warmup=warmup)


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


def measure_interleaved(fns: dict, budget: Budget) -> dict:
    """Time several callables in rounds, one call of each per round (in the same order), so each
    sees the same machine load: ``{name: Timing}``. The round count is fitted to the budget as
    :func:`measure_budget` fits it, from the last warm-up round divided among the callables."""
    last = 0.0
    for _ in range(max(1, budget.warmup)):
        start = time.perf_counter()
        for fn in fns.values():
            fn()
        last = time.perf_counter() - start
    rounds = budget.repeats_for(last / max(1, len(fns)))
    return _rounds(fns, rounds, max(1, budget.warmup))


def measure_interleaved_fixed(fns: dict, warmup: int, rounds: int) -> dict:
    """Like :func:`measure_interleaved` with fixed warm-up and round counts: where ranks must
    make the same calls (collectives)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    return _rounds(fns, rounds, warmup)


def _rounds(fns: dict, rounds: int, warmup: int) -> dict:
    samples: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: Timing.of(values, warmup) for name, values in samples.items()}


def _timed(fn: Callable[[], object], repeats: int, warmup: int) -> Timing:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return Timing.of(samples, warmup)
