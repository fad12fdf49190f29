"""Tensor-parallel MLA decode: one DeepSeek-V3-shaped attention layer with its 128 query heads split over
N ranks (torch.distributed: NCCL on GPUs, gloo on the CPU), checked against the same layer on one rank.

    python examples/tp_decode.py --device cpu --world-size 2          # CPU: gloo, the fp32 reference
    python examples/tp_decode.py --device cuda --world-size 2 --kv-dtype fp8_e4m3 --q-len 2

Rank r owns heads [r * 128 / N, (r + 1) * 128 / N). Every rank holds the replicated latent cache (each
token's [c_kv (512) | k_pe (64)] row, the same on every rank), so each step every rank
  1. projects the step's hidden states: its heads' q (q_a_proj -> RMSNorm -> q_b_proj, its slice of the
     output columns), and the shared latent row (kv_a_proj_with_mqa -> RMSNorm on c_kv, rope on k_pe),
     which it writes into its replica of the paged cache;
  2. absorbs W_UK into q (q_latent[h] = W_UK[h]^T q_nope[h], DeepSeek-V2, arXiv:2405.04434, sec. 2.1.2)
     and runs MLA decode for its heads (mla_decode on the GPU, mla_decode_reference on the CPU);
  3. applies W_UV[h] and its row slice of o_proj (the columns of its heads), and all-reduces (sum) the
     partial outputs: row-parallel o_proj, as Megatron-style engines shard it.
The batch is ragged (requests with different context lengths, already in the cache), runs several
decode steps of q_len new tokens, and every step's output of the TP-N layer must match the TP-1 layer
(the same weights, cache and inputs on one rank) within --atol (relative to the output's scale: only the
order of the all-reduce's sums and the shards' matmuls differs). Prints per-step times of TP-N and TP-1
and the attention's share. On the GPU keep NVLink multicast off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, which this script sets when they are unset).
Exit status 0 when every step matched.
"""
from __future__ import annotations

import argparse
import os
import sys
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mla_variants import mla_decode, mla_decode_reference  # noqa: E402
from mla_variants.fp8 import FP8_DTYPE, slot_mapping_for, write_kv_cache  # noqa: E402

# DeepSeek-V3 attention dimensions (config.json of deepseek-ai/DeepSeek-V3).
HIDDEN, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, HEADS = 7168, 1536, 512, 128, 64, 128, 128
SOFTMAX_SCALE = (NOPE + ROPE) ** -0.5


def make_weights(seed: int, hidden: int) -> dict:
    """The layer's weights (fp32, CPU), seeded: every rank builds the same ones and keeps its slices."""
    g = torch.Generator().manual_seed(seed)
    w = lambda o, i: torch.randn(o, i, generator=g) * i ** -0.5  # noqa: E731
    return {"q_a": w(Q_LORA, hidden), "q_a_norm": 1 + 0.1 * torch.randn(Q_LORA, generator=g),
            "q_b": w(HEADS * (NOPE + ROPE), Q_LORA), "kv_a": w(KV_LORA + ROPE, hidden),
            "kv_a_norm": 1 + 0.1 * torch.randn(KV_LORA, generator=g), "kv_b": w(HEADS * (NOPE + V_DIM), KV_LORA),
            "o": w(hidden, HEADS * V_DIM)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotary embedding over the last dim (64), rotate-half layout, base 10000; positions [...] ints.
    The angles, cos and sin are computed in float64, then rounded to fp32 (float64 for a float64 x; a
    bf16 x is rotated in fp32): a vectorized fp32 cos and a scalar one may differ by an ulp, and the
    CPU layer's cache rows should not depend on which one a process ran."""
    inv = 10000.0 ** (-torch.arange(0, ROPE, 2, dtype=torch.float64, device=x.device) / ROPE)
    ang = positions.to(torch.float64)[..., None] * inv                   # [..., 32]
    wide = torch.promote_types(x.dtype, torch.float32)
    cos, sin = (torch.cat([f] * 2, -1).to(wide) for f in (ang.cos(), ang.sin()))
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = torch.cat([-x[..., ROPE // 2:], x[..., : ROPE // 2]], -1)
    return x * cos + half * sin


class Shard:
    """One rank's part of the layer: heads [h0, h1), their q_b rows, W_UK / W_UV and o_proj columns."""

    def __init__(self, weights: dict, h0: int, h1: int, device, dtype):
        self.h0, self.h1, self.heads = h0, h1, h1 - h0
        to = lambda t: t.to(device, dtype)  # noqa: E731
        self.q_a, self.q_a_norm, self.kv_a, self.kv_a_norm = (to(weights[k]) for k in ("q_a", "q_a_norm", "kv_a", "kv_a_norm"))
        self.q_b = to(weights["q_b"].view(HEADS, NOPE + ROPE, Q_LORA)[h0:h1])                  # [heads, 192, 1536]
        kv_b = weights["kv_b"].view(HEADS, NOPE + V_DIM, KV_LORA)[h0:h1]
        self.w_uk, self.w_uv = to(kv_b[:, :NOPE]), to(kv_b[:, NOPE:])                            # [heads, 128|128, 512]
        self.o = to(weights["o"].view(-1, HEADS, V_DIM)[:, h0:h1])                               # [hidden, heads, 128]

    def latent_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The cache rows [tokens, 576] of hidden states x [tokens, hidden] at positions [tokens]. The fp32
        (CPU) layer computes them wholly in float64 (matmul, norm and RoPE) and rounds once, so every rank
        writes the TP-1 run's rows into its bf16 or fp8 cache replica whatever blocking, thread count or
        vector width the CPU picks (a float64 difference of an ulp would have to fall on a rounding
        boundary; one flipped cache rounding moves the output by about 2e-4 in bf16 and 1e-3 in fp8,
        against the 1e-5 bound; the example prints whether rank 0's replica equals TP-1's)."""
        wide = x.dtype == torch.float32
        kv = x.double() @ self.kv_a.double().T if wide else x @ self.kv_a.T
        rows = torch.cat([rms_norm(kv[:, :KV_LORA], self.kv_a_norm), rope(kv[:, KV_LORA:], positions)], -1)
        return rows.to(x.dtype)

    def query(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """This shard's absorbed queries [tokens, heads, 576] of x [tokens, hidden]."""
        q = torch.einsum("tr,hdr->thd", rms_norm(x @ self.q_a.T, self.q_a_norm), self.q_b)     # [t, heads, 192]
        q_latent = torch.einsum("thn,hnc->thc", q[..., :NOPE], self.w_uk)                        # [t, heads, 512]
        return torch.cat([q_latent, rope(q[..., NOPE:], positions)], -1)

    def output(self, latent_out: torch.Tensor) -> torch.Tensor:
        """This shard's partial o_proj output [tokens, hidden] from the attention's [tokens, heads, 512]."""
        v = torch.einsum("thc,hvc->thv", latent_out, self.w_uv)                                   # [t, heads, 128]
        return torch.einsum("thv,dhv->td", v, self.o)


class Cache:
    """A paged latent cache replica: pages in a seeded permuted order, one block_table row per request."""

    def __init__(self, batch: int, max_len: int, page_size: int, kv_dtype, device, seed: int, k_scale: float | None):
        pages_per = -(-max_len // page_size)
        order = torch.randperm(batch * pages_per, generator=torch.Generator().manual_seed(seed))
        self.block_table = order.view(batch, pages_per).to(device, torch.int32)
        self.kv = torch.zeros(batch * pages_per, page_size, KV_LORA + ROPE, dtype=kv_dtype, device=device)
        self.page_size, self.k_scale = page_size, k_scale

    def write(self, rows: torch.Tensor, req: torch.Tensor, pos: torch.Tensor) -> None:
        """Cache rows [tokens, 576] of requests req [tokens] at positions pos [tokens]."""
        slots = slot_mapping_for(self.block_table[req.long()], pos.long(), self.page_size)
        write_kv_cache(self.kv, slots, rows, self.k_scale)


def attention(shard: Shard, cache: Cache, q: torch.Tensor, seq_lens: torch.Tensor, dtype) -> torch.Tensor:
    """MLA decode of q [batch, q_len, heads, 576] over the cache: the kernels on CUDA, the fp32 reference elsewhere."""
    kw = {"k_scale": cache.k_scale} if cache.kv.dtype == FP8_DTYPE else {}
    if q.is_cuda:
        out, _ = mla_decode(q.to(torch.bfloat16 if cache.kv.dtype == FP8_DTYPE else cache.kv.dtype).contiguous(),
                            cache.kv, cache.block_table, seq_lens, SOFTMAX_SCALE, **kw)
    else:
        out, _ = mla_decode_reference(q, cache.kv, cache.block_table, seq_lens, SOFTMAX_SCALE, **kw)
    return out.to(dtype)


def run_layer(shard: Shard, cache: Cache, args, device, all_reduce) -> tuple[list[torch.Tensor], float, float]:
    """Context, then args.steps decode steps; returns (each step's output [batch, q_len, hidden], the
    median step time in ms over the steps after the first, attention's share of it). Inputs are seeded: every rank and the TP-1 run see the same."""
    g = torch.Generator().manual_seed(args.seed + 1)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    lens = [args.context + 97 * b % (args.context // 2 + 1) for b in range(args.batch)]  # ragged
    ctx_x = torch.randn(sum(lens), args.hidden, generator=g).to(device, dtype)
    req = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)]).to(device)
    pos = torch.cat([torch.arange(n) for n in lens]).to(device)
    cache.write(shard.latent_rows(ctx_x, pos), req, pos)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    outs, step_s, attn_s = [], [], []
    for _ in range(args.steps):
        x = torch.randn(args.batch, args.q_len, args.hidden, generator=g).to(device, dtype)
        positions = seq_lens.long()[:, None] + torch.arange(args.q_len, device=device)[None, :]
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)  # noqa: E731
        sync()
        t0 = time.perf_counter()
        flat_x, flat_pos = x.reshape(-1, args.hidden), positions.reshape(-1)
        step_req = torch.arange(args.batch, device=device).repeat_interleave(args.q_len)
        cache.write(shard.latent_rows(flat_x, flat_pos), step_req, flat_pos)
        seq_lens = seq_lens + args.q_len
        q = shard.query(flat_x, flat_pos).view(args.batch, args.q_len, shard.heads, KV_LORA + ROPE)
        sync()
        t1 = time.perf_counter()
        latent_out = attention(shard, cache, q, seq_lens, dtype)
        sync()
        t2 = time.perf_counter()
        out = shard.output(latent_out.reshape(-1, shard.heads, KV_LORA))
        all_reduce(out)
        sync()
        step_s.append(time.perf_counter() - t0)
        attn_s.append(t2 - t1)
        outs.append(out.view(args.batch, args.q_len, args.hidden).float().cpu())
    # The first step pays for first use (library load, cuBLAS and NCCL set-up): timed are the later ones.
    timed = slice(1, None) if args.steps > 1 else slice(None)
    step_ms, attn_ms = statistics.median(step_s[timed]) * 1e3, statistics.median(attn_s[timed]) * 1e3
    return outs, step_ms, attn_ms / step_ms


def _cache_for(args, device, rank_seed: int) -> Cache:
    kv_dtype = FP8_DTYPE if args.kv_dtype == "fp8_e4m3" else torch.bfloat16
    return Cache(args.batch, args.context * 2 + args.steps * args.q_len + 8, args.page_size, kv_dtype, device, rank_seed,
                 args.k_scale if kv_dtype == FP8_DTYPE else None)


def worker(rank: int, args, tmp: str) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/init",
                            rank=rank, world_size=args.world_size)
    try:
        weights = make_weights(args.seed, args.hidden)
        per = HEADS // args.world_size
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
        shard = Shard(weights, rank * per, (rank + 1) * per, device, dtype)
        cache = _cache_for(args, device, args.seed)
        outs, ms, share = run_layer(shard, cache, args, device, dist.all_reduce)
        if rank == 0:  # a file, not a queue: shared-memory tensors would outlive this process
            torch.save((outs, ms, share, cache.kv.cpu()), os.path.join(tmp, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-size", type=int, default=2, help="ranks (a divisor of 128; on CUDA at most the GPU count)")
    p.add_argument("--kv-dtype", choices=["bf16", "fp8_e4m3"], default="bf16")
    p.add_argument("--q-len", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=256, help="mean context tokens per request (ragged around it)")
    p.add_argument("--steps", type=int, default=3, help="decode steps (all checked; timed: all but the first)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size (DeepSeek-V3: 7168; smaller is faster on a CPU)")
    p.add_argument("--k-scale", type=float, default=0.05, help="fp8 cache scale (cache value x k_scale = real value)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--atol", type=float, default=None, help="max |TP-N - TP-1| / max |TP-1| (default: 1e-5 fp32, 2e-2 bf16)")
    args = p.parse_args(argv)
    if args.world_size < 1 or HEADS % args.world_size:
        p.error(f"--world-size: expected a divisor of {HEADS}, got {args.world_size}")
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < args.world_size):
        p.error(f"--world-size {args.world_size}: this machine has {torch.cuda.device_count() if torch.cuda.is_available() else 0} GPUs")
    for name, v in (("--q-len", args.q_len), ("--batch", args.batch), ("--context", args.context), ("--steps", args.steps),
                    ("--page-size", args.page_size), ("--hidden", args.hidden)):
        if v < 1 or (name == "--q-len" and v > 8):
            p.error(f"{name}: expected an int >= 1{' and <= 8' if name == '--q-len' else ''}, got {v}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.device == "cpu" and sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the hostname resolves to

    # TP-1: the whole layer on one rank, in this process.
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    full = Shard(make_weights(args.seed, args.hidden), 0, HEADS, device, dtype)
    ref_cache = _cache_for(args, device, args.seed)
    ref, ref_ms, ref_share = run_layer(full, ref_cache, args, device, lambda t: None)
    del full

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(args, tmp), nprocs=args.world_size, start_method="spawn")
        outs, ms, share, kv = torch.load(os.path.join(tmp, "rank0.pt"))
    # Every rank writes the same rows into its replica: a cache that differs from TP-1's would explain a
    # mismatch below without a sharding bug, so say so.
    differ = int((kv.view(torch.uint8) != ref_cache.kv.cpu().view(torch.uint8)).sum())
    print(f"rank 0's cache replica vs TP-1's: {'bitwise equal' if differ == 0 else f'{differ} bytes differ'}")
    atol = args.atol if args.atol is not None else (1e-5 if dtype == torch.float32 else 2e-2)
    ok = True
    for step, (a, b) in enumerate(zip(outs, ref)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        good = err <= atol
        ok &= good
        print(f"step {step}: max |TP-{args.world_size} - TP-1| / max |TP-1| = {err:.2e} (bound {atol:g}) {'ok' if good else 'FAIL'}")
    print(f"per decode step ({args.device}, batch {args.batch}, q_len {args.q_len}, context ~{args.context}, "
          f"{args.kv_dtype} cache, page {args.page_size}; median of steps after the first): TP-1 {ref_ms:.2f} ms (attention {100 * ref_share:.0f}%), "
          f"TP-{args.world_size} {ms:.2f} ms (attention {100 * share:.0f}%)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
