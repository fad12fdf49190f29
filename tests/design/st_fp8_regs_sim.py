"""Host-side design check of the fp8 register path's index math, no GPU.

Mirrors the formulas of templates/mla/layouts.cuh (raw_offset, with the ring's chunk swizzle),
consumer_st_fp8.cuh (the per-thread V^T load offsets v_off, st_token) and epilogue.cuh (merge_st's
float4 merge and store_rows_st's swap) in Python and checks: the precomputed offsets equal raw_offset of
the permuted rows; shared-memory wavefronts per 16-byte warp load (4 = no bank conflict, quarter-warp
model); the float4 merge writes every O value where store_rows_st reads it, and its stores are
conflict-free. It checks the design, not the compiled code: the GPU tests do that.

    python3 tests/design/st_fp8_regs_sim.py
"""
import numpy as np
# ---- (a) raw_offset swizzle: v_off precompute and bank groups (quarter-warp model, 16-byte loads)
def raw_offset(row, chunk): return row*64 + 16*(chunk ^ ((row >> 1) & 3))  # the ring's chunk swizzle
def st_token(k): return k ^ ((k >> 1) & 1)
bad = 0
for tq in range(4):
    v_row = [2*tq + (tq & 1), 2*tq + 1 - (tq & 1), 8 + 2*tq + (tq & 1), 9 + 2*tq - (tq & 1)]
    for g in range(8):
        for k in range(4):
            for r, off in enumerate([0, 1, 8, 9]):
                want = raw_offset(st_token(16*k + 2*tq + off), g % 4)
                got = raw_offset(v_row[r], g % 4) + 1024*k
                bad += want != got
        for r in (0, 1):  # consume_st_regs keeps v_off[0..1] only: rows v_row[r] + 8 are + 512 bytes
            bad += raw_offset(v_row[r + 2], g % 4) != raw_offset(v_row[r], g % 4) + 512
    for tok0 in range(64):
        bad += raw_offset(tok0 + 8, tq) != raw_offset(tok0, tq) + 512 if tok0 + 8 < 64 else 0
print("offset mismatches:", bad)
def wavefronts(addrs):  # 32 lanes of 16-byte loads, processed in quarter warps of 8 lanes
    total = 0
    for qw in range(4):
        groups = {}
        for a in addrs[8*qw:8*qw+8]:
            groups.setdefault((a // 16) % 8, set()).add(a // 128)
        total += max(len(v) for v in groups.values())
    return total
worstK = worstV = 0
for w in range(4):
    for sub_row in (0, 8):
        addrs = [raw_offset(16*w + lane//4 + sub_row, lane % 4) for lane in range(32)]
        worstK = max(worstK, wavefronts(addrs))
    for k in range(4):
        for off in (0, 1, 8, 9):
            addrs = [4096*((2*w + (lane//4)//4) % 2) + raw_offset(st_token(16*k + 2*(lane%4) + off), (lane//4) % 4) for lane in range(32)]
            worstV = max(worstV, wavefronts(addrs))
print(f"worst wavefronts per 512-byte warp load: K {worstK}, V {worstV} (4 = conflict-free)")

# ---- (b) merge_v4 + store_rows_st swap, kRows = 32, 16 and 8 (two warpgroups: 256 threads)
for kRows in (32, 16, 8):
    kCols = kRows // 4; stride = 516
    O = np.random.rand(kRows, 512).astype(np.float32)
    ox = np.full(kRows*stride, np.nan, np.float32)
    st_col_of_index = lambda j, lane: (j >> 1)*8 + 2*(lane % 4) + (j & 1)
    st_col = lambda e, lane: (e >> 2)*8 + 2*(lane % 4) + (e & 1)
    for warp in range(4):
        for lane in range(32):
            # tOrO(e, m) holds O^T row d = st_regs_dim(warp, lane, m, (e>>1)&1), column st_col(e)
            tO = {}
            for e in range(kRows // 2):
                for m in range(8):
                    d = 128*warp + 16*(lane//4) + 2*m + ((e >> 1) & 1)
                    tO[(e, m)] = O[st_col(e, lane), d]
            g = 8*warp + lane//4
            for j in range(kCols):
                e0 = (j >> 1)*4 + (j & 1); e1 = e0 + 2
                n = st_col_of_index(j, lane)
                for q in range(4):
                    v = [tO[(e0, 2*q)], tO[(e1, 2*q)], tO[(e0, 2*q+1)], tO[(e1, 2*q+1)]]
                    base = n*stride + 16*g + 4*(q ^ (g & 1))
                    ox[base:base+4] = v
    # store_rows_st read-back
    err = 0
    for tid in range(256):
        d0 = (tid % 64)*8
        for pas in range(kRows // 4):
            n = pas*4 + tid // 64
            lo = ox[n*stride + d0: n*stride + d0 + 4]; hi = ox[n*stride + d0 + 4: n*stride + d0 + 8]
            if (d0 >> 4) & 1: lo, hi = hi, lo
            err += np.abs(np.concatenate([lo, hi]) - O[n, d0:d0+8]).max() > 0
    # banks of the merge stores (float4): per instruction (fixed warp, j, q)
    worst = 0
    for warp in range(4):
        for j in range(kCols):
            for q in range(4):
                addrs = []
                for lane in range(32):
                    g = 8*warp + lane//4
                    addrs.append(4*(st_col_of_index(j, lane)*stride + 16*g + 4*(q ^ (g & 1))))
                worst = max(worst, wavefronts(addrs))
    print(f"kRows {kRows}: read-back mismatches {err}, worst wavefronts per merge float4 store {worst}")
