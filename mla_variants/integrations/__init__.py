"""Adapters that run a model library's MLA attention on mla_variants' paged latent cache.

transformers: :func:`mla_variants.integrations.transformers.enable_mla_decode` (DeepSeek-V2 / V3 models
of Hugging Face transformers; needs the ``hf`` extra: ``pip install -e ".[hf]"``). Imported lazily, so
``import mla_variants.integrations`` works without transformers installed.
"""
from __future__ import annotations

__all__ = ["enable_mla_decode", "MLADecodeHandle"]


def __getattr__(name):
    if name in __all__:
        from . import transformers as _hf
        return getattr(_hf, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
