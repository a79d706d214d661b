"""gradpool: a pre-allocated, fenced gradient bucket pool for MindSpore FSDP reduce paths."""
__version__ = "0.1.0"
