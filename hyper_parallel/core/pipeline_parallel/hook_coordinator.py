"""Hooks coordinating pipeline stages (not provided: the names raise when used)."""
from hyper_parallel.core.not_provided import PIPELINE_PARALLEL, refused_class

HookCoordinator = refused_class("HookCoordinator", PIPELINE_PARALLEL, __name__)
HookRole = refused_class("HookRole", PIPELINE_PARALLEL, __name__)
