"""Context parallelism (not provided: the name raises when used)."""
from hyper_parallel.core.not_provided import CONTEXT_PARALLEL, refused_class

ContextParallel = refused_class("ContextParallel", CONTEXT_PARALLEL, __name__)
