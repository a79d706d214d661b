"""Asynchronous context parallelism (not provided: the name raises when used)."""
from hyper_parallel.core.not_provided import CONTEXT_PARALLEL, refused_class

AsyncContextParallel = refused_class("AsyncContextParallel", CONTEXT_PARALLEL, __name__)
