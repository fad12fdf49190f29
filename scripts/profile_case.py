"""Run one decode case a few times, for ncu: python scripts/profile_case.py HEADS BATCH SEQ PAGE [SPLITS]
    ncu --clock-control none -k regex:mla_decode_kernel -s 2 -c 1 --section SpeedOfLight ... python scripts/profile_case.py 16 32 16384 64
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/scripts/", 1)[0])
from mla_variants import mla_decode  # noqa: E402


def main() -> None:
    if len(sys.argv) not in (5, 6) or not all(x.isdigit() and int(x) > 0 for x in sys.argv[1:]):
        sys.exit(__doc__.splitlines()[0])
    heads, batch, seq, page = (int(x) for x in sys.argv[1:5])
    splits = int(sys.argv[5]) if len(sys.argv) > 5 else None
    pages = batch * ((seq + page - 1) // page)
    kv = (torch.randn(pages + 8, page, 576, device="cuda") * 0.1).to(torch.bfloat16)
    table = torch.randperm(pages + 8, device="cuda")[:pages].view(batch, -1).int()
    lens = torch.full((batch,), seq, dtype=torch.int32, device="cuda")
    q = (torch.randn(batch, 1, heads, 576, device="cuda") * 0.1).to(torch.bfloat16)
    for _ in range(4):
        mla_decode(q, kv, table, lens, 0.07, num_kv_splits=splits)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
