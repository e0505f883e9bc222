"""Kernel configurations: what each kernel family is compiled with, how it is named, which rules it obeys,
and which one a call runs by default.

* :mod:`.common` -- compiled head dims and dtypes, per-architecture shared-memory limits, the C++ struct
  emitter;
* :mod:`.forward` -- :class:`KernelConfig` (the sm80 and wgmma forward kernels);
* :mod:`.backward` -- :class:`BwdConfig` (the sm80 and wgmma backward kernels);
* :mod:`.families` -- which family computes which feature;
* :mod:`.heuristics` -- :func:`default_config` / :func:`default_bwd_config`.
"""

from .backward import BwdConfig, bwd_validity_errors, hopper_bwd_config, parse_bwd_config
from .common import (
    DTYPES,
    HEAD_DIMS,
    SMEM_LIMIT_SM80,
    SMEM_LIMIT_SM90,
    SMEM_OPTIN,
    is_hopper,
    padded_head_dim,
    smem_optin,
)
from .families import FEATURES, is_wgmma, supports, unsupported
from .forward import (
    KernelConfig,
    estimated_registers,
    parse_config,
    smem_bytes,
    validity_errors,
    wgmma_config,
    ws_config,
)
from .heuristics import classic_hopper_config, default_bwd_config, default_config, portable_config

__all__ = [
    "classic_hopper_config",
    "BwdConfig",
    "DTYPES",
    "FEATURES",
    "HEAD_DIMS",
    "KernelConfig",
    "SMEM_LIMIT_SM80",
    "SMEM_LIMIT_SM90",
    "SMEM_OPTIN",
    "bwd_validity_errors",
    "default_bwd_config",
    "default_config",
    "estimated_registers",
    "hopper_bwd_config",
    "is_hopper",
    "is_wgmma",
    "padded_head_dim",
    "parse_bwd_config",
    "parse_config",
    "portable_config",
    "smem_bytes",
    "smem_optin",
    "supports",
    "unsupported",
    "validity_errors",
    "wgmma_config",
    "ws_config",
]
