"""Pipeline parallelism (not provided: the names raise when used)."""
from hyper_parallel.core.not_provided import PIPELINE_PARALLEL, refused_class

PipelineStage = refused_class("PipelineStage", PIPELINE_PARALLEL, __name__)
# mindformers looks the schedules up by name (importlib + getattr).
Schedule1F1B = refused_class("Schedule1F1B", PIPELINE_PARALLEL, __name__)
ScheduleInterleaved1F1B = refused_class("ScheduleInterleaved1F1B", PIPELINE_PARALLEL, __name__)
ScheduleGPipe = refused_class("ScheduleGPipe", PIPELINE_PARALLEL, __name__)
