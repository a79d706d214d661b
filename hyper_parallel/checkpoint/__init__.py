"""Distributed checkpoints of ``fully_shard`` models: per-rank safetensors files and one index,
loadable at any world size or mesh (``save``, ``load``), saved in the caller's time or in the
background (``save(..., async_save=True)``, committed at ``wait`` or, once every rank's write
has finished, at ``commit_ready``), the newest committed one of a directory of step checkpoints
(``latest``), and a full export for inference."""
from hyper_parallel.checkpoint.api import export_full, load
from hyper_parallel.checkpoint.saving import (AsyncSave, SaveResult, commit_ready, pending, save,
                                              wait)
from hyper_parallel.checkpoint.steps import latest, step_dir

__all__ = ["save", "load", "wait", "commit_ready", "pending", "latest", "step_dir", "export_full",
           "SaveResult", "AsyncSave"]
