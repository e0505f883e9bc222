"""flash_attention: exact attention for PyTorch, computed tile by tile with an online softmax.

Public entry points:

* :func:`attention` -- softmax(Q K^T * scale) V in the (batch, seqlen, heads, head_dim) layout, on our CUDA
  kernels when they can run and through PyTorch (same semantics) otherwise;
* :func:`attention_with_kvcache` -- decoding: new queries against a KV cache (contiguous or paged) that the
  call appends the new keys and values to in place;
* :func:`precompile` -- compile, in parallel and ahead of the first call, the kernels calls of a kind will
  load (first calls then load them from the disk cache);
* :func:`forward` / :func:`forward_timed` -- run one named :class:`KernelConfig`;
* :class:`KernelConfig` / :func:`parse_config` -- kernel configurations.
"""

from .configs import KernelConfig, default_config, parse_config
from .interface import attention, forward, forward_timed
from .kvcache import attention_with_kvcache
from .precompiling import precompile
from .varlen import attention_varlen

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_with_kvcache",
    "attention_varlen",
    "precompile",
    "forward",
    "forward_timed",
    "KernelConfig",
    "parse_config",
    "default_config",
    "__version__",
]
