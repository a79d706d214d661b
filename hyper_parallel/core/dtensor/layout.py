"""Tensor-parallel layouts of DTensors (not provided: the names raise when used)."""
from hyper_parallel.core.not_provided import DTENSOR_LAYOUTS, refused_class, refused_function

Layout = refused_class("Layout", DTENSOR_LAYOUTS, __name__)
_infer_slice_area_by_rank = refused_function("_infer_slice_area_by_rank", DTENSOR_LAYOUTS, __name__)
