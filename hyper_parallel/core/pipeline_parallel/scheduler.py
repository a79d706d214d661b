"""Pipeline schedules (not provided: the names raise when used)."""
from hyper_parallel.core.not_provided import PIPELINE_PARALLEL, refused_class

MetaStepType = refused_class("MetaStepType", PIPELINE_PARALLEL, __name__)
