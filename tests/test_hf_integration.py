"""The transformers integration (mla_variants.integrations.transformers) against transformers' own eager
attention, through examples/hf_generate.py's check (skipped when transformers is not installed).

CPU: the V2-like and V3-like models at page sizes 1 and 16, q_len 1 and 2, bf16 and fp8 caches (the fp32
reference backend), a 128-head model, the fp32 cache (the absorbed math alone: measured ~1e-5 of logits
with a standard deviation of ~3; bound 1e-4 here), three sabotaged integrations that the check must
reject (k_pe rotated with another rope layout than q_pe, the softmax scale without YaRN's mscale^2,
cache writes that ignore block_table), the kernel backend's arguments through the library's own
validation (a CPU stand-in for MLADecodePlan; q and out rounded to 16 bits), and the argument errors.
Measured on this repository's 2-core CPU machine: max |logit difference| ~0.015-0.022 for bf16 (0.024-0.039
with q and out in bf16; bound 0.25) and ~0.25-0.41 for fp8 (bound 1.5, outside the one V3 step whose MoE
router picks other experts); the whole file takes ~12 s.

GPU (marked gpu; needs an sm_90 GPU and a build serving the page sizes): the same check on CUDA through
MLADecodePlan, 16 and 128 heads, pages 1 / 16 / 64, bf16 and fp8 caches, q_len 1 and 2.
"""
import importlib.util
import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

from mla_variants import MLAInputError  # noqa: E402
from mla_variants.integrations import transformers as integ  # noqa: E402
from mla_variants.integrations.transformers import MLADecodeHandle, enable_mla_decode  # noqa: E402

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "hf_generate.py"


def _load_example():
    spec = importlib.util.spec_from_file_location("hf_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


hf = _load_example()
_CACHE: dict = {}


def _model_and_baseline(arch: str, num_heads: int = 16, device: str = "cpu"):
    """One seeded model and transformers' greedy generation per (arch, heads, device), shared by the tests
    (run_check leaves the model as it found it)."""
    key = (arch, num_heads, device)
    if key not in _CACHE:
        model = hf.build_model(arch, num_heads, 0, device)
        ids, mask = hf.make_prompts(device=device)
        _CACHE[key] = model, hf.hf_generate(model, ids, mask, 8)
    return _CACHE[key]


def _check(arch, *, device="cpu", num_heads=16, **kw):
    model, baseline = _model_and_baseline(arch, num_heads, device)
    rep = hf.run_check(arch, device=device, num_heads=num_heads, model=model, baseline=baseline, **kw)
    assert rep.ok, rep.line()
    assert rep.max_logit_err <= rep.bound and rep.max_logit_err == rep.max_logit_err  # a real, finite number
    return rep


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_matches_transformers_cpu(arch, page_size, q_len, kv_dtype):
    rep = _check(arch, page_size=page_size, q_len=q_len, kv_dtype=kv_dtype)
    if q_len > 1:
        assert rep.spec_err is not None and rep.spec_err <= rep.bound
    if kv_dtype == "bf16":   # rounding the cache to bf16 leaves far less than the bound
        assert rep.max_logit_err < 0.1, rep.line()


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_fp32_cache_is_exact(arch):
    """With an fp32 cache only summation order separates the absorbed MLA from transformers' attention."""
    rep = _check(arch, page_size=16, q_len=2, kv_dtype="fp32")
    assert rep.max_logit_err < 1e-4 and rep.spec_err < 1e-4, rep.line()
    assert not rep.near_ties and not rep.router_flips, rep.line()


def test_128_heads_cpu():
    _check("v2", num_heads=128, page_size=16, q_len=2, kv_dtype="bf16")


def test_example_main_cpu():
    assert hf.main(["--arch", "v3", "--kv-dtype", "bf16", "--page-size", "1", "--new-tokens", "4"]) == 0


class _PlanOnCpu:
    """Stands in for MLADecodePlan on the CPU: runs the library's own argument validation (all of it up to
    its CUDA-device check, which must be the only complaint), checks the arguments against the plan's
    num_heads / page_size / q_len / dtypes, then computes with the fp32 reference into the bf16/fp16 `out`."""

    def __init__(self, max_batch, num_heads, page_size, *, q_len, dtype, kv_dtype, max_seq_len, device, fp8_mode):
        self.max_batch, self.num_heads, self.page_size, self.q_len = max_batch, num_heads, page_size, q_len
        self.fp8_mode = fp8_mode
        self.dtype, self.kv_dtype = dtype, kv_dtype or dtype

    def run(self, q, kv_cache, block_table, seq_lens, softmax_scale, *, out, lse, k_scale=None):
        from mla_variants import mla_decode_reference
        from mla_variants.validation import validate
        with pytest.raises(MLAInputError, match="^q: expected a CUDA tensor"):
            validate(q, kv_cache, block_table, seq_lens, softmax_scale, None, out, lse, k_scale)
        assert (q.shape[1], q.shape[2], kv_cache.shape[1]) == (self.q_len, self.num_heads, self.page_size)
        assert q.dtype == self.dtype and kv_cache.dtype == self.kv_dtype and q.shape[0] <= self.max_batch
        assert isinstance(softmax_scale, float) and (k_scale is None) == (kv_cache.dtype != torch.float8_e4m3fn)
        o, l = mla_decode_reference(q, kv_cache, block_table, seq_lens, softmax_scale, k_scale=k_scale)
        out.copy_(o)
        lse.copy_(l)
        return out, lse


@pytest.mark.parametrize("arch,kv_dtype,q_len,page_size,fp8_mode", [
    ("v2", "bf16", 1, 1, "exact"), ("v3", "bf16", 2, 16, "exact"), ("v2", "fp8_e4m3", 2, 16, "exact"),
    ("v3", "fp8_e4m3", 1, 1, "exact"), ("v3", "fp8_e4m3", 2, 16, "fast"), ("v3", "fp16", 2, 16, "exact")])
def test_kernel_backend_arguments_on_cpu(monkeypatch, arch, kv_dtype, q_len, page_size, fp8_mode):
    """The kernel backend's plumbing (plan per q_len, out/lse buffers sliced per batch, q in bf16/fp16,
    k_scale, block_table / seq_lens views) through the library's argument validation, on the CPU; the
    logits bound still holds with q and out rounded to the kernel's 16-bit dtype."""
    import mla_variants.plan
    plans = []

    def plan(*args, **kw):
        plans.append(_PlanOnCpu(*args, **kw))
        return plans[-1]
    init = MLADecodeHandle.__init__

    def kernel_init(self, *args, **kw):
        init(self, *args, **kw)   # made as backend="reference" (the model is on the CPU), then switched
        self.backend = "kernel"
        self.q_dtype = torch.float16 if self.kv_dtype == torch.float16 else torch.bfloat16
    monkeypatch.setattr(mla_variants.plan, "MLADecodePlan", plan)
    monkeypatch.setattr(MLADecodeHandle, "__init__", kernel_init)
    rep = _check(arch, page_size=page_size, q_len=q_len, kv_dtype=kv_dtype, fp8_mode=fp8_mode)
    assert {p.q_len for p in plans} == ({1, q_len}), "one plan per q_len (q_len 1: free generation)"
    assert {p.fp8_mode for p in plans} == {fp8_mode}, "the handle's fp8_mode reaches every plan"
    if kv_dtype != "fp8_e4m3":   # measured 0.005-0.04 with q and out rounded to 16 bits
        assert rep.max_logit_err < 0.1, rep.line()


# ---------------------------------------------------------------- the check can fail


def _sabotaged(arch):
    model, baseline = _model_and_baseline(arch)
    return hf.run_check(arch, model=model, baseline=baseline, page_size=16, q_len=1, kv_dtype="fp32")


def test_check_rejects_mismatched_rope_layout(monkeypatch):
    """k_pe cached in the non-interleaved layout while q_pe uses V3's interleaved one: scores go wrong."""
    def rotate(self, layer, q_pe, k_pe, pe):
        mod, (cos, sin) = layer.rotary_module, pe
        q_rot, _ = mod.apply_rotary_pos_emb_interleave(q_pe, k_pe, cos, sin)
        _, k_rot = mod.apply_rotary_pos_emb(q_pe, k_pe, cos, sin)
        return q_rot, k_rot
    monkeypatch.setattr(MLADecodeHandle, "_rotate", rotate)
    rep = _sabotaged("v3")
    assert not rep.ok and rep.max_logit_err > 10 * hf.LOGIT_BOUNDS["fp32"], rep.line()


def test_check_rejects_scale_without_yarn_mscale(monkeypatch):
    """The V3-like model's YaRN factor 4 gives mscale^2 = (0.1 ln 4 + 1)^2 = 1.296 in module.scaling."""
    model, _ = _model_and_baseline("v3")
    mscale2 = (0.1 * torch.log(torch.tensor(4.0)).item() + 1.0) ** 2
    attn = model.model.layers[0].self_attn
    assert abs(attn.scaling - attn.qk_head_dim ** -0.5 * mscale2) < 1e-9
    reference = integ.mla_decode_reference
    monkeypatch.setattr(integ, "mla_decode_reference",
                        lambda q, kv, bt, sl, scale, **kw: reference(q, kv, bt, sl, scale / mscale2, **kw))
    rep = _sabotaged("v3")
    assert not rep.ok and rep.max_logit_err > 10 * hf.LOGIT_BOUNDS["fp32"], rep.line()


def test_check_rejects_writes_that_ignore_block_table(monkeypatch):
    """Writing token t of request b to slot b * capacity + t (no page indirection) while the kernel reads
    through the shuffled block_table: decode reads other tokens' rows."""
    def slots(self, positions):
        capacity = self.max_pages_per_seq * self.page_size
        flat = torch.arange(positions.shape[0])[:, None] * capacity + positions.clamp_min(0)
        return torch.where(positions >= 0, flat, -1).reshape(-1).to(self.device)
    monkeypatch.setattr(MLADecodeHandle, "_slots", slots)
    rep = _sabotaged("v2")
    assert not rep.ok, rep.line()


# ---------------------------------------------------------------- the handle's behaviour and errors


def test_cache_holds_only_real_tokens_and_disable_restores():
    model, _ = _model_and_baseline("v2")
    ids, mask = hf.make_prompts()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
    with enable_mla_decode(model, max_batch=4, max_seq_len=64, page_size=4, kv_dtype="bf16") as handle:
        handle.prefill(ids, mask)
        assert handle.seq_lens[:3].tolist() == list(hf.PROMPT_LENS)
        assert handle.block_table.dtype == torch.int32
        for b, n in enumerate(hf.PROMPT_LENS):   # pages cover exactly the real tokens; the rest stays -1
            assert (handle.block_table[b] >= 0).sum().item() == -(-n // 4)
        handle.decode(torch.ones(3, 2, dtype=torch.long))
        assert handle.seq_lens[:3].tolist() == [n + 2 for n in hf.PROMPT_LENS]
        handle.rewind([1, 0, 2])
        assert handle.seq_lens[:3].tolist() == [hf.PROMPT_LENS[0] + 1, hf.PROMPT_LENS[1] + 2, hf.PROMPT_LENS[2]]
        with pytest.raises(MLAInputError, match="model: expected a model not enabled yet"):
            enable_mla_decode(model, max_batch=1, max_seq_len=8)
    assert "forward" not in model.model.layers[0].self_attn.__dict__
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, before)


def test_a_failed_prefill_leaves_no_batch_to_decode():
    model, _ = _model_and_baseline("v2")
    ids, mask = hf.make_prompts()
    with enable_mla_decode(model, max_batch=4, max_seq_len=64, page_size=4, kv_dtype="bf16") as handle:
        handle.prefill(ids, mask)
        with pytest.raises(IndexError):  # token ids past the vocabulary fail inside the model
            handle.prefill(torch.full((3, 2), 10**6, dtype=torch.long))
        with pytest.raises(RuntimeError, match="no batch started"):
            handle.decode(torch.ones(3, 1, dtype=torch.long))


def test_argument_errors():
    model, _ = _model_and_baseline("v2")
    with pytest.raises(MLAInputError, match="model: expected a model with DeepseekV2Attention"):
        enable_mla_decode(torch.nn.Linear(4, 4), max_batch=1, max_seq_len=8)
    with pytest.raises(MLAInputError, match="kv_dtype: expected"):
        enable_mla_decode(model, max_batch=1, max_seq_len=8, kv_dtype="int8")
    with pytest.raises(MLAInputError, match="backend: expected 'reference' or 'auto' for a model on the CPU"):
        enable_mla_decode(model, max_batch=1, max_seq_len=8, backend="kernel")
    with pytest.raises(MLAInputError, match="k_scale: expected None for a torch.bfloat16 cache"):
        enable_mla_decode(model, max_batch=1, max_seq_len=8, k_scale=0.5)
    with pytest.raises(MLAInputError, match="fp8_mode: expected 'exact' with a torch.bfloat16 kv_cache"):
        enable_mla_decode(model, max_batch=1, max_seq_len=8, fp8_mode="fast")
    with pytest.raises(MLAInputError, match="fp8_mode: expected 'exact' or 'fast', got 'turbo'"):
        enable_mla_decode(model, max_batch=1, max_seq_len=8, kv_dtype="fp8_e4m3", fp8_mode="turbo")
    with pytest.raises(MLAInputError, match="k_scale: expected one value per attention layer"):
        enable_mla_decode(model, max_batch=1, max_seq_len=8, kv_dtype="fp8_e4m3", k_scale=[0.1])
    with pytest.raises(MLAInputError, match="page_size: expected an int"):
        enable_mla_decode(model, max_batch=1, max_seq_len=8, page_size=0)
    for bad in (1e39, 1e-45, 3e38):  # outside what mla_decode takes: refused here, not mid-generation
        with pytest.raises(MLAInputError, match="k_scale: expected None, a float in"):
            enable_mla_decode(model, max_batch=1, max_seq_len=8, kv_dtype="fp8_e4m3", k_scale=bad)
    with enable_mla_decode(model, max_batch=2, max_seq_len=8) as handle:
        with pytest.raises(RuntimeError, match="call prefill"):
            handle.decode(torch.ones(1, 1, dtype=torch.long))
        with pytest.raises(MLAInputError, match="input_ids: expected at most max_batch=2"):
            handle.prefill(torch.ones(3, 2, dtype=torch.long))
        with pytest.raises(MLAInputError, match="attention_mask: expected left padding"):
            handle.prefill(torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 1, 0], [1, 1, 1]]))
        handle.prefill(torch.ones(2, 6, dtype=torch.long))
        with pytest.raises(MLAInputError, match="input_ids: expected batch 2"):
            handle.decode(torch.ones(1, 1, dtype=torch.long))
        with pytest.raises(MLAInputError, match="input_ids: expected requests of at most max_seq_len=8"):
            handle.decode(torch.ones(2, 3, dtype=torch.long))
        with pytest.raises(MLAInputError, match="num_tokens: expected"):
            handle.rewind(7)


def test_rejects_other_mla_dims():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    config = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                              num_attention_heads=2, kv_lora_rank=256, q_lora_rank=None, qk_rope_head_dim=64,
                              qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=2,
                              n_group=1, topk_group=1, num_experts_per_tok=1)
    with pytest.raises(MLAInputError, match=r"kv_lora_rank: expected 512 .*got 256"):
        enable_mla_decode(DeepseekV3ForCausalLM(config), max_batch=1, max_seq_len=8)


# ---------------------------------------------------------------- GPU


def _need_kernels(num_heads: int, page_size: int, kv_dtype: str) -> None:
    """Skip, naming why, when no build serves this call (nothing built, or a subset build)."""
    from mla_variants import LibraryNotBuiltError, is_supported
    try:
        served = is_supported(num_heads, page_size, kv_dtype)
    except LibraryNotBuiltError as e:
        pytest.skip(f"the kernels are not built ({e}); run `mla-variants build`")
    if not served:
        pytest.skip(f"the build serves no num_heads={num_heads} page_size={page_size} dtype={kv_dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_matches_transformers_gpu(arch, num_heads, page_size, kv_dtype, q_len):
    _need_kernels(num_heads, page_size, kv_dtype)
    rep = _check(arch, device="cuda", num_heads=num_heads, page_size=page_size, q_len=q_len, kv_dtype=kv_dtype)
    if q_len > 1:
        assert rep.spec_err <= rep.bound, rep.line()


@pytest.mark.gpu
@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_fast_fp8_matches_transformers_gpu(arch, page_size, q_len):
    """fp8_mode="fast" (fp8 tensor-core math) at 128 heads, held to the fp8 cache's logit bound."""
    _need_kernels(128, page_size, "fp8_e4m3_fast")
    rep = _check(arch, device="cuda", num_heads=128, page_size=page_size, q_len=q_len, kv_dtype="fp8_e4m3",
                 fp8_mode="fast")
    if q_len > 1:
        assert rep.spec_err <= rep.bound, rep.line()
