"""Distributed checkpoints of ``fully_shard`` models: per-rank safetensors files and one index,
loadable at any world size or mesh (``save``, ``load``), and a full export for inference."""
from hyper_parallel.checkpoint.api import SaveResult, export_full, load, save

__all__ = ["save", "load", "export_full", "SaveResult"]
