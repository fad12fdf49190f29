"""mla-variants: specialized MLA (DeepSeek latent attention) decode kernels over a paged KV cache.

    from mla_variants import mla_decode
    out, lse = mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale)

The kernels come from ``mla-variants build`` (variants.yaml -> generated/ -> build/libmla_variants.so);
a variant the build lacks is compiled on first use into a per-user cache (jit; ensure_variant ahead of time).
Modules: api (mla_decode), plan (MLADecodePlan), validation (argument checks), dispatch (variant choice),
splits (the split heuristic), launching (argument packing), _binding (the library and its manifest),
varlen (a q_len per request), ops (torch.library ops), jit (variants compiled on first use), fp8 (fp8 cache helpers), reference (the fp32 reference), testing (test cases).
"""
from ._binding import LibraryNotBuiltError
from .api import is_supported, list_variants, mla_decode, workspace_size
from .dispatch import VariantNotCompiledError
from .splits import default_num_kv_splits
from .validation import MLAInputError
from .plan import MLADecodePlan
from .reference import mla_decode_reference
from .varlen import mla_decode_varlen, mla_decode_varlen_reference
from .jit import ensure_variant
from . import ops  # registers torch.ops.mla_variants.mla_decode / mla_decode_out

__all__ = [
    "mla_decode", "mla_decode_varlen", "MLADecodePlan", "mla_decode_reference", "mla_decode_varlen_reference", "workspace_size", "default_num_kv_splits", "list_variants",
    "is_supported", "ensure_variant", "MLAInputError", "VariantNotCompiledError", "LibraryNotBuiltError",
]
