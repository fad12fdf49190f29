"""Absorbed MLA decode for Hugging Face transformers DeepSeek-V2 / V3 models, over a paged latent cache.

    from mla_variants.integrations.transformers import enable_mla_decode
    handle = enable_mla_decode(model, max_batch=8, max_seq_len=4096, page_size=64, kv_dtype="fp8_e4m3")
    logits = handle.prefill(input_ids, attention_mask)       # transformers' attention; latents cached
    logits = handle.decode(next_ids)                          # [batch, q_len]: absorbed MLA on the cache
    tokens = handle.generate(input_ids, attention_mask, max_new_tokens=32)   # greedy, both of the above

What runs where. Prefill stays transformers' own attention (whatever ``config._attn_implementation``
says); each attention layer additionally computes its new tokens' latent rows (below) and writes the
real (non-padding) tokens into the integration's paged cache. Decode steps replace the layer's attention
by the absorbed form of DeepSeek-V2 (arXiv:2405.04434, section 2.1.2: "W^UK can be absorbed into W^UQ,
and W^UV can be absorbed into W^O"), with the attention core run by :class:`mla_variants.MLADecodePlan`
on CUDA or by :func:`mla_variants.mla_decode_reference` (fp32) elsewhere.

The math, per attention layer, head h, new token t (q_len tokens per request), all on one device:

    c_t    = kv_a_layernorm(kv_a_proj_with_mqa(x_t)[:kv_lora_rank])          [512]   (the module's RMSNorm, its eps)
    kpe_t  = rope(kv_a_proj_with_mqa(x_t)[kv_lora_rank:], pos_t)              [64]    (the module's own rotary function)
    cache row of t = [c_t | kpe_t]                                            [576]
    q_nope, q_pe = split(q_proj(x_t) or q_b_proj(q_a_layernorm(q_a_proj(x_t))))  per head: [qk_nope_head_dim], [64]
    W_UK[h], W_UV[h] = rows of kv_b_proj.weight for head h: [qk_nope_head_dim, 512], [v_head_dim, 512]
    q[h]   = [W_UK[h]^T q_nope[h] | rope(q_pe[h], pos_t)]                     [576]
    out[h] = softmax_j(softmax_scale * q[h] . row_j) @ row_j[:512]           [512], softmax_scale = module.scaling
    o_t    = o_proj(concat_h(W_UV[h] out[h]  (+ the value half of kv_b_proj.bias)))

q[h] . row_j equals transformers' q_nope.k_nope + q_pe.k_pe exactly (k_nope = W_UK c_j), and W_UV out[h]
equals its softmax-weighted sum of value rows, so only rounding separates the two paths. The rope of
q_pe and k_pe is the module's own function (V2: complex pairs; V3: ``rope_interleave`` decides, and with
it the rotated halves come out as [even | odd]), applied to both, so the cached k_pe and the query use the
same layout whatever it is.

Sequences. Each request's real tokens sit at positions 0..len-1 (left padding is skipped: explicit
position_ids = cumsum(attention_mask) - 1, as transformers' generate uses), ``seq_lens[b]`` counts them,
and pages come from one pool through ``block_table`` (``slot = block_table[b, pos // page_size] *
page_size + pos % page_size``). A decode step with q_len Q appends Q tokens per request and is causal,
bottom-right aligned: query token i of a request with seq_len L sees keys [0, L - Q + i].
"""
from __future__ import annotations

import importlib
import inspect
import math
import sys
from dataclasses import dataclass

import torch

from ..fp8 import FP8_DTYPE, FP8_MAX, FP32_TINY, quantize_kv, write_kv_cache
from ..reference import mla_decode_reference
from ..validation import (HEAD_DIM, K_SCALE_MAX, KV_LORA_RANK, MAX_Q_LEN, QK_ROPE_HEAD_DIM, MLAInputError, fail,
                          fp8_token, shown)

__all__ = ["enable_mla_decode", "MLADecodeHandle", "MLAInputError", "SUPPORTED_ATTENTION_CLASSES", "K_SCALE_HEADROOM"]

#: transformers attention classes (and their subclasses) this integration runs.
SUPPORTED_ATTENTION_CLASSES = ("DeepseekV2Attention", "DeepseekV3Attention")

#: fp8 caches without a given k_scale: k_scale = headroom x (largest |value| of the layer's first prefill) / 448,
#: so later tokens up to twice that magnitude are still represented (larger ones saturate at +-448 x k_scale).
K_SCALE_HEADROOM = 2.0

_KV_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "fp8_e4m3": FP8_DTYPE, "fp8": FP8_DTYPE, "float8_e4m3fn": FP8_DTYPE, "fp32": torch.float32, "float32": torch.float32,
}
_BACKENDS = ("auto", "kernel", "reference")


def _attention_classes():
    """The transformers DeepSeek attention classes importable in this installation (name -> class)."""
    found = {}
    for name, path in (("DeepseekV2Attention", "transformers.models.deepseek_v2.modeling_deepseek_v2"),
                       ("DeepseekV3Attention", "transformers.models.deepseek_v3.modeling_deepseek_v3")):
        try:
            module = __import__(path, fromlist=[name])
        except ImportError:
            continue
        cls = getattr(module, name, None)
        if cls is not None:
            found[name] = cls
    return found


@dataclass
class _Layer:
    """One patched attention module and what the integration needs of it."""
    index: int              # this layer's cache (handle.kv_caches[index])
    module: torch.nn.Module
    family: str             # "DeepseekV2Attention" or "DeepseekV3Attention"
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    rotary_module: object   # the Python module holding the rotary functions the attention module uses
    signature: inspect.Signature
    forward: object         # the module's own (bound) forward


@dataclass
class _Step:
    mode: str               # "prefill" or "decode"
    slots: torch.Tensor     # [batch * tokens] int64 flat cache slots on the cache's device; -1: padding


def _kv_dtype_of(kv_dtype) -> torch.dtype:
    if isinstance(kv_dtype, str) and kv_dtype.lower() in _KV_DTYPES:
        return _KV_DTYPES[kv_dtype.lower()]
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in set(_KV_DTYPES.values()):
        return kv_dtype
    fail("kv_dtype", "torch.bfloat16, torch.float16, torch.float8_e4m3fn or 'bf16'/'fp16'/'fp8_e4m3' "
         "(torch.float32/'fp32' with backend='reference' only)", shown(kv_dtype))


def _positive_int(name: str, v, upper: int = 2**31 - 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= upper:
        fail(name, f"an int from 1 to {upper}", shown(v))
    return v


def _check_module(m, cls_name: str, i: int) -> tuple[int, int, int]:
    """(num_heads, qk_nope_head_dim, v_head_dim) of an attention module, or MLAInputError naming the attribute."""
    where = f"model attention layer {i} ({cls_name})"
    for attr in ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj", "scaling", "kv_lora_rank",
                 "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        if not hasattr(m, attr):
            fail(f"{where}.{attr}", "the attribute of transformers' DeepSeek-V2/V3 attention (transformers >= 4.56)",
                 "no such attribute")
    if m.kv_lora_rank != KV_LORA_RANK:
        fail(f"{where}.kv_lora_rank", f"{KV_LORA_RANK} (the latent width of the cache row the kernels read)",
             m.kv_lora_rank)
    if m.qk_rope_head_dim != QK_ROPE_HEAD_DIM:
        fail(f"{where}.qk_rope_head_dim", f"{QK_ROPE_HEAD_DIM} (the rope width of the cache row the kernels read)",
             m.qk_rope_head_dim)
    nope, v = int(m.qk_nope_head_dim), int(m.v_head_dim)
    w = getattr(m.kv_b_proj, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not w.is_floating_point() or w.dtype == FP8_DTYPE:
        fail(f"{where}.kv_b_proj.weight", "a 2-d bf16/fp16/fp32 weight [num_heads * (qk_nope_head_dim + v_head_dim), "
             "kv_lora_rank] (quantized projections are not absorbed)",
             type(w).__name__ if not isinstance(w, torch.Tensor) else f"{w.dtype} {tuple(w.shape)}")
    if w.shape[1] != KV_LORA_RANK or w.shape[0] % (nope + v):
        fail(f"{where}.kv_b_proj.weight", f"shape [num_heads * {nope + v}, {KV_LORA_RANK}]", tuple(w.shape))
    num_heads = w.shape[0] // (nope + v)
    q_lin = m.q_b_proj if getattr(m, "q_proj", None) is None else m.q_proj
    q_out = getattr(q_lin, "out_features", None)
    if q_out != num_heads * (nope + QK_ROPE_HEAD_DIM):
        fail(f"{where}.{'q_b_proj' if getattr(m, 'q_proj', None) is None else 'q_proj'}.out_features",
             f"num_heads * (qk_nope_head_dim + qk_rope_head_dim) = {num_heads} * {nope + QK_ROPE_HEAD_DIM} "
             f"(num_heads from kv_b_proj)", q_out)
    o_in = getattr(m.o_proj, "in_features", None)
    if o_in != num_heads * v:
        fail(f"{where}.o_proj.in_features", f"num_heads * v_head_dim = {num_heads} * {v}", o_in)
    try:
        scale = float(m.scaling)
    except (TypeError, ValueError):
        scale = float("nan")
    if not 0.0 < scale < float("inf"):
        fail(f"{where}.scaling", "a finite positive softmax scale", shown(m.scaling))
    return num_heads, nope, v


class MLADecodeHandle:
    """The state :func:`enable_mla_decode` installs on a model: the paged latent cache, the requests' block
    tables and seq_lens, and the patched attention modules. Made by :func:`enable_mla_decode`; use it as a
    context manager or call :meth:`disable` to restore the model.

    Attributes (read-only by convention):
      kv_caches: list (one per attention layer, in model order) of [num_pages, page_size, 576] views of one
        buffer, dtype ``kv_dtype``; row = [c_kv (kv_lora_rank 512) | k_pe (qk_rope_head_dim 64, rotated)].
      block_table: [max_batch, max_pages_per_seq] int32 on the model's device (entries past a request's
        pages are -1 and never read). seq_lens: [max_batch] int32 on the model's device; the first ``batch``
        entries are the active requests' cached token counts.
      k_scales: per-layer fp8 dequantization scales (cache value x k_scale = real value), None for 16/32-bit
        caches or for a layer not calibrated yet.
      backend: "kernel" (MLADecodePlan on CUDA) or "reference" (mla_decode_reference, fp32).
      page_size, max_batch, max_seq_len, num_pages, num_heads, kv_dtype, batch (requests of the last prefill).
    """

    def __init__(self, model, layers: list[_Layer], *, page_size: int, kv_dtype: torch.dtype, fp8_mode: str, max_batch: int,
                 max_seq_len: int, backend: str, device: torch.device, k_scales: list, shuffle_pages: bool):
        self.model, self._layers = model, layers
        self.page_size, self.kv_dtype, self.max_batch, self.max_seq_len = page_size, kv_dtype, max_batch, max_seq_len
        self.fp8_mode = fp8_mode
        self.backend, self.device = backend, device
        self.num_heads = layers[0].num_heads
        self.max_pages_per_seq = -(-max_seq_len // page_size)
        self.num_pages = max_batch * self.max_pages_per_seq
        self._buffer = torch.zeros(len(layers), self.num_pages, page_size, HEAD_DIM, dtype=kv_dtype, device=device)
        self.kv_caches = [self._buffer[i] for i in range(len(layers))]
        self.k_scales = k_scales
        self._block_table_host = torch.full((max_batch, self.max_pages_per_seq), -1, dtype=torch.int32)
        self.block_table = self._block_table_host.to(device)
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        # the order pages are handed out in (a shuffled pool makes block_table a real indirection); a batch
        # takes them from the front and a prefill starts again at 0
        self._page_order = (torch.randperm(self.num_pages, generator=torch.Generator().manual_seed(0), dtype=torch.int32)
                            if shuffle_pages else torch.arange(self.num_pages, dtype=torch.int32))
        self._next_page = 0
        self._pages: list[list[int]] = []
        self._lens: list[int] = []
        self.batch = 0
        self._step: _Step | None = None
        self._plans: dict[int, tuple] = {}
        # q (and out) dtype of the attention core: the cache's for bf16/fp16, bf16 for fp8, fp32 for the reference
        self.q_dtype = (torch.float32 if backend == "reference" else
                        torch.bfloat16 if kv_dtype == FP8_DTYPE else kv_dtype)
        self._enabled = True
        if backend == "kernel":
            self._plan(1)   # fails now (VariantNotCompiledError, LibraryNotBuiltError) rather than mid-generation

    # ---------------------------------------------------------------- requests and pages

    def _reset(self, batch: int) -> None:
        self._next_page = 0
        self._pages = [[] for _ in range(batch)]
        self._lens = [0] * batch
        self._block_table_host.fill_(-1)
        self.batch = batch

    def _grow(self, new_lens: list[int]) -> None:
        """Allocate pages so that request b holds new_lens[b] tokens; update block_table on the device."""
        changed = False
        for b, n in enumerate(new_lens):
            pages = self._pages[b]
            while len(pages) * self.page_size < n:
                page = int(self._page_order[self._next_page])   # never exhausted: max_batch x max pages each
                self._next_page += 1
                self._block_table_host[b, len(pages)] = page
                pages.append(page)
                changed = True
        if changed:
            self.block_table.copy_(self._block_table_host)

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat slots [batch * tokens] (int64, on the device) of positions [batch, tokens] (host; < 0: padding)."""
        col = positions.clamp_min(0) // self.page_size
        page = self._block_table_host[: positions.shape[0]].long().gather(1, col)
        slots = torch.where(positions >= 0, page * self.page_size + positions.clamp_min(0) % self.page_size, -1)
        return slots.reshape(-1).to(self.device)

    def _set_lens(self, lens: list[int]) -> None:
        self._lens = list(lens)
        host = torch.zeros(self.max_batch, dtype=torch.int32)
        host[: len(lens)] = torch.tensor(lens, dtype=torch.int32)
        self.seq_lens.copy_(host)

    # ---------------------------------------------------------------- the public steps

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Start a batch of requests: run the prompts through the model (transformers' own attention) and
        write every real token's latent row into the paged cache. Forgets the previous batch.

        Args:
          input_ids: [batch, prompt_len] integer token ids, batch <= max_batch.
          attention_mask: optional [batch, prompt_len] of 0/1 with left padding only (each row: zeros, then
            ones); request b's real tokens get positions 0..len_b-1 and seq_lens[b] = len_b (a row of zeros
            is a request of 0 tokens).
        Returns:
          the model's logits [batch, prompt_len, vocab] (model dtype; rows of padding positions are
          meaningless); for a base model without an LM head, its last_hidden_state.
        Raises:
          MLAInputError naming input_ids / attention_mask for a wrong shape, a batch above max_batch, a
          request longer than max_seq_len, a mask that is not 0/1 left padding; RuntimeError if the handle
          was disabled.
        """
        self._check_enabled()
        ids = self._check_ids(input_ids, "input_ids")
        batch, length = ids.shape
        if batch > self.max_batch:
            fail("input_ids", f"at most max_batch={self.max_batch} requests", batch)
        if attention_mask is None:
            mask = torch.ones(batch, length, dtype=torch.long)
        else:
            if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (batch, length):
                fail("attention_mask", f"a tensor of shape {(batch, length)} (input_ids' shape)",
                     tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__)
            mask = attention_mask.detach().to("cpu", torch.long)
            if bool(((mask != 0) & (mask != 1)).any()):
                fail("attention_mask", "only 0 and 1", sorted(set(mask.unique().tolist())))
            if length > 1 and bool((mask[:, 1:] < mask[:, :-1]).any()):
                row = int((mask[:, 1:] < mask[:, :-1]).any(dim=1).nonzero()[0, 0])
                fail("attention_mask", "left padding (each row: zeros, then ones)", f"row {row} = {mask[row].tolist()}")
        lens = mask.sum(dim=1).tolist()
        if max(lens) > self.max_seq_len:
            fail("input_ids", f"at most max_seq_len={self.max_seq_len} real tokens per request", max(lens))
        self._reset(batch)
        try:
            self._grow(lens)
            positions = mask.cumsum(dim=1) - 1                               # real tokens: 0..len-1
            slot_positions = torch.where(mask.bool(), positions, torch.full_like(positions, -1))
            step = _Step("prefill", self._slots(slot_positions))
            position_ids = positions.clamp_min(0).to(self.device)            # padding: position 0 (never cached)
            out = self._run(step, ids.to(self.device), position_ids, attention_mask=mask.to(self.device))
        except BaseException:
            self._reset(0)  # no batch: decode refuses until a prefill succeeds (the cache is partly written)
            raise
        self._set_lens(lens)
        return out

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step of the current batch: append q_len tokens per request and attend over the
        paged cache with the absorbed MLA (every attention layer), causal and bottom-right aligned.

        Args:
          input_ids: [batch, q_len] integer token ids, batch = the last prefill's batch; q_len 1..8 with
            the kernel backend (any with the reference). Token i of request b gets position seq_lens[b] + i.
        Returns:
          logits [batch, q_len, vocab] (model dtype) (a base model: last_hidden_state).
        Raises:
          MLAInputError naming input_ids for a wrong batch, q_len, or a request that would pass max_seq_len;
          RuntimeError if no prefill started a batch or the handle was disabled; from the kernel backend,
          what MLADecodePlan.run raises.
        """
        self._check_enabled()
        if self.batch == 0:
            raise RuntimeError("MLADecodeHandle.decode: no batch started; call prefill(input_ids, attention_mask) first")
        ids = self._check_ids(input_ids, "input_ids")
        batch, q_len = ids.shape
        if batch != self.batch:
            fail("input_ids", f"batch {self.batch} (the last prefill's)", batch)
        if self.backend == "kernel" and q_len > MAX_Q_LEN:
            fail("input_ids", f"q_len from 1 to {MAX_Q_LEN} (the kernels' limit; backend='reference' takes any)", q_len)
        new_lens = [n + q_len for n in self._lens]
        if max(new_lens) > self.max_seq_len:
            b = max(range(batch), key=lambda i: new_lens[i])
            fail("input_ids", f"requests of at most max_seq_len={self.max_seq_len} tokens",
                 f"request {b} would reach {new_lens[b]}")
        self._grow(new_lens)
        positions = torch.tensor(self._lens, dtype=torch.long)[:, None] + torch.arange(q_len)[None, :]
        step = _Step("decode", self._slots(positions))
        old_lens = self._lens
        self._set_lens(new_lens)                     # the kernel's seq_lens include the step's own tokens
        try:
            return self._run(step, ids.to(self.device), positions.to(self.device))
        except BaseException:
            self._set_lens(old_lens)                 # a failed step leaves the requests as they were
            raise

    def rewind(self, num_tokens) -> None:
        """Drop the last cached tokens of each request (e.g. rejected speculative tokens): seq_lens[b] -=
        n_b. num_tokens: an int for every request or a list of one int per request, 0 <= n_b <= seq_lens[b].
        The pages stay allocated; later steps overwrite the slots. Raises MLAInputError naming num_tokens."""
        counts = [num_tokens] * self.batch if isinstance(num_tokens, int) and not isinstance(num_tokens, bool) \
            else list(num_tokens) if isinstance(num_tokens, (list, tuple)) else None
        if counts is None or len(counts) != self.batch or any(
                isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= m for n, m in zip(counts, self._lens)):
            fail("num_tokens", f"an int or {self.batch} ints, each from 0 to the request's seq_len {self._lens}",
                 shown(num_tokens))
        self._set_lens([m - n for m, n in zip(self._lens, counts)])

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 max_new_tokens: int = 16) -> torch.Tensor:
        """Greedy generation: :meth:`prefill`, then max_new_tokens - 1 :meth:`decode` steps of q_len 1.
        Returns the new tokens [batch, max_new_tokens] (int64, on the model's device). Same arguments and
        errors as prefill; MLAInputError naming max_new_tokens unless it is an int >= 1."""
        _positive_int("max_new_tokens", max_new_tokens)
        logits = self.prefill(input_ids, attention_mask)
        token = logits[:, -1].argmax(dim=-1)
        tokens = [token]
        for _ in range(max_new_tokens - 1):
            token = self.decode(token[:, None])[:, -1].argmax(dim=-1)
            tokens.append(token)
        return torch.stack(tokens, dim=1)

    def disable(self) -> None:
        """Restore the attention modules' own forward and release the cache. Idempotent."""
        if not self._enabled:
            return
        for layer in self._layers:
            layer.module.__dict__.pop("forward", None)
            layer.module.__dict__.pop("_mla_decode_handle", None)
        self._enabled = False
        self.kv_caches, self._buffer, self._plans = [], None, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.disable()

    def __repr__(self) -> str:
        return (f"MLADecodeHandle(layers={len(self._layers)}, num_heads={self.num_heads}, page_size={self.page_size}, "
                f"kv_dtype={self.kv_dtype}, fp8_mode={self.fp8_mode!r}, backend={self.backend!r}, max_batch={self.max_batch}, "
                f"max_seq_len={self.max_seq_len}, batch={self.batch}, seq_lens={self._lens})")

    # ---------------------------------------------------------------- internals

    def _check_enabled(self) -> None:
        if not self._enabled:
            raise RuntimeError("MLADecodeHandle: disabled (disable() restored the model); call enable_mla_decode again")

    @staticmethod
    def _check_ids(input_ids, name: str) -> torch.Tensor:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point() \
                or input_ids.is_complex() or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
            fail(name, "an integer tensor [batch >= 1, tokens >= 1]",
                 f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor)
                 else type(input_ids).__name__)
        return input_ids.long()

    def _run(self, step: _Step, ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        self._step = step
        try:
            out = self.model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        finally:
            self._step = None
        logits = getattr(out, "logits", None)
        return logits if logits is not None else out.last_hidden_state

    def _plan(self, q_len: int):
        """(MLADecodePlan, out, lse) for q_len, made once: out/lse for max_batch, sliced per step."""
        entry = self._plans.get(q_len)
        if entry is None:
            from ..plan import MLADecodePlan
            plan = MLADecodePlan(self.max_batch, self.num_heads, self.page_size, q_len=q_len, dtype=self.q_dtype,
                                 kv_dtype=FP8_DTYPE if self.kv_dtype == FP8_DTYPE else None, fp8_mode=self.fp8_mode,
                                 max_seq_len=self.max_seq_len, device=self.device)
            out = torch.empty(self.max_batch, q_len, self.num_heads, KV_LORA_RANK, dtype=self.q_dtype, device=self.device)
            lse = torch.empty(self.max_batch, self.num_heads, q_len, dtype=torch.float32, device=self.device)
            entry = self._plans[q_len] = (plan, out, lse)
        return entry

    def _forward(self, layer: _Layer, args, kwargs):
        """The patched attention forward: transformers' own outside prefill/decode and during prefill (plus
        the cache write), the absorbed MLA during decode."""
        step = self._step
        if step is None:
            return layer.forward(*args, **kwargs)
        if "position_embeddings" in kwargs and (args or "hidden_states" in kwargs):
            # How transformers' decoder layers call their attention: no signature binding needed.
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            pe = kwargs["position_embeddings"]
        else:
            bound = layer.signature.bind(*args, **kwargs)
            extra = next((v for k, v in bound.arguments.items()
                          if layer.signature.parameters[k].kind is inspect.Parameter.VAR_KEYWORD), {})
            hidden = bound.arguments.get("hidden_states", args[0] if args else None)
            pe = bound.arguments.get("position_embeddings", extra.get("position_embeddings"))
        if pe is None:
            raise RuntimeError(f"attention layer {layer.index} ({layer.family}): the decoder layer passed no "
                               "position_embeddings; this transformers version is not supported (>= 4.56 is)")
        if step.mode == "prefill":
            self._write_prefill(layer, hidden, pe, step)
            return layer.forward(*args, **kwargs)
        return self._absorbed_attention(layer, hidden, pe, step), None

    def _rotate(self, layer: _Layer, q_pe: torch.Tensor, k_pe: torch.Tensor, pe):
        """The module's own rotary function on q_pe [batch, heads, tokens, 64] and k_pe [batch, 1, tokens, 64]
        (transformers' layouts); returns both rotated, in the layout transformers' attention uses."""
        mod = layer.rotary_module
        if layer.family == "DeepseekV2Attention":
            return mod.apply_rotary_emb(q_pe, k_pe, pe.to(q_pe.device))
        cos, sin = pe
        if getattr(layer.module.config, "rope_interleave", False):
            return mod.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
        return mod.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)

    def _latent_rows(self, layer: _Layer, hidden: torch.Tensor, pe, q_pe: torch.Tensor | None = None):
        """Cache rows [batch * tokens, 576] of hidden [batch, tokens, hidden_size] and, given q_pe
        [batch, heads, tokens, 64], the rotated q_pe (same layout)."""
        m = layer.module
        batch, tokens = hidden.shape[:2]
        c_kv, k_pe = torch.split(m.kv_a_proj_with_mqa(hidden), [KV_LORA_RANK, QK_ROPE_HEAD_DIM], dim=-1)
        c_kv = m.kv_a_layernorm(c_kv)
        k_pe = k_pe.reshape(batch, 1, tokens, QK_ROPE_HEAD_DIM)
        q_rot, k_rot = self._rotate(layer, k_pe if q_pe is None else q_pe, k_pe, pe)
        rows = torch.cat([c_kv, k_rot.reshape(batch, tokens, QK_ROPE_HEAD_DIM).to(c_kv.dtype)], dim=-1)
        return rows.reshape(batch * tokens, HEAD_DIM), (None if q_pe is None else q_rot)

    def _write(self, layer: _Layer, rows: torch.Tensor, slots: torch.Tensor, step_is_decode: bool = False) -> None:
        """rows [tokens, 576] into this layer's cache at slots [tokens] (int64 on the device; < 0: a padding
        token, skipped). A decode step's slots are all valid (the handle allocated them), so its write is
        one index_copy_ with no host synchronization; prefill goes through write_kv_cache, which checks
        the slots (and synchronizes for that)."""
        cache = self.kv_caches[layer.index]
        if self.kv_dtype == FP8_DTYPE:
            if self.k_scales[layer.index] is None:   # calibrate on this layer's first write of real tokens
                real = rows[slots >= 0]
                if real.numel() == 0:
                    return
                amax = float(real.abs().max())
                if not math.isfinite(amax):  # keep the scale unset, so a later prefill calibrates again
                    raise MLAInputError(f"k_scale: calibration found a non-finite latent value ({amax}) in layer "
                                        f"{layer.index}'s first prefill; the model's kv_a_proj_with_mqa output overflowed")
                self.k_scales[layer.index] = max(amax, 1e-6) * K_SCALE_HEADROOM / FP8_MAX
            if step_is_decode:
                flat = cache.view(-1, HEAD_DIM).view(torch.uint8)   # index_copy_ has no float8 kernel
                flat.index_copy_(0, slots, quantize_kv(rows, self.k_scales[layer.index]).view(torch.uint8))
            else:
                write_kv_cache(cache, slots, rows, self.k_scales[layer.index])
        elif self.kv_dtype == torch.float32:          # fp32 verification cache (reference backend only)
            keep = slots >= 0
            s = slots[keep]
            cache[s // self.page_size, s % self.page_size] = rows[keep].float()
        elif step_is_decode:
            cache.view(-1, HEAD_DIM).index_copy_(0, slots, rows.to(cache.dtype))
        else:
            write_kv_cache(cache, slots, rows)

    def _write_prefill(self, layer: _Layer, hidden: torch.Tensor, pe, step: _Step) -> None:
        rows, _ = self._latent_rows(layer, hidden, pe)
        self._write(layer, rows, step.slots)

    def _absorbed_attention(self, layer: _Layer, hidden: torch.Tensor, pe, step: _Step) -> torch.Tensor:
        m = layer.module
        batch, q_len = hidden.shape[:2]
        heads, nope, v = layer.num_heads, layer.qk_nope_head_dim, layer.v_head_dim
        if getattr(m, "q_proj", None) is not None:
            q = m.q_proj(hidden)
        else:
            q = m.q_b_proj(m.q_a_layernorm(m.q_a_proj(hidden)))
        q = q.view(batch, q_len, heads, nope + QK_ROPE_HEAD_DIM)
        q_nope, q_pe = torch.split(q, [nope, QK_ROPE_HEAD_DIM], dim=-1)
        rows, q_rot = self._latent_rows(layer, hidden, pe, q_pe.transpose(1, 2))   # q_rot [batch, heads, q_len, 64]
        self._write(layer, rows, step.slots, step_is_decode=True)
        weight = m.kv_b_proj.weight.view(heads, nope + v, KV_LORA_RANK)
        w_uk, w_uv = weight[:, :nope], weight[:, nope:]                           # [heads, nope|v, 512]
        # [heads, batch * q_len, nope] @ [heads, nope, 512] -> [batch, q_len, heads, 512]
        q_latent = torch.bmm(q_nope.to(weight.dtype).reshape(batch * q_len, heads, nope).transpose(0, 1), w_uk)
        q_latent = q_latent.transpose(0, 1).reshape(batch, q_len, heads, KV_LORA_RANK)
        q_full = torch.cat([q_latent, q_rot.transpose(1, 2).to(q_latent.dtype)], dim=-1).to(self.q_dtype)
        cache = self.kv_caches[layer.index]
        k_scale = self.k_scales[layer.index] if self.kv_dtype == FP8_DTYPE else None
        scale = float(m.scaling)
        block_table, seq_lens = self.block_table[:batch], self.seq_lens[:batch]
        if self.backend == "reference":
            out, _ = mla_decode_reference(q_full.contiguous(), cache, block_table, seq_lens, scale, k_scale=k_scale)
        else:
            plan, out_buf, lse_buf = self._plan(q_len)
            out, _ = plan.run(q_full.contiguous(), cache, block_table, seq_lens, scale,
                              out=out_buf[:batch], lse=lse_buf[:batch], k_scale=k_scale)
        # [heads, batch * q_len, 512] @ [heads, 512, v] -> [batch, q_len, heads, v]
        o = torch.bmm(out.to(weight.dtype).reshape(batch * q_len, heads, KV_LORA_RANK).transpose(0, 1), w_uv.transpose(1, 2))
        o = o.transpose(0, 1).reshape(batch, q_len, heads, v)
        bias = getattr(m.kv_b_proj, "bias", None)
        if bias is not None:   # the key half of the bias adds a per-query constant to every score: cancels in softmax
            o = o + bias.view(heads, nope + v)[:, nope:]
        return m.o_proj(o.reshape(batch, q_len, heads * v).to(hidden.dtype))


def enable_mla_decode(model, *, max_batch: int, max_seq_len: int, page_size: int = 16, kv_dtype=torch.bfloat16,
                      k_scale=None, fp8_mode: str = "exact", backend: str = "auto",
                      shuffle_pages: bool = True) -> MLADecodeHandle:
    """Make a transformers DeepSeek-V2/V3 model decode with absorbed MLA over a paged latent cache.

    Patches every DeepseekV2Attention / DeepseekV3Attention module of `model` (instance attribute
    ``forward``; the model's code and weights are not changed) and returns the handle that owns the cache
    and runs the steps (:meth:`MLADecodeHandle.prefill`, :meth:`~MLADecodeHandle.decode`,
    :meth:`~MLADecodeHandle.generate`, :meth:`~MLADecodeHandle.rewind`). Calls of the model outside
    these methods run transformers' own attention, unchanged. The math is in this module's docstring
    (DeepSeek-V2, arXiv:2405.04434, section 2.1.2, weight absorption); the softmax scale is each module's
    ``scaling`` (1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale^2 under YaRN).

    Args:
      model: a transformers DeepseekV2/V3 model (ForCausalLM or the base model) with kv_lora_rank 512 and
        qk_rope_head_dim 64; any head count (a tensor-parallel shard's, read from kv_b_proj); every
        attention module on one device. Weights may be fp32, bf16 or fp16 (not quantized kv_b_proj).
      max_batch: the most requests one prefill may start (>= 1).
      max_seq_len: the most tokens (prompt + generated) one request may hold (>= 1); the cache holds
        num_pages = max_batch * ceil(max_seq_len / page_size) pages per attention layer, allocated now:
        num_layers * num_pages * page_size * 576 values of 2 bytes (bf16/fp16), 1 (fp8) or 4 (fp32).
      page_size: tokens per page (>= 1; the kernel backend needs a compiled page size, e.g. 1, 16, 64, 128).
      kv_dtype: the cache's dtype: torch.bfloat16 / 'bf16', torch.float16 / 'fp16', torch.float8_e4m3fn /
        'fp8_e4m3' (per-layer k_scale, the kernel's q and out in bf16), or torch.float32 / 'fp32' (only
        with the reference backend, for verification).
      k_scale: fp8 caches only: None (calibrate each layer at its first prefill: K_SCALE_HEADROOM x max
        |row value| / 448), a positive float for every layer, or a list with one per attention layer.
        Cache value x k_scale = real value (mla_variants.fp8).
      fp8_mode: fp8 caches only: "exact" (default; the cache widened exactly to fp16 for the kernel's math)
        or "fast" (fp8 tensor-core math above 32 heads, the exact kernels at 32 or fewer; the README's
        "Which fp8 mode"), as mla_decode's fp8_mode. The reference backend computes in fp32 under either mode.
      backend: "auto" (the kernels when the model is on CUDA, else the reference), "kernel"
        (MLADecodePlan; CUDA only), "reference" (mla_decode_reference in fp32, any device).
      shuffle_pages: hand out pages from a shuffled pool (True, so block_table is a real indirection) or
        in order.
    Returns:
      an :class:`MLADecodeHandle`.
    Raises:
      MLAInputError (a ValueError) naming the argument, what was expected and what was given: a model
      without supported attention modules, or whose modules have another kv_lora_rank / qk_rope_head_dim,
      inconsistent head counts, quantized kv_b_proj, several devices; bad max_batch, max_seq_len,
      page_size, kv_dtype, k_scale, fp8_mode, backend; a model already enabled. With the kernel backend:
      VariantNotCompiledError (no compiled variant for page_size and kv_dtype) or LibraryNotBuiltError.
      ImportError if transformers is not installed.
    """
    try:
        importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError("enable_mla_decode needs transformers (>= 4.56): pip install -e '.[hf]' "
                          f"or pip install 'transformers>=4.56' ({e})") from e

    classes = _attention_classes()
    if not isinstance(model, torch.nn.Module):
        fail("model", "a transformers DeepSeek-V2/V3 model (torch.nn.Module)", type(model).__name__)
    _positive_int("max_batch", max_batch)
    _positive_int("max_seq_len", max_seq_len)
    _positive_int("page_size", page_size, 1 << 20)
    dtype = _kv_dtype_of(kv_dtype)
    fp8_token(fp8_mode, dtype)   # MLAInputError naming fp8_mode: not 'exact'/'fast', or 'fast' on a 16/32-bit cache
    if backend not in _BACKENDS:
        fail("backend", "'auto', 'kernel' or 'reference'", shown(backend))
    if not isinstance(shuffle_pages, bool):
        fail("shuffle_pages", "a bool", shown(shuffle_pages))
    modules = [m for m in model.modules() if isinstance(m, tuple(classes.values()))]
    if not modules:
        fail("model", f"a model with {' / '.join(SUPPORTED_ATTENTION_CLASSES)} modules (transformers DeepSeek-V2/V3)",
             f"{type(model).__name__} without any")
    for i, m in enumerate(modules):
        if "_mla_decode_handle" in m.__dict__:
            fail("model", "a model not enabled yet (call the existing handle's disable() first)",
                 f"attention layer {i} already patched")
    devices = {m.kv_b_proj.weight.device for m in modules if hasattr(m, "kv_b_proj")}
    if len(devices) != 1:
        fail("model", "every attention module on one device", sorted(str(d) for d in devices))
    device = devices.pop()
    if backend == "auto":
        backend = "kernel" if device.type == "cuda" else "reference"
    if backend == "kernel" and device.type != "cuda":
        fail("backend", "'reference' or 'auto' for a model on the CPU ('kernel' runs on CUDA)", f"'kernel' on {device}")
    if dtype == torch.float32 and backend != "reference":
        fail("kv_dtype", "bf16, fp16 or fp8_e4m3 with the kernel backend (fp32 caches: backend='reference')", dtype)
    layers = []
    for i, m in enumerate(modules):
        family = next(name for name, cls in classes.items() if isinstance(m, cls))
        num_heads, nope, v = _check_module(m, family, i)
        rotary_module = sys.modules[classes[family].__module__]
        needed = ("apply_rotary_emb",) if family == "DeepseekV2Attention" else ("apply_rotary_pos_emb",
                                                                               "apply_rotary_pos_emb_interleave")
        for fn in needed:
            if not callable(getattr(rotary_module, fn, None)):
                fail(f"model attention layer {i} ({family})", f"the rotary function {rotary_module.__name__}.{fn} "
                     "(transformers >= 4.56)", "none")
        layers.append(_Layer(i, m, family, num_heads, nope, v, rotary_module, inspect.signature(m.forward), m.forward))
    heads = {l.num_heads for l in layers}
    if len(heads) != 1:
        fail("model", "one num_heads in every attention layer", sorted(heads))
    if dtype == FP8_DTYPE:
        if k_scale is None:
            k_scales = [None] * len(layers)
        elif isinstance(k_scale, (list, tuple)):
            if len(k_scale) != len(layers):
                fail("k_scale", f"one value per attention layer ({len(layers)})", f"{len(k_scale)} values")
            k_scales = list(k_scale)
        else:
            k_scales = [k_scale] * len(layers)
        for s in k_scales:
            if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float))
                                  or not FP32_TINY <= float(s) <= K_SCALE_MAX):
                fail("k_scale", f"None, a float in [{FP32_TINY:.3g}, {K_SCALE_MAX:.3g}] (the range mla_decode "
                                "takes) or a list of them", shown(k_scale))
        k_scales = [None if s is None else float(s) for s in k_scales]
    else:
        if k_scale is not None:
            fail("k_scale", f"None for a {dtype} cache (k_scale is for fp8_e4m3 caches)", shown(k_scale))
        k_scales = [None] * len(layers)
    handle = MLADecodeHandle(model, layers, page_size=page_size, kv_dtype=dtype, fp8_mode=fp8_mode, max_batch=max_batch,
                             max_seq_len=max_seq_len, backend=backend, device=device, k_scales=k_scales,
                             shuffle_pages=shuffle_pages)
    for layer in layers:
        def forward(*args, _layer=layer, **kwargs):
            return handle._forward(_layer, args, kwargs)
        layer.module.forward = forward
        layer.module._mla_decode_handle = handle
    return handle
