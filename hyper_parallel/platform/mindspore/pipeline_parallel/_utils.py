"""Micro-batches of pipeline schedules (not provided: the name raises when used)."""
from hyper_parallel.core.not_provided import PIPELINE_PARALLEL, refused_class

_MicroBatch = refused_class("_MicroBatch", PIPELINE_PARALLEL, __name__)
