"""Communication/compute overlap across pipeline stages (not provided: raises when used)."""
from hyper_parallel.core.not_provided import PIPELINE_PARALLEL, refused_class

CommComputeOverlap = refused_class("CommComputeOverlap", PIPELINE_PARALLEL, __name__)
