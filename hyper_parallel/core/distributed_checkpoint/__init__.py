"""DTensor checkpoint layouts (not provided: the names raise when used). gradpool's own sharded
checkpoints are :mod:`hyper_parallel.checkpoint`."""
from hyper_parallel.core.not_provided import DTENSOR_LAYOUTS, refused_function

get_current_layout = refused_function("get_current_layout", DTENSOR_LAYOUTS, __name__)
get_global_layout = refused_function("get_global_layout", DTENSOR_LAYOUTS, __name__)
