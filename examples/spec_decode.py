"""Speculative decoding the way an engine runs it: a batch whose requests verify different numbers of
draft tokens each step, in the varlen layout, from static buffers (and, on the GPU, one CUDA graph).

Usage (from the repository root):

    python examples/spec_decode.py --device cpu                 # the fp32 reference, no GPU needed
    python examples/spec_decode.py --device cuda                # MLADecodePlan.run_varlen, replayed in a CUDA graph
    python examples/spec_decode.py --device cuda --kv-dtype fp8_e4m3 --num-heads 128 --page-size 64

Each step, request b brings q_len_b = 1 + (its draft length) new tokens (0 for an empty slot), so
the step's queries are packed as [total_q_tokens, num_heads, 576] with query_start_loc [batch + 1]
(int32, on the device, from a cumulative sum there). The engine writes the new tokens' latent rows into
the paged cache through a slot mapping (mla_variants.fp8.write_kv_cache), sets seq_lens to include them,
and runs the attention: causal and bottom-right aligned per request, so new token i of a request with
q_len_b tokens sees its first seq_len - (q_len_b - 1 - i) keys. Then it accepts a random prefix of each
draft and rewinds seq_lens past the rejected tokens (their cache slots are simply overwritten later).
Every step's output is checked against mla_decode_reference run per request; the script exits 0 only
if all steps match (fp32 reference: 1e-5; kernels: the library's bf16 / fp8 tolerances).

On the GPU the step's tensors live in buffers sized once (max_batch requests, max_batch x max_q_len
query rows, the pages of max_seq_len tokens), run_varlen allocates nothing, and the attention is
captured once in a CUDA graph and replayed every step with new query_start_loc and seq_lens values,
which is what engines do.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # use this checkout's package (and its generated/ + build/)

import torch  # noqa: E402

from mla_variants import MLADecodePlan, mla_decode_reference, mla_decode_varlen_reference  # noqa: E402
from mla_variants.fp8 import FP8_DTYPE, dequantize_kv, quantize_kv, slot_mapping_for, write_kv_cache  # noqa: E402
from mla_variants.testing import FP8_TOLERANCE, capture_graph, compare  # noqa: E402

HEAD_DIM, V_DIM = 576, 512
SOFTMAX_SCALE = (128 + 64) ** -0.5


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", choices=["bf16", "fp8_e4m3"], default="bf16")
    p.add_argument("--batch", type=int, default=6, help="request slots (the last one stays empty: q_len 0)")
    p.add_argument("--max-draft", type=int, default=3, help="draft tokens per request, 0..max (q_len up to max + 1 <= 8)")
    p.add_argument("--context", type=int, default=300, help="context tokens per request before the first step (ragged around it)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name, v, lo, hi in (("--num-heads", args.num_heads, 1, 128), ("--page-size", args.page_size, 1, 1024),
                            ("--batch", args.batch, 2, 4096), ("--max-draft", args.max_draft, 0, 7),
                            ("--context", args.context, 1, 1 << 20), ("--steps", args.steps, 1, 1000)):
        if not lo <= v <= hi:
            p.error(f"{name}: expected an int from {lo} to {hi}, got {v}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA GPU")
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(args.seed)
    fp8 = args.kv_dtype == "fp8_e4m3"
    kv_dtype = FP8_DTYPE if fp8 else torch.bfloat16
    q_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    k_scale = 0.05 if fp8 else None
    heads, page, batch, max_q_len = args.num_heads, args.page_size, args.batch, args.max_draft + 1

    # Static buffers, sized once: the cache and block table for max_seq_len tokens per request.
    max_seq_len = 2 * args.context + args.steps * max_q_len + page
    pages_per_seq = -(-max_seq_len // page)
    num_pages = batch * pages_per_seq
    cache = torch.zeros(num_pages, page, HEAD_DIM, dtype=torch.uint8 if fp8 else kv_dtype, device=device)
    cache = cache.view(FP8_DTYPE) if fp8 else cache
    block_table = torch.randperm(num_pages, generator=g).view(batch, pages_per_seq).to(torch.int32).to(device)
    seq_lens = torch.zeros(batch, dtype=torch.int32, device=device)
    query_start_loc = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    q_buf = torch.zeros(batch * max_q_len, heads, HEAD_DIM, dtype=q_dtype, device=device)
    out_buf = torch.zeros(batch * max_q_len, heads, V_DIM, dtype=q_dtype, device=device)
    lse_buf = torch.zeros(heads, batch * max_q_len, dtype=torch.float32, device=device)

    # What the check compares with: each request's rows as a dense [max_seq_len, 576] fp32 copy, kept
    # apart from the paged cache (so a wrong slot mapping, position or rewind shows).
    dense = torch.zeros(batch, max_seq_len, HEAD_DIM)

    def write(positions: torch.Tensor, rows: torch.Tensor, owner: torch.Tensor) -> None:
        """Latent rows [n, 576] of tokens at `positions` [n] of requests `owner` [n] into the cache."""
        rows = rows.to(torch.bfloat16)
        slots = slot_mapping_for(block_table[owner], positions, page)
        write_kv_cache(cache, slots, rows, k_scale)
        stored = dequantize_kv(quantize_kv(rows.float(), k_scale), k_scale) if fp8 else rows.float()
        dense[owner.cpu(), positions.cpu()] = stored.cpu()

    # The context: request b holds lens[b] tokens (the last slot is empty).
    lens = [args.context + 37 * b % (args.context // 2 + 1) for b in range(batch - 1)] + [0]
    for b, n in enumerate(lens):
        if n:
            write(torch.arange(n, device=device), torch.randn(n, HEAD_DIM, generator=g).mul_(0.1).to(device),
                  torch.full((n,), b, device=device))
    seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))

    plan = graph = None
    if device.type == "cuda":
        plan = MLADecodePlan(batch, heads, page, q_len=max_q_len, dtype=torch.bfloat16,
                             kv_dtype=FP8_DTYPE if fp8 else None, max_seq_len=max_seq_len, device=device)

        def attention():  # the captured step: reads query_start_loc, seq_lens and q_buf as they are at replay
            plan.run_varlen(q_buf, cache, block_table, seq_lens, SOFTMAX_SCALE, query_start_loc=query_start_loc,
                            out=out_buf, lse=lse_buf, k_scale=k_scale)
        attention()  # one eager step (loads the library, warms the launch) before the capture
        graph = capture_graph(attention)

    ok = True
    for step in range(args.steps):
        q_lens = [int(x) for x in torch.randint(1, max_q_len + 1, (batch,), generator=g)]
        q_lens[-1] = 0                                           # the empty slot
        total = sum(q_lens)
        # The step's new tokens: their queries (packed) and latent rows, written before the attention.
        q_lens_dev = torch.tensor(q_lens, dtype=torch.int32, device=device)
        query_start_loc[1:] = torch.cumsum(q_lens_dev, 0)      # on the device: nothing read back
        owner = torch.repeat_interleave(torch.arange(batch, device=device), q_lens_dev)
        positions = seq_lens.long()[owner] + (torch.arange(total, device=device) - query_start_loc.long()[owner])
        write(positions, torch.randn(total, HEAD_DIM, generator=g).mul_(0.1).to(device), owner)
        seq_lens += q_lens_dev
        q_buf[:total] = torch.randn(total, heads, HEAD_DIM, generator=g).mul_(0.1).to(q_dtype).to(device)
        if graph is not None:
            out_buf.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            out, lse = out_buf[:total], lse_buf[:, :total]
        else:
            out, lse = mla_decode_varlen_reference(q_buf[:total], cache, block_table, seq_lens, SOFTMAX_SCALE,
                                                   query_start_loc=query_start_loc, k_scale=k_scale)
        # Check: each request alone, over its dense rows (pages of one token), through the fp32 reference.
        problems = []
        for b, n in enumerate(q_lens):
            if n == 0:
                continue
            lo, length = int(query_start_loc[b]), int(seq_lens[b])
            ref_o, ref_l = mla_decode_reference(q_buf[lo:lo + n][None].float().cpu(), dense[b, :length, None].contiguous(),
                                                torch.arange(length, dtype=torch.int32)[None],
                                                torch.tensor([length], dtype=torch.int32), SOFTMAX_SCALE)
            tol = FP8_TOLERANCE if fp8 and device.type == "cuda" else (
                {} if device.type == "cuda" else dict(atol=1e-5, rtol=1e-5, lse_atol=1e-5, lse_rtol=1e-5))
            problems += [f"request {b}: {x}" for x in compare(out[lo:lo + n][None].cpu(), lse[:, lo:lo + n][None].cpu(),
                                                              ref_o, ref_l, **tol)]
        ok &= not problems
        # Accept a random prefix of each draft: the first token (the model's own) always, then some drafts.
        accepted = [0 if n == 0 else 1 + int(torch.randint(0, n, (1,), generator=g)) for n in q_lens]
        seq_lens -= torch.tensor([n - a for n, a in zip(q_lens, accepted)], dtype=torch.int32, device=device)
        print(f"step {step}: q_lens {q_lens} (total {total}), accepted {accepted}: "
              f"{'ok' if not problems else 'FAIL ' + '; '.join(problems[:3])}", flush=True)
    backend = "MLADecodePlan.run_varlen in a CUDA graph" if graph is not None else "the fp32 reference"
    print(f"{'PASS' if ok else 'FAIL'}: {args.steps} speculative steps, {heads} heads, page {page}, {args.kv_dtype} "
          f"cache, {backend}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
