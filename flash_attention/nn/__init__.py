"""PyTorch modules on flash_attention.

* :class:`FlashAttention` -- multi-head / grouped-query attention with its own Q/K/V/output projections;
* :class:`MultiheadAttention` -- a drop-in subclass of ``torch.nn.MultiheadAttention``;
* :func:`replace_attention` -- convert the ``nn.MultiheadAttention`` modules of an existing model.

They use our CUDA kernel for inference (fp16/bf16 on CUDA) and PyTorch for what the kernel does not do yet
(gradients, attention dropout, arbitrary masks), computing the same function either way;
:mod:`flash_attention.nn.functional` holds that dispatch.
"""

from .convert import replace_attention
from .flash import FlashAttention
from .mha import MultiheadAttention

__all__ = ["FlashAttention", "MultiheadAttention", "replace_attention"]
