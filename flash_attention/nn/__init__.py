"""PyTorch modules on flash_attention.

* :class:`FlashAttention` -- multi-head / grouped-query attention with its own Q/K/V/output projections;
* :class:`MultiheadAttention` -- a drop-in subclass of ``torch.nn.MultiheadAttention``;
* :func:`replace_attention` -- convert the ``nn.MultiheadAttention`` modules of an existing model.

They run on our CUDA kernels (fp16/bf16 on CUDA), for inference and training alike, and on PyTorch for
what the kernels do not do (arbitrary masks and biases, ``need_weights=True``, and in
:class:`MultiheadAttention` the dropout of the stock module's random stream), computing the same function
either way; :mod:`flash_attention.nn.functional` holds that dispatch.
"""

from .convert import replace_attention
from .flash import FlashAttention
from .mha import MultiheadAttention

__all__ = ["FlashAttention", "MultiheadAttention", "replace_attention"]
