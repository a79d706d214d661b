"""Application pieces for end-to-end runs: the tiny DeepSeek-V3-shaped model and its data.

Imports MindSpore (unlike ``gradpool.config``), so import it only where a model is needed.
"""
from .model import (TinyDeepSeekV3, global_batch_np, make_batch, make_batch_np,
                    next_token_loss)

__all__ = ["TinyDeepSeekV3", "make_batch", "make_batch_np", "global_batch_np", "next_token_loss"]
