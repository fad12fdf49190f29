"""Run one decode case a few times, for ncu: python lab/profile_case.py HEADS BATCH SEQ PAGE [SPLITS] [fp8|fast]
    ncu --clock-control none -k "regex:mla_decode_(fp8_fast_)?kernel" -s 2 -c 1 --section SpeedOfLight ... python lab/profile_case.py 16 32 16384 64
With a trailing `fp8` the cache is float8_e4m3fn (k_scale 0.5) instead of bf16, run in fp8_mode "exact";
with `fast`, the same cache in fp8_mode "fast" (kernel mla_decode_fp8_fast_kernel).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from mla_variants import mla_decode  # noqa: E402


def main() -> None:
    args = sys.argv[1:]
    mode = args[-1] if args and args[-1] in ("fp8", "fast") else None
    args = args[:-1] if mode else args
    if len(args) not in (4, 5) or not all(x.isdigit() and int(x) > 0 for x in args):
        sys.exit(__doc__.splitlines()[0])
    heads, batch, seq, page = (int(x) for x in args[:4])
    splits = int(args[4]) if len(args) > 4 else None
    pages = batch * ((seq + page - 1) // page)
    kv = (torch.randn(pages + 8, page, 576, device="cuda") * 0.1).to(torch.bfloat16)
    table = torch.randperm(pages + 8, device="cuda")[:pages].view(batch, -1).int()
    lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    q = (torch.randn(batch, 1, heads, 576, device="cuda") * 0.1).to(torch.bfloat16)
    extra = {}
    if mode:
        kv = (kv.float() / 0.5).to(torch.float8_e4m3fn)
        extra = {"k_scale": 0.5, "fp8_mode": "fast" if mode == "fast" else "exact"}
    for _ in range(4):
        mla_decode(q, kv, table, lens, 0.07, num_kv_splits=splits, **extra)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
