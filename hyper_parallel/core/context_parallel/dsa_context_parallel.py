"""Context parallelism of DeepSeek sparse attention (not provided: the names raise when used)."""
from hyper_parallel.core.not_provided import CONTEXT_PARALLEL, refused_class

DSAIndexerContextParallel = refused_class("DSAIndexerContextParallel", CONTEXT_PARALLEL, __name__)
DSAIndexerLossContextParallel = refused_class("DSAIndexerLossContextParallel", CONTEXT_PARALLEL,
                                              __name__)
DSASequenceReplicateCache = refused_class("DSASequenceReplicateCache", CONTEXT_PARALLEL, __name__)
DSASparseAttentionContextParallel = refused_class("DSASparseAttentionContextParallel",
                                                  CONTEXT_PARALLEL, __name__)
