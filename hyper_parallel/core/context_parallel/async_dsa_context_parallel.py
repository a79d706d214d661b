"""Asynchronous context parallelism of DeepSeek sparse attention (not provided: the names raise
when used)."""
from hyper_parallel.core.not_provided import CONTEXT_PARALLEL, refused_class

AsyncDSAIndexerContextParallel = refused_class("AsyncDSAIndexerContextParallel", CONTEXT_PARALLEL,
                                               __name__)
AsyncDSAIndexerLossContextParallel = refused_class("AsyncDSAIndexerLossContextParallel",
                                                   CONTEXT_PARALLEL, __name__)
AsyncDSASparseAttentionContextParallel = refused_class("AsyncDSASparseAttentionContextParallel",
                                                       CONTEXT_PARALLEL, __name__)
