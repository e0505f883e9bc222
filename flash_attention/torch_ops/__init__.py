"""The ``torch.library`` custom ops: :mod:`.attention` (``flash_attention::fwd`` / ``bwd`` and their autograd
formula, the eager training path) and :mod:`.kvcache` (``flash_attention::fwd_kvcache``, which declares its
writes to the caches). Each op runs our kernels through the launch layer or the PyTorch fallback.
"""
