#!/usr/bin/env python3
"""Error model of fp8 tensor-core MLA decode, emulated in fp32 on the CPU (no GPU needed).

The exact fp8 mode widens the e4m3 cache to fp16 and does 16-bit math, so its only rounding beyond the
cache itself is q's and P's 16-bit rounding. A fast mode runs the wgmmas in e4m3, which rounds q and P
to 3 mantissa bits, and Hopper's fp8 wgmma adds its products into an accumulator that keeps fewer bits
than fp32 (about 14, DeepSeek-V3 technical report, arXiv:2412.19437, section 3.3.2). This script
emulates the candidate designs on the benchmark's inputs (q and the cache's real values N(0, 0.1^2),
the cache stored as e4m3 of real / k_scale, softmax_scale 1/sqrt(192)) and prints the max abs error of
out and lse against the fp32 reference over the dequantized cache, the measure the anchors file
records for each peer.

    python lab/fp8_fast_error_model.py [--heads 16 128] [--seq 4096 16384] [--requests 2] [--designs ...]

Designs (each a combination of the switches in `emulate`):
  fork      q in e4m3 with one scale per tensor, all 576 columns e4m3, P in e4m3 unscaled (P <= 1),
            products accumulated in the wgmma accumulator (reduced precision) for the whole row / tile
  fast      q's 512 latent columns in e4m3 with one scale per (token, head); the 64 RoPE columns in
            16-bit (q bf16, K widened exactly); P scaled by 2^8 per row before e4m3; each wgmma group's
            partial (128 of S's reduction, one 64-token tile of O) promoted into fp32 registers
  fast-noP  as fast, without the per-row P scale
  fast-acc  as fast, without the promotion (reduced-precision accumulation across the whole reduction)
  fast-fp32acc  as fast, with an exact fp32 accumulator (what the promotion can at best recover)
  fast-q2   as fast, with q's latent columns as two e4m3 terms (q / s = q8 + q8_lo / 16): two S wgmmas
  s16-pv8   S in 16-bit (q bf16, the cache widened exactly), only P V in e4m3
  fast-lexact   as fast, the row sums from P before its rounding
  fast-center   as fast, with P centred per row and tile: P = c + P', c the row's mean over the tile,
            P' in e4m3 on a per-row power-of-2 scale, O += P' V + c colsum(V); row sums from fp32 P
  fast-center-flat  fast-center for rows whose mean p over the tile exceeds 1/4 only
  fast-center-q2  fast-center with q as two e4m3 terms
  kernel    the fast kernel as built (design.md 3.3): q per (token, head) over all 576 columns, S in one
            accumulator, P x 2^8, row sums before rounding, O^T promoted per tile; 13-bit accumulator
  kernel-unpromoted  kernel with O^T kept in the accumulator (before the promotion)
  kernel-s-promoted  kernel with S promoted per 128 columns as well
  kernel-l2  kernel with out divided by the rounded P's row sums (lse from the unrounded ones)
"""
from __future__ import annotations

import argparse
import math

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
SOFTMAX_SCALE = 1.0 / math.sqrt(192.0)


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to e4m3 (saturating) and back to fp32."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8).float()


def trunc_bits(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Keep `bits` mantissa bits of fp32 values (toward zero), the accumulator model."""
    if bits >= 23:
        return x
    i = x.view(torch.int32)
    mask = ~((1 << (23 - bits)) - 1)
    return (i & mask).view(torch.float32)


def accumulate(a: torch.Tensor, b: torch.Tensor, k_step: int, group: int | None, acc_bits: int) -> torch.Tensor:
    """a [m, k] @ b [k, n] as a wgmma chain: products of k_step columns summed exactly, added into an
    accumulator that keeps acc_bits mantissa bits; with `group`, every `group` columns' partial is added
    into an fp32 total (the promotion), else one accumulator runs over all of k."""
    k = a.shape[1]
    total = torch.zeros(a.shape[0], b.shape[1])
    span = group or k
    for g0 in range(0, k, span):
        acc = torch.zeros_like(total)
        for k0 in range(g0, min(g0 + span, k), k_step):
            acc = trunc_bits(acc + a[:, k0:k0 + k_step] @ b[k0:k0 + k_step], acc_bits)
        total = total + acc
    return total


def emulate(q: torch.Tensor, kv_real: torch.Tensor, k_scale: float, *, q_scale: str, rope16: bool, p_scale: float,
            promote: bool, acc_bits: int, q_terms: int = 1, center: bool | str = False, exact_l: bool | str = False,
            tile: int = 64, promote_s: bool | None = None, o_steps: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: q [heads, 576] (bf16 values as fp32), kv_real [seq, 576] real values. Returns (out
    [heads, 512], lse [heads]) of the emulated kernel. promote: each tile's partial (and S's per 128
    columns) promoted into fp32. promote_s: S's promotion alone (default: as promote). o_steps, without
    promote: O accumulates in the accumulator itself, truncated after each 32-token k-step's add (the
    fast kernel before its promotion); otherwise the tile's product is truncated into O once.
    exact_l: the row sums from P before its rounding (True), from the rounded P that O sums (False),
    or "both": out divided by the rounded P's sum, lse from the unrounded one."""
    promote_s = promote if promote_s is None else promote_s
    cache = e4m3(kv_real / k_scale)                       # what the cache holds
    lat, rope = slice(0, 512), slice(512, 576)
    if q_scale == "tensor":
        sq = q.abs().max().clamp_min(1e-30) / E4M3_MAX * torch.ones(q.shape[0], 1)
    elif q_scale == "token_head_576":                     # per (token, head) over all 576 columns
        sq = q.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    else:                                                 # per (token, head)
        sq = q[:, lat].abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / E4M3_MAX
    cols = lat if rope16 else slice(0, 576)
    if q_scale == "s16":                                  # S in 16-bit: q bf16 times the exactly widened cache
        s = (q[:, cols] @ cache[:, cols].T) * k_scale
    else:
        q8 = e4m3(q[:, cols] / sq)
        s = accumulate(q8, cache[:, cols].T, 32, 128 if promote_s else None, acc_bits) * sq * k_scale
        if q_terms == 2:                                  # q = sq (q8 + q8_lo / 16): a second e4m3 term
            q8_lo = e4m3((q[:, cols] / sq - q8) * 16.0)
            s = s + accumulate(q8_lo, cache[:, cols].T, 32, 128 if promote_s else None, acc_bits) * sq * k_scale / 16.0
    if rope16:
        s = s + (q[:, rope] @ cache[:, rope].T) * k_scale  # 16-bit operands, exact products, fp32 sums
    s = s * SOFTMAX_SCALE
    # Online softmax over 64-token tiles, as the kernel runs it.
    heads, seq = s.shape
    m = torch.full((heads, 1), -math.inf)
    l = torch.zeros(heads, 1)
    l_out = torch.zeros(heads, 1)                         # exact_l "both": the rounded P's sum, for out
    o = torch.zeros(heads, 512)
    for t0 in range(0, seq, tile):
        st = s[:, t0:t0 + tile]
        m_new = torch.maximum(m, st.amax(dim=1, keepdim=True))
        alpha = torch.exp(m - m_new)
        p = torch.exp(st - m_new)
        v = cache[t0:t0 + tile, lat]
        if center:
            # P = c + P' per row: c the row's mean over the tile, P' rounded to e4m3 on a per-row power-of-2
            # scale; O += P' V + c colsum(V) (the column sums of the tile's V in fp32, shared by all rows).
            c = p.mean(dim=1, keepdim=True)
            if center == "flat":  # centre only rows whose mean p exceeds 1/4
                c = torch.where(c > 0.25, c, torch.zeros_like(c))
            d = p - c
            amax = d.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
            sc = torch.exp2(torch.floor(torch.log2(E4M3_MAX / amax)))
            p8 = e4m3(d * sc)
            pv = accumulate(p8, v, 32, tile if promote else None, acc_bits) / sc + c * v.sum(dim=0, keepdim=True)
            l = l * alpha + p.sum(dim=1, keepdim=True)
        else:
            p8 = e4m3(p * p_scale)                        # P as the PV wgmma reads it
            l = l * alpha + (p.sum(dim=1, keepdim=True) if exact_l else p8.sum(dim=1, keepdim=True) / p_scale)
            l_out = l_out * alpha + p8.sum(dim=1, keepdim=True) / p_scale
            if o_steps and not promote:                   # O in the accumulator: every k-step's add truncates
                o = o * alpha
                for k0 in range(0, v.shape[0], 32):
                    o = trunc_bits(o + p8[:, k0:k0 + 32] @ v[k0:k0 + 32] / p_scale, acc_bits)
                m = m_new
                continue
            pv = accumulate(p8, v, 32, tile, acc_bits) / p_scale
        o = o * alpha + pv if promote else trunc_bits(o * alpha + pv, acc_bits)
        m = m_new
    return o / (l_out if exact_l == "both" else l) * k_scale, (m + torch.log(l)).squeeze(1)


def reference(q: torch.Tensor, kv_real: torch.Tensor, k_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    kv = e4m3(kv_real / k_scale).double() * k_scale       # the dequantized cache, in fp64
    s = (q.double() @ kv.T) * SOFTMAX_SCALE
    lse = torch.logsumexp(s, dim=1)
    return (torch.softmax(s, dim=1) @ kv[:, :512]).float(), lse.float()


DESIGNS = {
    "fork": dict(q_scale="tensor", rope16=False, p_scale=1.0, promote=False, acc_bits=14),
    "fast": dict(q_scale="token_head", rope16=True, p_scale=256.0, promote=True, acc_bits=14),
    "fast-noP": dict(q_scale="token_head", rope16=True, p_scale=1.0, promote=True, acc_bits=14),
    "fast-acc": dict(q_scale="token_head", rope16=True, p_scale=256.0, promote=False, acc_bits=14),
    "fast-fp32acc": dict(q_scale="token_head", rope16=True, p_scale=256.0, promote=True, acc_bits=23),
    "fast-q2": dict(q_scale="token_head", rope16=True, p_scale=256.0, promote=True, acc_bits=14, q_terms=2),
    "s16-pv8": dict(q_scale="s16", rope16=True, p_scale=256.0, promote=True, acc_bits=14),
    "fast-lexact": dict(q_scale="token_head", rope16=True, p_scale=256.0, promote=True, acc_bits=14, exact_l=True),
    "fast-center": dict(q_scale="token_head", rope16=True, p_scale=1.0, promote=True, acc_bits=14, center=True),
    "fast-center-flat": dict(q_scale="token_head", rope16=True, p_scale=1.0, promote=True, acc_bits=14, center="flat"),
    "fast-center-q2": dict(q_scale="token_head", rope16=True, p_scale=1.0, promote=True, acc_bits=14, center=True,
                           q_terms=2),
    # The fast kernel as built (design.md 3.3): q per row in e4m3 over all 576 columns, S in one accumulator,
    # P x 2^8, row sums from P before rounding, O^T promoted per tile; the accumulator keeps 13 bits (FP22).
    "kernel": dict(q_scale="token_head_576", rope16=False, p_scale=256.0, promote=True, promote_s=False,
                   acc_bits=13, exact_l=True),
    "kernel-unpromoted": dict(q_scale="token_head_576", rope16=False, p_scale=256.0, promote=False,
                              promote_s=False, acc_bits=13, exact_l=True, o_steps=True),
    "kernel-s-promoted": dict(q_scale="token_head_576", rope16=False, p_scale=256.0, promote=True,
                              promote_s=True, acc_bits=13, exact_l=True),
    # The kernel with out divided by the sum of the rounded P that O^T sums (lse still from the unrounded
    # one): out is then a true weighted mean of V, whatever the cache's mean (--kv-mean).
    "kernel-l2": dict(q_scale="token_head_576", rope16=False, p_scale=256.0, promote=True, promote_s=False,
                      acc_bits=13, exact_l="both"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096])
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--k-scale", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--designs", nargs="+", choices=sorted(DESIGNS), default=list(DESIGNS),
                    help="the designs to emulate (default: all)")
    ap.add_argument("--q-std", type=float, default=0.1,
                    help="q's standard deviation (0.1: the benchmark's flat softmax; 2-4: peaked, most P near 0)")
    ap.add_argument("--kv-mean", type=float, default=0.0,
                    help="mean of the cache's real values (0: the benchmark's; a nonzero mean makes out's columns "
                         "agree in sign over the keys, where truncating accumulators drift most)")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    print(f"max abs error against fp32 over the dequantized cache, {args.requests} requests, q std {args.q_std}, "
          f"cache mean {args.kv_mean}")
    for heads in args.heads:
        for seq in args.seq:
            worst = {d: [0.0, 0.0] for d in args.designs}
            for _ in range(args.requests):
                q = (torch.randn(heads, 576, generator=g) * args.q_std).bfloat16().float()
                kv_real = (torch.randn(seq, 576, generator=g) * 0.1 + args.kv_mean).bfloat16().float()
                ref_o, ref_l = reference(q, kv_real, args.k_scale)
                for d in args.designs:
                    o, l = emulate(q, kv_real, args.k_scale, **DESIGNS[d])
                    worst[d][0] = max(worst[d][0], (o - ref_o).abs().max().item())
                    worst[d][1] = max(worst[d][1], (l - ref_l).abs().max().item())
            print(f"{heads} heads, {seq} keys:", flush=True)
            for d, w in worst.items():
                print(f"    {d:<15} out {w[0]:.2e}   lse {w[1]:.2e}", flush=True)


if __name__ == "__main__":
    main()
