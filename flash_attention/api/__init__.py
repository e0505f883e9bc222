"""The public entry points, one module each: :mod:`.attention` (``attention()``, and one named kernel
configuration's ``forward``), :mod:`.varlen` (packed batches), :mod:`.kvcache` (decoding against a KV cache;
:mod:`flash_attention.fallback.kvcache` for what no decode kernel takes), :mod:`.ring` (context parallelism
over a process group), :mod:`.precompile` (compiling ahead of the first call), and :mod:`.few_queries` (the
route that sends ``attention()`` calls of a few queries to the decode kernels).

Each checks its arguments once (:mod:`flash_attention.spec`), then runs on the launch layer
(:mod:`flash_attention.ops`), through the torch ops (:mod:`flash_attention.torch_ops`) where autograd or
torch.compile needs one node, or on the PyTorch fallback (:mod:`flash_attention.fallback`).
"""
