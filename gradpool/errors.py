"""Typed errors raised at gradpool's public boundary; each names the wrong value and, where there
is one, what to do instead."""


class GradPoolError(Exception):
    """Base class of every error gradpool raises on purpose."""


class InvalidArgumentError(GradPoolError, ValueError):
    """An argument has a value the API cannot accept (a size, a world size, an op name)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a string where a bool or a size belongs, a float where an
    int does); caught as ``TypeError`` and as :class:`InvalidArgumentError` alike."""


class UnsupportedDtypeError(GradPoolError, TypeError):
    """A dtype the pool does not manage (only floating gradient dtypes are supported)."""


class LayoutMismatchError(GradPoolError, ValueError):
    """Gradients handed to a pack or accumulate do not match the layout they are packed by."""


class InvalidFenceError(GradPoolError, TypeError):
    """What was passed as a fence has no ``wait()``: the pool cannot know when it is done."""


class LeaseStateError(GradPoolError, RuntimeError):
    """A lease was used after release, or released twice."""


class ForeignLeaseError(GradPoolError, ValueError):
    """A lease was handed to a pool that did not issue it."""


class PoolCapacityError(GradPoolError, MemoryError):
    """An acquire would take the pool past its ``max_cached_bytes`` cap."""


class CommError(GradPoolError, RuntimeError):
    """A collective failed, or was called with buffers of the wrong size or dtype."""


class CollectiveError(CommError):
    """An asynchronous collective failed: its handle's ``wait()`` or ``is_completed()`` raised.
    The message names the collective (kind, dtype, sizes, group); ``collective`` holds that name
    and ``__cause__`` the handle's own error. The pool quarantines the buckets it read or wrote:
    see ``PoolStats.quarantined_buckets``."""

    def __init__(self, collective: str, cause: BaseException):
        super().__init__(f"{collective} failed: {type(cause).__name__}: {cause} (its pool "
                         "buckets are quarantined)")
        self.collective = collective


class GradientIntegrityError(GradPoolError, RuntimeError):
    """A gradient handed to the reduce path was changed or freed before the path was done."""


class NonFiniteNormError(GradPoolError, RuntimeError):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` found a NaN or infinite gradient norm."""


class CheckpointError(GradPoolError, RuntimeError):
    """A checkpoint on disk cannot be read or written: missing, truncated or corrupted (the
    message names the file), or a save that failed on some rank."""


class UnsupportedPatternError(GradPoolError, RuntimeError):
    """Training code uses a unit in a way ``fully_shard`` cannot keep exact (the message names the
    cell and what to use instead)."""


class InPlaceOpError(GradPoolError, RuntimeError):
    """An in-place op this device was expected to run left its target unchanged (the message
    names the op and the option that avoids it)."""


class StateMismatchError(GradPoolError, ValueError):
    """A state dict or checkpoint does not fit the model or optimizer it is loaded into: a key
    missing or unexpected, another shape or dtype (the message names the first bad key)."""


class FeatureNotProvidedError(GradPoolError, NotImplementedError):
    """A name of upstream hyper_parallel's surface whose feature gradpool does not provide (tensor,
    context or pipeline parallelism, activation swap, NPU custom ops, DTensor checkpoint
    layouts): it imports, and raises this when used. gradpool provides FSDP/HSDP/EP only."""


class MetaDeviceError(GradPoolError, RuntimeError):
    """A parameter built on the meta device (``ms.DeviceCtx("meta")``) has no memory where memory
    is needed: still on meta at a forward, or initialised before ``to_empty()`` (the message
    names the parameters and the call to make)."""


class MeshGroupError(GradPoolError, RuntimeError):
    """A device-mesh dim has no communication group: it was made with ``backend_override``
    ``"fake"`` (the message names the dim and how to make a real one)."""


class BackwardNotRecordedError(GradPoolError, RuntimeError):
    """Torch-style ``backward()`` of a tensor no recorded forward made (the message says why: the
    grad flag off, ``no_grad``, or nothing requiring grad)."""


# -- argument checks (no silent coercion: True is not 1, "no" is not False, nan is not a size) --
def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool (True or False), got "
                                f"{type(value).__name__} {value!r}")


def check_int(name: str, value, minimum: int, maximum=None, nullable: bool = False) -> None:
    """``value`` an int (not a bool, not a float) in ``[minimum, maximum]``, or None if nullable."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(f"{name} must be an int{' or None' if nullable else ''}, got "
                                f"{type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}{upper}, got {value!r}")


def check_positive_number(name: str, value, nullable: bool = False) -> None:
    """``value`` a finite int or float > 0 (not a bool), or None if nullable."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ArgumentTypeError(f"{name} must be a number{' or None' if nullable else ''}, got "
                                f"{type(value).__name__} {value!r}")
    if value != value or value in (float("inf"), float("-inf")) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a finite number > 0, got {value!r}")
