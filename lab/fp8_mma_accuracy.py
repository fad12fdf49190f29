"""Would fp8 tensor-core math stay inside issue 5's accuracy bound? A CPU simulation, no kernel.

    python lab/fp8_mma_accuracy.py [--trials N] [--seq 4096] [--heads 16]

Issue 5 allows fp8 matrix instructions (q quantized to e4m3 on the fly) "if accuracy stays inside the
bound" (mla_variants.testing.FP8_TOLERANCE). This script computes, in fp32 on the CPU, what each
design's tensor-core inputs would be and compares the result with the fp32 reference on the
dequantized cache, using the GPU tests' inputs (cache written with quantize_kv at several k_scale
values, q ~ N(0, q_std^2) in bf16):

  fp16-widen   today's kernel: cache widened to fp16 (exact), q rounded to fp16 after a 2^-8 scale
  s-fp8        S = Q K^T with q quantized to e4m3 per query row (scale amax/448), K e4m3 as stored;
               P V as today (P rounded to fp16, V exact)
  s-fp8-rope16 as s-fp8, but the 64 RoPE columns of q and K kept in fp16 (two wgmma, summed)
  s-fp8+pv-fp8 as s-fp8, and P quantized to e4m3 (scale 448, P in [0, 1]) for an fp8 P V

The wgmma accumulates in fp32, so fp32 matmuls on the rounded inputs model it (accumulation order
aside). Prints, per design, how many trials pass FP8_TOLERANCE and the worst out / lse errors.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from mla_variants.fp8 import FP8_DTYPE, FP8_MAX, quantize_kv  # noqa: E402
from mla_variants.testing import FP8_TOLERANCE, compare  # noqa: E402

LATENT = 512


def _e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one scale per row (amax / 448), returned dequantized in fp32."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    return (x / scale).to(FP8_DTYPE).float() * scale


def _fp16_prescaled(q: torch.Tensor) -> torch.Tensor:
    return (q.float() * 2.0**-8).to(torch.float16).float() * 2.0**8


def _attend(s: torch.Tensor, v: torch.Tensor, p_round) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(s) v with P rounded by p_round before the multiply, normalized in fp32 (as the kernel's
    1 / row sum); returns (out [heads, 512], lse [heads], natural log)."""
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    out = p_round(p) @ v / denom
    return out, (m + denom.log()).squeeze(-1)


def run(trials: int, seq: int, heads: int, q_std: float, seed: int) -> dict[str, list]:
    g = torch.Generator().manual_seed(seed)
    designs = {name: [] for name in ("fp16-widen", "s-fp8", "s-fp8-rope16", "s-fp8+pv-fp8")}
    for t in range(trials):
        k_scale = (0.0625, 1.0, 37.5)[t % 3]
        real = torch.randn(seq, 576, generator=g) * 0.1
        kv = quantize_kv(real, k_scale)                    # what the cache holds
        k = kv.float()                                     # e4m3 values (exact in fp16 and fp32)
        q = (torch.randn(heads, 576, generator=g) * q_std).to(torch.bfloat16).float()
        softmax_scale = 192 ** -0.5
        k_real = k * k_scale
        ref_out, ref_lse = _attend(q @ k_real.T * softmax_scale, k_real[:, :LATENT], lambda p: p)
        fp16 = lambda p: p.to(torch.float16).float()      # noqa: E731  the kernel's 16-bit P
        e4m3_p = lambda p: (p * FP8_MAX).to(FP8_DTYPE).float() / FP8_MAX  # noqa: E731
        q16 = _fp16_prescaled(q)
        q8 = _e4m3_rows(q)
        q8_latent = torch.cat([_e4m3_rows(q[:, :LATENT]), q16[:, LATENT:]], dim=-1)
        s8 = q8 @ k.T  # the same S for both e4m3-q designs
        scores = {"fp16-widen": q16 @ k.T, "s-fp8": s8, "s-fp8-rope16": q8_latent @ k.T, "s-fp8+pv-fp8": s8}
        for name, s in scores.items():
            out, lse = _attend(s * (k_scale * softmax_scale), k[:, :LATENT],
                               e4m3_p if name == "s-fp8+pv-fp8" else fp16)
            out = out * k_scale
            problems = compare(out.to(torch.bfloat16)[None, None], lse[None, :, None], ref_out[None, None],
                               ref_lse[None, :, None], **FP8_TOLERANCE)
            err = (out - ref_out).abs().max().item()
            cos = 1 - torch.nn.functional.cosine_similarity(out.flatten(), ref_out.flatten(), dim=0).item()
            designs[name].append((not problems, err, (lse - ref_lse).abs().max().item(), cos, problems))
    return designs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--q-std", type=float, nargs="+", default=[0.1, 1.0, 10.0],
                    help="q standard deviations to try (the tests use 0.1; large q sharpens softmax)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"seq {args.seq}, {args.heads} heads, k_scale cycling 0.0625/1/37.5, tolerance {FP8_TOLERANCE}")
    for q_std in args.q_std:
        print(f"\nq_std {q_std}")
        print(f"{'design':<14} {'pass':>7} {'max |out err|':>14} {'max |lse err|':>14} {'max 1-cos':>10}  first failure")
        for name, rows in run(args.trials, args.seq, args.heads, q_std, args.seed).items():
            ok = sum(r[0] for r in rows)
            fail = next((r[4] for r in rows if not r[0]), [])
            print(f"{name:<14} {ok:>3}/{len(rows):<3} {max(r[1] for r in rows):>14.3e} {max(r[2] for r in rows):>14.3e} "
                  f"{max(r[3] for r in rows):>10.2e}  {'; '.join(fail)[:90]}")


if __name__ == "__main__":
    main()
