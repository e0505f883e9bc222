"""flash_attention: exact attention for PyTorch, computed tile by tile with an online softmax.

Public entry points:

* :func:`attention` -- softmax(Q K^T * scale) V in the (batch, seqlen, heads, head_dim) layout, on our CUDA
  kernels when they can run and through PyTorch (same semantics) otherwise;
* :func:`attention_with_kvcache` -- decoding: new queries against a KV cache (contiguous or paged) that the
  call appends the new keys and values to in place;
* :func:`ring_attention` (with :func:`shard_sequence` / :func:`unshard_sequence`) -- one sequence sharded
  over the ranks of a ``torch.distributed`` group, K/V passed around a ring;
* :func:`head_parallel_attention` -- the same shares by all-to-all over heads (each rank attends the whole
  sequence of its heads);
* :func:`precompile` -- compile, in parallel and ahead of the first call, the kernels calls of a kind will
  load (first calls then load them from the disk cache);
* :func:`forward` / :func:`forward_timed` -- run one named :class:`KernelConfig`;
* :class:`KernelConfig` / :func:`parse_config` -- kernel configurations.
"""

from .api.attention import attention, forward, forward_timed
from .api.fp8_training import attention_fp8_backward
from .api.head_parallel import head_parallel_attention
from .api.kvcache import attention_with_kvcache
from .api.precompile import precompile
from .api.ring import ring_attention, shard_sequence, unshard_sequence
from .api.varlen import attention_varlen
from .configs import KernelConfig, default_config, parse_config

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_with_kvcache",
    "attention_varlen",
    "attention_fp8_backward",
    "precompile",
    "ring_attention",
    "head_parallel_attention",
    "shard_sequence",
    "unshard_sequence",
    "forward",
    "forward_timed",
    "KernelConfig",
    "parse_config",
    "default_config",
    "__version__",
]
