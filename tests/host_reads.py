"""Count the host reads of the device made by gradpool and hyper_parallel code (issue 43).

``with count_host_reads() as reads:`` wraps, while the block runs, every entry point through
which the host waits for the device or reads its memory: ``Tensor.asnumpy``, ``Tensor.item``,
``Tensor.tolist``, ``float(tensor)`` (``Tensor.__float__``), ``mindspore.runtime.synchronize``
and PyNative's launch-queue drain (what ``gradpool.device.synchronize`` does on CPU). Each call is
attributed to the first frame outside MindSpore and this module: counted when that frame is in
``gradpool/`` or ``hyper_parallel/`` (a read MindSpore makes inside another counted call is not
counted twice). ``reads.summary()`` sorts them:

* ``order_flag``: the unit-order check's one read per step (``read_order_flag``);
* ``cpu_only``: the sites of :data:`CPU_ONLY_SITES`, each behind a device-target test (the CPU
  host path: free under the CPU's blocking launch, never run on Ascend; docs/design.md lists
  them with why);
* ``model``: the sites of :data:`MODEL_SITES`, the training app's own model (not the library):
  its sparse MoE stand-in picks each expert's rows on the host;
* ``device_independent``: everything else, ``{"file:function": count}``: must be empty.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import threading
from pathlib import Path

import mindspore as ms

import gradpool
import hyper_parallel

# our packages where they are imported from (the file names below are relative to ROOT)
OURS = tuple(Path(package.__file__).resolve().parent for package in (gradpool, hyper_parallel))
ROOT = OURS[0].parent
_MINDSPORE = Path(ms.__file__).resolve().parent
_HERE = Path(__file__).resolve()
# gradpool's own synchronize helpers: a read is attributed to the code that called them
_HELPERS = (ROOT / "gradpool" / "device.py",)

# (file under the repository, function): host reads that run only where the device target is CPU
# (docs/design.md, "Host reads"). Each is reached through a branch on the device target.
CPU_ONLY_SITES = {
    # the host writer: a CPU pool's buckets written through host memory (writers.writer_for)
    ("gradpool/host/writer.py", "_write"),
    ("gradpool/host/writer.py", "unpack_gathered"),
    ("gradpool/host/writer.py", "pack"),
    ("gradpool/host/views.py", "host_view"),
    # the CPU communicator (CpuMcclCommunicator: MCCL has only jit AllReduce/AllGather)
    ("gradpool/comm.py", "_host_input"),
    ("gradpool/comm.py", "__init__"),        # _HostOutput
    ("gradpool/comm.py", "__exit__"),        # _HostOutput
    ("gradpool/comm.py", "_run"),
    # a one-rank group's copy through host memory (SingleProcessCommunicator, CPU tensors only),
    # or its queued copy drained (SingleProcessCommunicator._copy, off Ascend only)
    ("gradpool/comm.py", "_host_copy"),
    ("gradpool/comm.py", "_copy"),
    # the fused all-gather's copy-out drained before its bucket is recycled, where it was not
    # written on the host; on Ascend an event fences the bucket (gradpool.fence_queued_work)
    ("hyper_parallel/platform/mindspore/fully_shard/param.py", "finish"),
    # a whole CPU tensor aliased flat through its host memory (CPU tensors only)
    ("gradpool/pack.py", "flat_view"),
    # a timed pack's drain: the runtime times copies only off Ascend (runtime.build_runtime)
    ("gradpool/reducer.py", "_copy_in"),
    # main_grad += shard through host memory (the CPU's Tensor.add_ does nothing in place)
    ("gradpool/writers.py", "add_in_place"),
}


# The training app's model, not the library: gradpool/app/moe.py's sparse experts read the
# routing weights on the host to pick each expert's rows (one read per MoE layer and forward).
MODEL_SITES = {("gradpool/app/moe.py", "construct")}


class HostReads:
    def __init__(self):
        self.calls: collections.Counter = collections.Counter()

    def summary(self) -> dict:
        flag, cpu, model, other = 0, {}, {}, {}
        for (where, function, entry), count in self.calls.items():
            name = f"{where}:{function} ({entry})"
            if function == "read_order_flag":
                flag += count
            elif (where, function) in CPU_ONLY_SITES:
                cpu[name] = count
            elif (where, function) in MODEL_SITES:
                model[name] = count
            else:
                other[name] = count
        return {"order_flag": flag, "cpu_only": cpu, "model": model, "device_independent": other}


def _caller() -> tuple[str, str] | None:
    """(file under the repository, function) of the first frame outside MindSpore and this
    module, when it is our code; None otherwise."""
    frame = sys._getframe(2)            # pylint: disable=protected-access
    while frame is not None:
        path = Path(frame.f_code.co_filename).resolve()
        if path != _HERE and path not in _HELPERS and _MINDSPORE not in path.parents:
            if any(root in path.parents for root in OURS):
                return str(path.relative_to(ROOT)), frame.f_code.co_name
            return None
        frame = frame.f_back
    return None


@contextlib.contextmanager
def count_host_reads():
    """Count, while the block runs, the host reads our code makes (see the module's doc)."""
    reads = HostReads()
    state = threading.local()
    patched = []

    def wrap(owner, name, label):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if not getattr(state, "inside", False):
                where = _caller()
                if where is not None:
                    reads.calls[where + (label,)] += 1
            state.inside, outer = True, getattr(state, "inside", False)
            try:
                return original(*args, **kwargs)
            finally:
                state.inside = outer
        setattr(owner, name, counted)
        patched.append((owner, name, original))

    import gradpool.device as device
    for name in ("asnumpy", "item", "tolist", "__float__"):
        wrap(ms.Tensor, name, name)
    wrap(ms.runtime, "synchronize", "synchronize")
    drain = device._pipeline_wait()      # pylint: disable=protected-access
    holder = type("Drain", (), {"drain": staticmethod(drain)})
    wrap(holder, "drain", "drain_launch_queue")
    original_wait = device._pipeline_wait   # pylint: disable=protected-access
    device._pipeline_wait = lambda: holder.drain   # pylint: disable=protected-access
    try:
        yield reads
    finally:
        device._pipeline_wait = original_wait   # pylint: disable=protected-access
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
