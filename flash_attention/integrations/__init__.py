"""Integrations with other libraries (optional dependencies, imported only by their own submodule).

* :mod:`flash_attention.integrations.transformers` -- Hugging Face transformers' ``AttentionInterface``.
"""
