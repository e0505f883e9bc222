"""``python -m flash_attention bench``: the benchmark sweep of DESIGN.md, its result files and README tables.

The sweep follows the FlashAttention papers: 16k tokens per batch (batch = 16384 / seqlen), model width 2048
(heads = 2048 / head_dim), seqlen 512 ... 16k, bf16. Every implementation runs in the same process on the
same GPU: ours (``flash_attention``), ``scaled_dot_product_attention`` pinned to each of its backends
(``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient``), ``torch.compile(flex_attention)`` (``flex``) and
FlashAttention-4 (``fa4``, where installed), plus an
8192^3 bf16 matmul as the ceiling of the day (the same GPU model measures 680-800 TFLOP/s on different days,
so a ratio is only meaningful against a ceiling taken in the same run).

* :mod:`.cli` -- the command line;
* :mod:`.sweep` -- the shapes and the timing loop; :mod:`.runners` -- each implementation at one shape;
* :mod:`.results` -- the result files; :mod:`.tables` -- their tables; :mod:`.readme` -- the README regions;
* :mod:`.tiny` -- the latency-bound calls of ``--tiny``; :mod:`.progression` -- ``--progression``;
  :mod:`.plot` -- ``--plot``; :mod:`.main_job` -- ``python -m flash_attention`` without a command.
"""

from .cli import main

__all__ = ["main"]
