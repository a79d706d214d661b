"""Redistribution planning between tensor-parallel layouts (not provided: the names raise when
used; ``DTensor.redistribute`` does what FSDP needs)."""
from hyper_parallel.core.not_provided import DTENSOR_LAYOUTS, refused_class

DevMat = refused_class("DevMat", DTENSOR_LAYOUTS, __name__)
RedistributionOperatorInfer = refused_class("RedistributionOperatorInfer", DTENSOR_LAYOUTS,
                                            __name__)
