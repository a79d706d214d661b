"""Test aids for code built on gradpool (users' tests, and the overlap benchmark, which models a
network with :class:`LatencyCommunicator`): communicators that delay or fail their collectives::

    from gradpool.testing import FaultInjectingCommunicator
    comm = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.05,
                                      read_input_at="wait")

``read_input_at`` is when an asynchronous collective (``async_op=True``) runs; synchronous calls
run at once. ``"launch"`` (the default): at launch, its result written at once and only its
handle's completion delayed; output read or input reused too early changes no value here, only
counters show it. ``"wait"``: when the handle is waited on, like a real collective whose kernel
runs later. It reads its **input** then (a bucket released without its fence and re-packed
before ``wait()`` is reduced with the wrong data, or the pool's NaN poison) and writes its
**output** then (an earlier reader sees stale memory). ``is_completed()`` stays False until
``wait()``, like MindSpore 2.10's ``CommHandle``, so the ranks enter the wrapped collectives in
the program's order of waits, the same on every rank. A handle nobody waits on never runs (a
pool waits on it at its in-flight bound or in ``wait_all()``).
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

    def __init__(self, inner: CommHandle, ready_at: float, error: Optional[BaseException],
                 network: Optional["LatencyNetwork"] = None):
        self._inner = inner
        self._ready_at = ready_at
        self._error = error
        self._waited = False
        self._network = network

    def wait(self) -> None:
        remaining = self._ready_at - time.monotonic()
        if remaining > 0:
            if self._network is not None:
                self._network.blocked_seconds += remaining
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


class _BrokenHandle(CommHandle):
    """A handle whose ``is_completed()`` raises ``error`` (its communicator broke); ``wait()``
    runs the collective, then raises it too."""

    def __init__(self, inner: CommHandle, error: BaseException):
        self._inner = inner
        self._error = error

    def wait(self) -> None:
        self._inner.wait()
        raise self._error

    def is_completed(self) -> bool:
        raise self._error


class FaultInjectingCommunicator(_Wrapper):
    """A handle completes ``delay_seconds`` after launch (``wait()`` blocks until then); with
    ``fail_wait`` (an exception, or True: a :class:`CommError`) ``wait()`` raises it, the handle
    completed all the same. With ``fail_is_completed`` (the same kinds) the handle is broken:
    ``is_completed()`` raises it from launch on, and ``wait()`` after running the collective.
    ``read_input_at``: see the module docstring. ``launches`` counts the collectives launched,
    ``launch_counts`` per name."""

    def __init__(self, inner: Communicator, delay_seconds: float = 0.0,
                 fail_wait: Union[BaseException, bool, None] = None,
                 read_input_at: str = "launch",
                 fail_is_completed: Union[BaseException, bool, None] = None):
        _check_seconds("delay_seconds", delay_seconds)
        for name, value in (("fail_wait", fail_wait), ("fail_is_completed", fail_is_completed)):
            if not (value is None or isinstance(value, (bool, BaseException))):
                raise InvalidArgumentError(
                    f"{name} must be an exception instance, True or None, got {value!r}")
        if read_input_at not in READ_INPUT_AT:
            raise InvalidArgumentError(
                f"read_input_at must be one of {READ_INPUT_AT}, got {read_input_at!r}")
        self.inner = inner
        self.delay_seconds = float(delay_seconds)
        self.fail_wait = fail_wait
        self.fail_is_completed = fail_is_completed
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
            handle = _DeferredHandle(lambda: collective(*args),
                                     time.monotonic() + self.delay_seconds, error)
        else:
            inner = collective(*args)
            # the delay counts from the collective's return, however long a loaded machine took
            handle = _DelayedHandle(inner, time.monotonic() + self.delay_seconds, error)
        broken = self._injected(self.fail_is_completed, name, "fail_is_completed")
        return handle if broken is None else _BrokenHandle(handle, broken)

    def _error_for(self, name: str) -> Optional[BaseException]:
        return self._injected(self.fail_wait, name, "fail_wait")

    def _injected(self, setting, name: str, option: str) -> Optional[BaseException]:
        if setting is True:
            return CommError(f"injected failure of {name} launch #{self.launch_counts[name]} "
                             f"(FaultInjectingCommunicator({option}=True))")
        return setting if isinstance(setting, BaseException) else None


class LatencyCommunicator(_Wrapper):
    """A network in front of a communicator: a collective completes ``latency_seconds`` after it
    starts, at launch or when the previous one completed, whichever is later (one link, like a
    communication stream). Waiting is a sleep, so compute overlaps it. The wrapped collective
    runs at launch; synchronous calls pay the latency before they return.

    With ``network`` (a :class:`LatencyNetwork`), the latency, the collectives that carry it and
    the link (one per group) are the network's; see there."""

    def __init__(self, inner: Communicator, latency_seconds: float = 0.0,
                 network: Optional["LatencyNetwork"] = None, link: str = "world"):
        _check_seconds("latency_seconds", latency_seconds)
        self.inner = inner
        self.latency_seconds = float(latency_seconds)
        self.network = network
        self.link = link
        self.launches = 0
        self._link_free_at = 0.0

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        return self._send("reduce-scatter", self.inner.reduce_scatter(output, input, op, async_op),
                          async_op)

    def _all_gather(self, output, input, async_op) -> CommHandle:
        return self._send("all-gather", self.inner.all_gather(output, input, async_op), async_op)

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        return self._send("all-reduce", self.inner.all_reduce(tensor, op, async_op), async_op)

    def _send(self, kind: str, inner: CommHandle, async_op: bool) -> CommHandle:
        self.launches += 1
        if self.network is not None:
            ready = self.network.ready_at(kind, self.link, async_op)
        else:
            ready = self._link_free_at = max(time.monotonic(), self._link_free_at) \
                + self.latency_seconds
        handle = _DelayedHandle(inner, ready, None, self.network)   # the data is written
        if not async_op:
            handle.wait()
        return handle


class LatencyNetwork:
    """The network of one process's communicators (the overlap benchmark at any world size):
    ``install_runtime(config, wrap=network.wrap)`` puts every group's communicator behind it.

    * The collectives of kinds ``delayed`` (e.g. ``("reduce-scatter",)``) complete
      ``latency_seconds`` after they start, one at a time per group (a link per group, like a
      communication stream each); ``injected_seconds`` sums what they were given.
    * Any other collective takes no time of its own and queues on no link.
    * A synchronous collective (``async_op=False``, whose result the host reads at once) also
      waits until every link is idle: on a device the host's read blocks until the device has
      drained everything queued before it.

    ``latency_seconds`` may change between steps (0: a network that costs nothing).
    ``blocked_seconds`` sums the time the host slept in ``wait()`` for this network: as the
    network takes no CPU, what its latency added to the wall-clock time."""

    def __init__(self, latency_seconds: float = 0.0, delayed=("reduce-scatter",)):
        _check_seconds("latency_seconds", latency_seconds)
        unknown = set(delayed) - {"reduce-scatter", "all-gather", "all-reduce"}
        if unknown:
            raise InvalidArgumentError(f"delayed names unknown collectives {sorted(unknown)}; "
                                       "use reduce-scatter, all-gather, all-reduce")
        self.latency_seconds = float(latency_seconds)
        self.delayed = frozenset(delayed)
        self.injected_seconds = 0.0
        self.blocked_seconds = 0.0
        self._links: dict = {}

    def wrap(self, comm: Communicator, group: str) -> LatencyCommunicator:
        return LatencyCommunicator(comm, network=self, link=group)

    def ready_at(self, kind: str, link: str, async_op: bool) -> float:
        """When a collective of ``kind`` on ``link`` launched now completes (and books it)."""
        ready = now = time.monotonic()
        if kind in self.delayed and self.latency_seconds > 0:
            ready = self._links[link] = max(now, self._links.get(link, 0.0)) \
                + self.latency_seconds
            self.injected_seconds += self.latency_seconds
        if not async_op:
            ready = max([ready, *self._links.values()])
        return ready


class CollectiveLog:
    """What every communicator put behind :meth:`wrap` launched, in launch order: one
    :class:`RecordingCommunicator` per group, one log for all (``gradpool.install_runtime(config,
    wrap=log.wrap)`` records every collective of ``fully_shard`` and its groups)::

        log = CollectiveLog()
        install_runtime(config, wrap=log.wrap)
        mark = log.mark()
        ...                                    # one step
        log.counts(since=mark)                 # {("all-gather", "world"): 4, ...}
    """

    def __init__(self):
        self.records: list = []        # (collective, group, group size, elements)

    def wrap(self, comm: Communicator, group: str) -> "RecordingCommunicator":
        return RecordingCommunicator(comm, group, self)

    def mark(self) -> int:
        return len(self.records)

    def counts(self, since: int = 0) -> dict:
        """``{(collective, group): launches}`` of the records after ``since``."""
        return dict(collections.Counter((kind, group) for kind, group, _, _ in
                                        self.records[since:]))


class RecordingCommunicator(_Wrapper):
    """Runs each collective on ``inner`` as called, after writing one record of it to ``log``:
    ``("all-gather" | "reduce-scatter" | "all-reduce", group, group size, input elements)``."""

    def __init__(self, inner: Communicator, group: str, log: CollectiveLog):
        self.inner = inner
        self.group = group
        self.log = log

    def _record(self, kind: str, tensor) -> None:
        self.log.records.append((kind, self.group, self.inner.world_size, int(tensor.numel())))

    def _reduce_scatter(self, output, input, op, async_op) -> CommHandle:
        self._record("reduce-scatter", input)
        return self.inner.reduce_scatter(output, input, op, async_op)

    def _all_gather(self, output, input, async_op) -> CommHandle:
        self._record("all-gather", input)
        return self.inner.all_gather(output, input, async_op)

    def _all_reduce(self, tensor, op, async_op) -> CommHandle:
        self._record("all-reduce", tensor)
        return self.inner.all_reduce(tensor, op, async_op)
