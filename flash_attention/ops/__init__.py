"""The launch layer: the only code that turns tensors into kernel launches.

It re-checks, at run time, every assumption a compiled kernel makes (dtype, head_dim within the compiled size,
16-byte aligned rows, strides in range, shared memory that fits this GPU), allocates outputs, picks the
stream and launches through the driver API (:mod:`flash_attention.jit`). The user-facing argument checks come
first, in :mod:`flash_attention.spec.validate`; the choice between these kernels and the PyTorch fallback is
:mod:`flash_attention.ops.dispatch`'s.

* :mod:`.device` -- facts about a GPU, and why the kernels cannot run on it;
* :mod:`.select` -- which configuration a call runs (and the catalog of every kernel a model can need);
* :mod:`.forward` / :mod:`.backward` / :mod:`.decode` -- the launches; :mod:`.plans` -- what they share (the
  plan cache, the params fields filled alike, the launch in the device's primary context);
* :mod:`.tensors` -- layout rules shared by both; :mod:`.trace` -- the debug build's launch state;
* :mod:`.training` -- eager training calls on the compiled autograd node (:mod:`flash_attention.jit.host`);
* :mod:`.repeat` -- a call whose signature ran before repeats its launch without deciding anything again.
"""

from . import backward as _backward
from . import decode as _decode
from . import forward as _forward
from .backward import cuda_backward
from .decode import decode_plan, decode_unavailable_reason
from .device import cuda_unavailable_reason, device_arch, gpu_name, smem_limit
from .forward import chosen_config, cuda_forward, prepare
from .repeat import prepare as prepare_repeat
from .select import NoKernel, backward_config, catalog, dropout_config, forward_config
from .trace import TraceTarget, last_trace, trace_from_env
from .training import prefetch_backward, training_forward


def clear_plans() -> None:
    """Forget every family's launch plans (after a tuned-winners table, a default config or a test's stand-in
    for a device fact changed)."""
    _forward.clear_plans()
    _backward.clear_plans()
    _decode.clear_plans()


__all__ = [
    "clear_plans",
    "NoKernel",
    "TraceTarget",
    "backward_config",
    "catalog",
    "chosen_config",
    "cuda_backward",
    "decode_plan",
    "decode_unavailable_reason",
    "cuda_forward",
    "cuda_unavailable_reason",
    "device_arch",
    "dropout_config",
    "forward_config",
    "gpu_name",
    "last_trace",
    "prepare",
    "prepare_repeat",
    "smem_limit",
    "trace_from_env",
    "prefetch_backward",
    "training_forward",
]
