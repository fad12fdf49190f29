"""Greedy generation with a transformers DeepSeek-V2/V3 model: transformers' own eager attention against
mla_variants' absorbed MLA decode over a paged latent cache (mla_variants.integrations.transformers).

Usage (from the repository root; needs `pip install -e ".[hf]"`; no download, random seeded weights):

    python examples/hf_generate.py                                   # CPU: V2-like and V3-like, bf16 cache
    python examples/hf_generate.py --kv-dtype fp8_e4m3 --page-size 1 --q-len 2
    python examples/hf_generate.py --device cuda --num-heads 128 --page-size 64 --context 4096
    python examples/hf_generate.py --device cuda --num-heads 128 --page-size 64 --kv-dtype fp8_e4m3 --fp8-mode fast

The models are small (2 layers, hidden 256, vocab 512) but keep the real MLA cache row (kv_lora_rank 512,
qk_rope_head_dim 64) and DeepSeek's structure: the V2-like one is V2-Lite's (no q LoRA, softmax-greedy MoE
after first_k_dense_replace=1 dense layer, interleaved complex rope); the V3-like one has q LoRA, the
sigmoid group-limited MoE after one dense layer, YaRN rope (factor 4, mscale_all_dim 1, so the softmax
scale carries mscale^2) with rope_interleave, and qk_nope_head_dim != v_head_dim.

What is checked, for a left-padded batch of 3 prompts of different lengths (11, 4 and 8 tokens):
  1. transformers' `generate` (eager attention, fp32 model, greedy) gives the reference tokens and the
     logits of every step.
  2. The integration replays those tokens (teacher forcing) q_len at a time: prefill, then decode steps of
     q_len tokens (causal, bottom-right). Its logits of every step must be within the bound of transformers'
     (max |difference|, logits units; the models' logits have a standard deviation of about 3).
     Router flips: the MoE layers pick experts discretely, so where a token's router scores nearly tie,
     the rounding of the cache can make the two runs pick other experts, and that step's logits then
     differ by far more than the rounding. Such steps (found by recording every router's choice in both
     runs) are reported and exempt from the bound; at most 25% of the steps may be such, and in these
     2-layer models the MoE layer is the last one, so a flip changes no later step's cache.
  3. The integration generates freely (q_len 1); its tokens must equal transformers' up to the first
     disagreement of each request, and that disagreement may only fall on a near-tie: a step where
     transformers' top-2 logits differ by less than 2 x the bound (two paths that each stay within
     the bound can only swap such a pair), or a router flip.
  4. With q_len > 1: one decode step over q_len known tokens gives the logits of q_len single-token
     steps (after MLADecodeHandle.rewind), within the bound.

Bounds (max |logit difference|; set from the rounding of the cache, with margin over what was measured
on the CPU for these models):
  fp32 cache (reference backend only): 2e-3 -- only summation order differs; measured ~1e-5.
  bf16 / fp16 cache: 0.25 -- latent rows rounded to 8 / 11 significant bits (relative 2^-9 / 2^-12);
    measured 0.015-0.022 (bf16), 0.002-0.004 (fp16).
  fp8_e4m3 cache: 1.5 -- 4 significant bits (relative 2^-4 per value) with one k_scale per layer;
    measured 0.25-0.41 outside router flips.
  On CUDA the kernel also rounds q and out to bf16/fp16 (relative 2^-9 / 2^-12), well inside the same
  bounds by the same reasoning; the measured values are printed.

--context N: after the checks, times one decode step of batch --context-batch at N tokens of context:
transformers' eager attention over its DynamicCache against the integration, the models in bf16 on CUDA
(the integration on the kernels). On the CPU it runs too (fp32, the reference backend), as a smoke test
of the timing code only.

Exit status 0 when every check passed, 1 otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's package (and its generated/ + build/)

import torch  # noqa: E402

#: max |logit difference| against transformers' fp32 eager attention, per cache dtype (see the docstring)
LOGIT_BOUNDS = {"fp32": 2e-3, "bf16": 0.25, "fp16": 0.25, "fp8_e4m3": 1.5}
PROMPT_LENS = (11, 4, 8)
#: steps that may route to other experts than transformers' did (their logits are exempt from the bound)
MAX_ROUTER_FLIP_FRACTION = 0.25
VOCAB = 512
HIDDEN = 256


def build_model(arch: str, num_heads: int = 16, seed: int = 0, device: str = "cpu", dtype=torch.float32):
    """A seeded random DeepSeek-V2-Lite-like ('v2') or V3-like ('v3') causal LM (see the module docstring)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512, moe_intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                  kv_lora_rank=512, qk_rope_head_dim=64, first_k_dense_replace=1, n_routed_experts=8,
                  n_shared_experts=1, num_experts_per_tok=2, max_position_embeddings=16384, rms_norm_eps=1e-6,
                  pad_token_id=0, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    if arch == "v2":
        config = DeepseekV2Config(**common, q_lora_rank=None, qk_nope_head_dim=64, v_head_dim=32,
                                  topk_method="greedy", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cls = DeepseekV2ForCausalLM
    elif arch == "v3":
        config = DeepseekV3Config(**common, q_lora_rank=96, qk_nope_head_dim=32, v_head_dim=48, n_group=2,
                                  topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
                                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                   "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
        cls = DeepseekV3ForCausalLM
    else:
        raise ValueError(f"arch: expected 'v2' or 'v3', got {arch!r}")
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # unit-variance activations, norms with non-trivial weights, logits std ~3
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                gain = 3.0 if name.endswith("lm_head.weight") else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * gain / p.shape[-1] ** 0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model.to(device=device, dtype=dtype).eval()


def make_prompts(lens=PROMPT_LENS, seed: int = 0, device: str = "cpu"):
    """Left-padded random prompts: (input_ids [batch, max_len], attention_mask [batch, max_len])."""
    g = torch.Generator().manual_seed(seed + 1)
    width = max(lens)
    ids = torch.zeros(len(lens), width, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for b, n in enumerate(lens):
        ids[b, width - n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[b, width - n:] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model, ids, mask, new_tokens: int):
    """transformers' greedy generate: (tokens [batch, new_tokens], logits [batch, new_tokens, vocab] fp32)."""
    from transformers import GenerationConfig
    cfg = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                           bos_token_id=None, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, generation_config=cfg)
    tokens = out.sequences[:, ids.shape[1]:]
    return tokens, torch.stack(out.logits, dim=1).float()


@dataclass
class Report:
    arch: str
    kv_dtype: str      # "fp8_e4m3/fast" for the fast fp8 mode
    page_size: int
    q_len: int
    num_heads: int
    bound: float
    max_logit_err: float = float("nan")   # teacher-forced steps against transformers
    spec_err: float | None = None         # q_len-token step against q_len single steps
    near_ties: list = field(default_factory=list)      # (request, step, transformers' top-2 gap)
    router_flips: list = field(default_factory=list)   # (request, step) routed to other experts
    problems: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def line(self) -> str:
        spec = "" if self.spec_err is None else f" spec_err={self.spec_err:.2e}"
        ties = f" near_ties={self.near_ties}" if self.near_ties else ""
        ties += f" router_flips={self.router_flips}" if self.router_flips else ""
        return (f"{'PASS' if self.ok else 'FAIL'} {self.arch} heads={self.num_heads} page={self.page_size} "
                f"kv={self.kv_dtype} q_len={self.q_len}: max|dlogit|={self.max_logit_err:.2e} (bound {self.bound})"
                f"{spec}{ties} [{self.seconds:.1f}s]" + "".join(f"\n    {p}" for p in self.problems))


class RoutingRecorder:
    """Records the experts every MoE router (transformers' *TopkRouter modules) picks, one entry per model
    call: [moe_layers, tokens, top_k] (sorted ids). Routing is discrete: two runs whose hidden states differ
    by rounding can pick different experts for a token whose router scores nearly tie, and that token's
    logits then differ by far more than the rounding (a "router flip")."""

    def __init__(self, model):
        self.calls, self._current = [], []
        self._hooks = [m.register_forward_hook(self._hook) for m in model.modules()
                       if type(m).__name__.endswith("TopkRouter")]
        self.num_layers = len(self._hooks)

    def _hook(self, module, args, output):
        self._current.append(output[-1].sort(dim=-1).values.detach().cpu())

    def take(self) -> torch.Tensor:
        """The routing of the model call(s) since the last take: [moe_layers, tokens, top_k]."""
        out = torch.stack(self._current) if self._current else torch.zeros(0, 0, 0, dtype=torch.long)
        self._current = []
        return out

    def clear(self) -> None:
        self._current = []

    def close(self):
        for h in self._hooks:
            h.remove()


def per_step(routing: torch.Tensor, batch: int, tokens: int, keep: slice) -> torch.Tensor:
    """[batch, steps, moe_layers * top_k] from one call's routing [moe_layers, batch * tokens, top_k]."""
    layers = routing.shape[0]
    return routing.view(layers, batch, tokens, -1)[:, :, keep].permute(1, 2, 0, 3).reshape(batch, -1, layers * routing.shape[-1])


def teacher_forced(handle, ids, mask, tokens, q_len: int, recorder=None):
    """The integration's logits [batch, new_tokens, vocab] (fp32) when fed `tokens` q_len at a time after
    prefill, and (with a RoutingRecorder) the experts of each step [batch, new_tokens, moe_layers * top_k]."""
    batch, total = tokens.shape
    steps = [handle.prefill(ids, mask)[:, -1]]
    routes = [per_step(recorder.take(), batch, ids.shape[1], slice(-1, None))] if recorder else []
    fed = 0
    while len(steps) < total:
        n = min(q_len, total - len(steps))
        out = handle.decode(tokens[:, fed:fed + n])
        steps.extend(out.unbind(dim=1))
        if recorder:
            routes.append(per_step(recorder.take(), batch, n, slice(None)))
        fed += n
    return torch.stack(steps, dim=1).float(), (torch.cat(routes, dim=1) if recorder else None)


def hf_routing(model, ids, mask, tokens, recorder) -> torch.Tensor:
    """transformers' experts of each generated step [batch, new_tokens, moe_layers * top_k]: one forward of
    prompt + tokens[:, :-1] (the step-t logits come from the token before it)."""
    full = torch.cat([ids, tokens[:, :-1]], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, :-1])], dim=1)
    recorder.clear()
    with torch.no_grad():
        model(input_ids=full, attention_mask=full_mask, position_ids=(full_mask.cumsum(1) - 1).clamp_min(0))
    return per_step(recorder.take(), full.shape[0], full.shape[1], slice(ids.shape[1] - 1, None))


def run_check(arch: str = "v2", *, device: str = "cpu", page_size: int = 16, kv_dtype: str = "bf16",
              q_len: int = 1, num_heads: int = 16, new_tokens: int = 8, seed: int = 0, model=None,
              baseline=None, fp8_mode: str = "exact") -> Report:
    """Checks 1-4 of the module docstring for one configuration; returns a Report (report.ok).
    `model` and `baseline` (hf_generate's result for make_prompts) may be passed in to reuse them.
    fp8_mode ("exact" or "fast") is enable_mla_decode's, for fp8 caches; both are held to the fp8 bound."""
    from mla_variants.integrations.transformers import enable_mla_decode
    start = time.perf_counter()
    bound = LOGIT_BOUNDS[kv_dtype]
    rep = Report(arch, kv_dtype + ("/fast" if fp8_mode == "fast" else ""), page_size, q_len, num_heads, bound)
    model = model if model is not None else build_model(arch, num_heads, seed, device)
    ids, mask = make_prompts(seed=seed, device=device)
    tokens, ref_logits = baseline if baseline is not None else hf_generate(model, ids, mask, new_tokens)
    batch, new_tokens = tokens.shape
    recorder = RoutingRecorder(model)
    try:
        ref_routes = hf_routing(model, ids, mask, tokens, recorder)
        with enable_mla_decode(model, max_batch=batch, max_seq_len=ids.shape[1] + new_tokens + q_len,
                               page_size=page_size, kv_dtype=kv_dtype, fp8_mode=fp8_mode) as handle:
            # 2. teacher forcing, q_len tokens per decode step
            logits, routes = teacher_forced(handle, ids, mask, tokens, q_len, recorder)
            flipped = (routes != ref_routes).any(dim=-1).to(logits.device)           # [batch, steps]
            rep.router_flips = [tuple(x) for x in flipped.nonzero().tolist()]
            if len(rep.router_flips) > MAX_ROUTER_FLIP_FRACTION * flipped.numel():
                rep.problems.append(f"{len(rep.router_flips)} of {flipped.numel()} steps routed to other experts "
                                    f"than transformers' (at most {MAX_ROUTER_FLIP_FRACTION:.0%} may)")
            err = (logits - ref_logits).abs().amax(dim=-1).masked_fill(flipped, 0.0)  # [batch, steps]
            rep.max_logit_err = float(err.max())
            if not rep.max_logit_err <= bound:
                b, t = divmod(int(err.argmax()), new_tokens)
                rep.problems.append(f"logits differ by {rep.max_logit_err:.3g} > {bound} (request {b}, step {t})")
            # 3. free-running greedy generation: the first disagreement only at a near-tie or a router flip
            recorder.clear()
            ours = handle.generate(ids, mask, max_new_tokens=new_tokens)
            recorder.clear()
            top2 = ref_logits.topk(2, dim=-1).values
            gap = top2[..., 0] - top2[..., 1]
            for b in range(batch):
                diff = (ours[b] != tokens[b]).nonzero()
                if diff.numel():
                    t = int(diff[0, 0])
                    if gap[b, t] < 2 * bound or bool(flipped[b, t]):
                        rep.near_ties.append((b, t, round(float(gap[b, t]), 4)))
                    else:
                        rep.problems.append(f"request {b} step {t}: token {int(ours[b, t])} != transformers' "
                                            f"{int(tokens[b, t])} with a top-2 gap of {float(gap[b, t]):.3g} >= "
                                            f"{2 * bound} and the same experts")
            # 4. one step of q_len known tokens == q_len single steps
            if q_len > 1:
                handle.prefill(ids, mask)
                multi = handle.decode(tokens[:, :q_len]).float()
                handle.rewind(q_len)
                single = torch.stack([handle.decode(tokens[:, i:i + 1])[:, 0] for i in range(q_len)], dim=1).float()
                rep.spec_err = float((multi - single).abs().max())
                if not rep.spec_err <= bound:
                    rep.problems.append(f"a q_len={q_len} step differs from {q_len} single steps by "
                                        f"{rep.spec_err:.3g} > {bound}")
    finally:
        recorder.close()
    rep.seconds = time.perf_counter() - start
    return rep


def time_decode(arch: str, num_heads: int, page_size: int, kv_dtype: str, context: int, batch: int,
                steps: int = 20, seed: int = 0, device: str = "cuda", fp8_mode: str = "exact") -> str:
    """Median decode-step time (ms) at `context` tokens of context: transformers' eager attention over its
    DynamicCache against the integration, same model (bf16 on CUDA, where the integration runs the kernels;
    fp32 on the CPU, where it runs the fp32 reference, so only CUDA times mean anything)."""
    from transformers import DynamicCache

    from mla_variants.integrations.transformers import enable_mla_decode
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(arch, num_heads, seed, device, dtype)
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(1, VOCAB, (batch, context), generator=g).to(device)
    step_ids = torch.randint(1, VOCAB, (batch, steps + 3), generator=g).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for i in range(steps + 3):
            sync()
            t0 = time.perf_counter()
            fn(step_ids[:, i:i + 1])
            sync()
            if i >= 3:   # the first steps warm up (allocations, plans)
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        hf_ms = timed(lambda t: model(input_ids=t, past_key_values=cache, use_cache=True))
        cache = None   # frees transformers' cache before the integration allocates its own
        if device == "cuda":
            torch.cuda.empty_cache()
        with enable_mla_decode(model, max_batch=batch, max_seq_len=context + steps + 8, page_size=page_size,
                               kv_dtype=kv_dtype, fp8_mode=fp8_mode) as handle:
            handle.prefill(ids)
            ours_ms = timed(handle.decode)
            backend = handle.backend
    return (f"decode step, {arch} heads={num_heads} batch={batch} context={context} ({dtype} model, 2 layers, "
            f"median of {steps}): transformers eager {hf_ms:.3f} ms, integration ({backend}, page {page_size}, "
            f"{kv_dtype}{'/fast' if fp8_mode == 'fast' else ''} cache) {ours_ms:.3f} ms")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=["v2", "v3", "both"], default="both")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=sorted(LOGIT_BOUNDS), default="bf16")
    p.add_argument("--fp8-mode", choices=["exact", "fast"], default="exact",
                   help="fp8 caches: exact (fp16 math) or fast (fp8 tensor cores above 32 heads; exact at 32 or fewer)")
    p.add_argument("--q-len", type=int, default=1, help="tokens per decode step (1..8 on CUDA)")
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=0, help="time a decode step at this many tokens of context (meaningful on CUDA)")
    p.add_argument("--context-batch", type=int, default=2,
                   help="requests in the timed batch (transformers' eager prefill holds batch x heads x context^2 scores)")
    args = p.parse_args(argv)
    for name, value, lo in (("--page-size", args.page_size, 1), ("--num-heads", args.num_heads, 1),
                            ("--new-tokens", args.new_tokens, 1), ("--context", args.context, 0),
                            ("--context-batch", args.context_batch, 1)):
        if value < lo:
            p.error(f"{name}: expected an int >= {lo}, got {value}")
    if not 1 <= args.q_len <= args.new_tokens or (args.device == "cuda" and args.q_len > 8):
        p.error(f"--q-len: expected 1..--new-tokens ({args.new_tokens}){' and at most 8 on CUDA' if args.device == 'cuda' else ''}, "
                f"got {args.q_len}")
    if HIDDEN % args.num_heads:  # transformers requires the hidden size to be a multiple of the head count
        p.error(f"--num-heads: expected a divisor of the models' hidden size {HIDDEN}, got {args.num_heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA GPU", file=sys.stderr)
        return 1
    if args.fp8_mode == "fast" and args.kv_dtype != "fp8_e4m3":
        p.error(f"--fp8-mode fast: expected --kv-dtype fp8_e4m3, got {args.kv_dtype}")
    if args.kv_dtype == "fp32" and args.device == "cuda":
        print("--kv-dtype fp32 runs on the reference backend only (use --device cpu)", file=sys.stderr)
        return 1
    ok = True
    for arch in (["v2", "v3"] if args.arch == "both" else [args.arch]):
        rep = run_check(arch, device=args.device, page_size=args.page_size, kv_dtype=args.kv_dtype, q_len=args.q_len,
                        num_heads=args.num_heads, new_tokens=args.new_tokens, seed=args.seed, fp8_mode=args.fp8_mode)
        print(rep.line(), flush=True)
        ok &= rep.ok
    if args.context:
        for arch in (["v2", "v3"] if args.arch == "both" else [args.arch]):
            print(time_decode(arch, args.num_heads, args.page_size, args.kv_dtype, args.context, args.context_batch,
                              device=args.device, fp8_mode=args.fp8_mode), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
