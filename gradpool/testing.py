"""Test aids for code built on gradpool: communicators that delay or fail their collectives.

Importable by users writing their own tests (and by the overlap benchmark, which models a network
with :class:`LatencyCommunicator`)::

    from gradpool.testing import FaultInjectingCommunicator
    comm = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.05)
    late = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.05,
                                      read_input_at="wait")

Two timings of an asynchronous collective (``async_op=True``), chosen with ``read_input_at``:

* ``"launch"`` (the default): the wrapped collective runs when it is launched, so its result is
  written at once; only its handle's completion is delayed. Code that reads the output too early
  or reuses the input too early cannot change a value in this mode, only counters show it.
* ``"wait"``: like a real asynchronous collective whose kernel runs later, the wrapped collective
  runs when the handle is waited on: it reads its **input** then (so a bucket released without
  its fence and re-packed before ``wait()`` is reduced with the wrong data, or with the pool's NaN
  poison) and writes its **output** then (a reader of the output before ``wait()`` sees stale
  memory). ``is_completed()`` stays False until ``wait()`` has run, like MindSpore 2.10's
  ``CommHandle`` (``wait()`` only), so completion order, and with it the order in which the ranks
  enter the wrapped collectives, is the program's order of waits, the same on every rank. A
  handle nobody waits on never runs: a pool waits on it at its in-flight bound or in
  ``wait_all()``. Synchronous calls (``async_op=False``) run at once in both modes.
"""
from __future__ import annotations

import collections
import time
from typing import Callable, Optional, Union

from gradpool.comm import CommHandle, Communicator
from gradpool.errors import CommError, InvalidArgumentError

READ_INPUT_AT = ("launch", "wait")


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


class _DeferredHandle(CommHandle):
    """Runs the collective on the first ``wait()`` (no earlier than ``ready_at``): it reads its
    input and writes its output then. Completed once waited; then maybe fails."""

    def __init__(self, run: Callable[[], CommHandle], ready_at: float,
                 error: Optional[BaseException]):
        self._run: Optional[Callable[[], CommHandle]] = run   # holds the input until it has run
        self._ready_at = ready_at
        self._error = error
        self._done = False
        self._run_error: Optional[BaseException] = None

    def wait(self) -> None:
        if not self._done:
            remaining = self._ready_at - time.monotonic()
            if remaining > 0:
                time.sleep(remaining)
            run, self._run = self._run, None
            try:
                run().wait()
            except Exception as exc:  # noqa: BLE001 - the collective's own failure, on every wait
                self._run_error = exc
            finally:
                self._done = True
        if self._run_error is not None:
            raise self._run_error
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        return self._done


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise InvalidArgumentError(f"{name} must be a number >= 0, got {value!r}")


class _Wrapper(Communicator):
    """A communicator in front of another (``inner``): its group is the inner one's."""

    inner: Communicator

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size


class FaultInjectingCommunicator(_Wrapper):
    """Wraps a communicator for tests: a collective's handle reports not-completed until
    ``delay_seconds`` after launch (``wait()`` blocks until then), and with ``fail_wait`` (an
    exception instance, or True for a :class:`CommError`) ``wait()`` raises it, after which the
    handle counts as completed. ``read_input_at`` is when an asynchronous collective reads its
    input and writes its output: at ``"launch"`` (default) or at ``"wait"`` (see the module
    docstring). ``launches`` counts every collective launched, ``launch_counts`` per name,
    ``launch_log`` lists their names in launch order."""

    def __init__(self, inner: Communicator, delay_seconds: float = 0.0,
                 fail_wait: Union[BaseException, bool, None] = None,
                 read_input_at: str = "launch"):
        _check_seconds("delay_seconds", delay_seconds)
        if not (fail_wait is None or isinstance(fail_wait, (bool, BaseException))):
            raise InvalidArgumentError(
                f"fail_wait must be an exception instance, True or None, got {fail_wait!r}")
        if read_input_at not in READ_INPUT_AT:
            raise InvalidArgumentError(
                f"read_input_at must be one of {READ_INPUT_AT}, got {read_input_at!r}")
        self.inner = inner
        self.delay_seconds = float(delay_seconds)
        self.fail_wait = fail_wait
        self.read_input_at = read_input_at
        self.launch_counts: collections.Counter = collections.Counter()
        self.launch_log: list[str] = []     # every collective's name, in launch order

    @property
    def launches(self) -> int:
        return sum(self.launch_counts.values())

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        return self._launch("reduce_scatter", self.inner.reduce_scatter, async_op,
                            output, input, op, async_op)

    def _all_gather(self, output, input, async_op) -> CommHandle:
        return self._launch("all_gather", self.inner.all_gather, async_op, output, input, async_op)

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        return self._launch("all_reduce", self.inner.all_reduce, async_op, tensor, op, async_op)

    def _launch(self, name: str, collective: Callable[..., CommHandle], async_op: bool,
                *args) -> CommHandle:
        self.launch_counts[name] += 1      # counted before launch: a launch that raises counts
        self.launch_log.append(name)
        error = self._error_for(name)
        if self.read_input_at == "wait" and async_op:
            return _DeferredHandle(lambda: collective(*args), time.monotonic() + self.delay_seconds,
                                   error)
        inner = collective(*args)
        # the delay counts from the collective's return, however long a loaded machine took
        return _DelayedHandle(inner, time.monotonic() + self.delay_seconds, error)

    def _error_for(self, name: str) -> Optional[BaseException]:
        if self.fail_wait is True:
            return CommError(f"injected failure of {name} launch #{self.launch_counts[name]} "
                             "(FaultInjectingCommunicator(fail_wait=True))")
        return self.fail_wait if isinstance(self.fail_wait, BaseException) else None


class LatencyCommunicator(_Wrapper):
    """A network in front of a communicator: every asynchronous collective completes
    ``latency_seconds`` after it starts, and it starts when launched or when the previous one
    completed, whichever is later (one link, one collective at a time, like the collectives of a
    communication stream). Waiting costs no CPU (a sleep), so compute overlaps it as it would a
    real network. The wrapped collective runs at launch (its result is written then);
    synchronous calls (``async_op=False``) also pay the latency, before they return."""

    def __init__(self, inner: Communicator, latency_seconds: float):
        _check_seconds("latency_seconds", latency_seconds)
        self.inner = inner
        self.latency_seconds = float(latency_seconds)
        self.launches = 0
        self._link_free_at = 0.0

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        return self._send(self.inner.reduce_scatter(output, input, op, async_op), async_op)

    def _all_gather(self, output, input, async_op) -> CommHandle:
        return self._send(self.inner.all_gather(output, input, async_op), async_op)

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        return self._send(self.inner.all_reduce(tensor, op, async_op), async_op)

    def _send(self, inner: CommHandle, async_op: bool) -> CommHandle:
        self.launches += 1
        self._link_free_at = max(time.monotonic(), self._link_free_at) + self.latency_seconds
        handle = _DelayedHandle(inner, self._link_free_at, None)   # the data is already written
        if not async_op:
            handle.wait()
        return handle
