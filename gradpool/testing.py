"""Test aids for code built on gradpool: communicators that delay or fail their collectives.

Importable by users writing their own tests::

    from gradpool.testing import FaultInjectingCommunicator
    comm = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.05)
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional, Union

from gradpool.comm import CommHandle, Communicator
from gradpool.errors import CommError, InvalidArgumentError


class _DelayedHandle(CommHandle):
    """Completes ``delay`` seconds after launch (the data is already written), then maybe fails."""

    def __init__(self, inner: CommHandle, ready_at: float, error: Optional[BaseException]):
        self._inner = inner
        self._ready_at = ready_at
        self._error = error
        self._waited = False

    def wait(self) -> None:
        remaining = self._ready_at - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        try:
            self._inner.wait()
        finally:
            self._waited = True
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._waited or (time.monotonic() >= self._ready_at and self._inner.is_completed())


class FaultInjectingCommunicator(Communicator):
    """Wraps a communicator for tests: the collective's result is written as usual, but its handle
    reports not-completed until ``delay_seconds`` after launch (``wait()`` blocks until then), and
    with ``fail_wait`` (an exception instance, or True for a :class:`CommError`) ``wait()`` raises
    it, after which the handle counts as completed. ``launches`` counts every collective launched,
    ``launch_counts`` per collective name."""

    def __init__(self, inner: Communicator, delay_seconds: float = 0.0,
                 fail_wait: Union[BaseException, bool, None] = None):
        if not isinstance(delay_seconds, (int, float)) or delay_seconds < 0:
            raise InvalidArgumentError(
                f"delay_seconds must be a number >= 0, got {delay_seconds!r}")
        if not (fail_wait is None or isinstance(fail_wait, (bool, BaseException))):
            raise InvalidArgumentError(
                f"fail_wait must be an exception instance, True or None, got {fail_wait!r}")
        self.inner = inner
        self.delay_seconds = float(delay_seconds)
        self.fail_wait = fail_wait
        self.launch_counts: collections.Counter = collections.Counter()

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def launches(self) -> int:
        return sum(self.launch_counts.values())

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        return self._launch("reduce_scatter", self.inner.reduce_scatter, output, input, op,
                            async_op)

    def _all_gather(self, output, input, async_op) -> CommHandle:
        return self._launch("all_gather", self.inner.all_gather, output, input, async_op)

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        return self._launch("all_reduce", self.inner.all_reduce, tensor, op, async_op)

    def _launch(self, name: str, collective: Callable[..., CommHandle], *args) -> CommHandle:
        self.launch_counts[name] += 1      # counted before launch: a launch that raises counts
        inner = collective(*args)
        return _DelayedHandle(inner, time.monotonic() + self.delay_seconds,
                              self._error_for(name))

    def _error_for(self, name: str) -> Optional[BaseException]:
        if self.fail_wait is True:
            return CommError(f"injected failure of {name} launch #{self.launch_counts[name]} "
                             "(FaultInjectingCommunicator(fail_wait=True))")
        return self.fail_wait if isinstance(self.fail_wait, BaseException) else None
