"""NPU custom kernels of upstream hyper_parallel (not provided: each name raises when called)."""
from hyper_parallel.core.not_provided import NPU_CUSTOM_OPS, refused_function

_NAMES = ("npu_dense_lightning_indexer_grad_kl_loss", "npu_dense_lightning_indexer_softmax_lse",
          "npu_lightning_indexer", "npu_mhc_post", "npu_mhc_pre_sinkhorn", "npu_sparse_flash_mla",
          "npu_sparse_flash_mla_grad", "npu_sparse_lightning_indexer_grad_kl_loss",
          "npu_sparse_lightning_indexer_kl_loss_grad")
globals().update({name: refused_function(name, NPU_CUSTOM_OPS, __name__) for name in _NAMES})
__all__ = list(_NAMES)
