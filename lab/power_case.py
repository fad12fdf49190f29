"""SM clock, board power and energy per call of one decode case under sustained CUDA-graph replay.

    python lab/power_case.py HEADS BATCH SEQ PAGE [--fp8] [--seconds 4] [--gemm]

Why: on long 128-head calls our graph time is 5-21% above the cold time (docs/performance.md, "CUDA-graph
time above cold"), which points at the power cap. This replays a graph of the case for --seconds while
`nvidia-smi` samples clocks.sm and power.draw every 50 ms, and prints the call time, the median clock and
power over the second half of the replay (after the clock has settled), and the energy per call in mJ.
With --gemm it does the same for a bf16 matmul of about the same FLOPs per call, as a tensor-core
reference for the clock a saturating kernel gets under the cap.
"""
import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package
from mla_variants import mla_decode  # noqa: E402
from mla_variants.testing import capture_graph  # noqa: E402


def sample_while(graph, seconds: float) -> tuple[float, list[tuple[float, float]]]:
    """Replays `graph` for `seconds`; returns (us per replay, [(clock MHz, power W)]), both over the
    second half only, after the clock has settled under the power cap."""
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "50"], stdout=subprocess.PIPE, text=True)
    start = time.perf_counter()
    mark, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays, marked, half_start = 0, None, None
    while time.perf_counter() - start < seconds:
        graph.replay()
        replays += 1
        if replays % 8 == 0:
            torch.cuda.synchronize()
            if marked is None and time.perf_counter() - start >= seconds / 2:
                mark.record()
                marked, half_start = replays, time.perf_counter()
    end.record()
    torch.cuda.synchronize()
    half_end = time.perf_counter()
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    if marked is None or replays == marked:
        raise SystemExit(f"--seconds {seconds} is too short for this case")
    us = mark.elapsed_time(end) * 1e3 / (replays - marked)
    # nvidia-smi's samples are spread evenly over the replay: keep those of its second half.
    frac = (half_end - half_start) / (half_end - start)
    samples = []
    for line in lines[int(len(lines) * (1 - frac)):]:
        try:
            _, clock, power = line.split(",")
            samples.append((float(clock), float(power)))
        except ValueError:
            continue
    return us, samples


def report(name: str, calls_per_replay: int, us: float, samples: list[tuple[float, float]]) -> None:
    per_call = us / calls_per_replay
    if not samples:
        print(f"{name}: {per_call:.1f} us/call (no nvidia-smi samples)")
        return
    clock = statistics.median(s[0] for s in samples)
    power = statistics.median(s[1] for s in samples)
    print(f"{name}: {per_call:.1f} us/call, SM clock {clock:.0f} MHz, power {power:.0f} W, "
          f"{power * per_call * 1e-3:.2f} mJ/call ({len(samples)} samples)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("heads", "batch", "seq", "page"):
        p.add_argument(name, type=int)
    p.add_argument("--fp8", choices=("exact", "fast"), help="an e4m3 cache (k_scale 0.5) in this fp8 mode")
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--calls", type=int, default=10, help="decode calls per graph replay")
    p.add_argument("--gemm", action="store_true")
    a = p.parse_args()
    pages = a.batch * ((a.seq + a.page - 1) // a.page)
    kv = (torch.randn(pages + 8, a.page, 576, device="cuda") * 0.1).to(torch.bfloat16)
    table = torch.randperm(pages + 8, device="cuda")[:pages].view(a.batch, -1).int()
    lens = torch.full((a.batch,), a.seq, dtype=torch.int32, device="cuda")
    q = (torch.randn(a.batch, 1, a.heads, 576, device="cuda") * 0.1).to(torch.bfloat16)
    extra = {}
    if a.fp8:
        kv, extra = (kv.float() / 0.5).to(torch.float8_e4m3fn), {"k_scale": 0.5, "fp8_mode": a.fp8}
    graph = capture_graph(lambda: [mla_decode(q, kv, table, lens, 0.07, **extra) for _ in range(a.calls)])
    us, samples = sample_while(graph, a.seconds)
    flops = 2 * a.heads * a.batch * a.seq * (576 + 512)
    tflops = flops / (us / a.calls) * 1e-6
    report(f"decode {a.heads}x{a.batch}x{a.seq} p{a.page}{' fp8 ' + a.fp8 if a.fp8 else ''} ({tflops:.0f} TFLOP/s)",
           a.calls, us, samples)
    if a.gemm:
        n = max(1024, round((flops / 2) ** (1 / 3) / 256) * 256)
        x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        graph = capture_graph(lambda: [x @ y for _ in range(a.calls)])
        us, samples = sample_while(graph, a.seconds)
        report(f"gemm {n}^3 bf16 ({2 * n ** 3 / (us / a.calls) * 1e-6:.0f} TFLOP/s)", a.calls, us, samples)


if __name__ == "__main__":
    main()
