"""Subprocess half of tests/test_gpu_tma.py: run decode jobs in a fresh process, so that MLA_TMA
(which the library reads once per process, at the first launch) can differ between two runs on the
same inputs.

    python tests/_tma_worker.py JOBS.pt RESULTS.pt

JOBS.pt (torch.save): {"bases": {name: cpu tensor}, "jobs": [job, ...]}; a job is a dict with
q, block_table, seq_lens (cpu tensors), kv (name of a base, size, stride, storage offset: the cache is
that base on the GPU seen through as_strided, so expanded or overlapping views survive the trip),
softmax_scale, num_kv_splits and k_scale (None, or the fp8 cache's scale). RESULTS.pt: {"library": path of the loaded library, "mla_tma": the
MLA_TMA this process saw, "results": per job {"out", "lse"} (cpu) or {"error": "Type: message"}}.
A failing launch is recorded and the next job runs; a crash (e.g. an illegal address) ends the
process with a non-zero status, which the test reports with this process's stderr.
"""
import os
import sys

import torch


def main(jobs_path: str, results_path: str) -> None:
    from mla_variants import _binding
    from mla_variants.testing import PagedCase, run_nan_prefilled

    spec = torch.load(jobs_path)
    bases = {name: t.cuda() for name, t in spec["bases"].items()}
    results = []
    for job in spec["jobs"]:
        name, size, stride, offset = job["kv"]
        kv = bases[name].as_strided(size, stride, offset)
        k_scale = job.get("k_scale")
        case = PagedCase(job["q"].cuda(), kv, job["block_table"].cuda(), job["seq_lens"].cuda(), job["softmax_scale"],
                         k_scale)
        try:
            out, lse = run_nan_prefilled(case, job["num_kv_splits"])
            results.append({"out": out.cpu(), "lse": lse.cpu()})
        except Exception as e:  # noqa: BLE001 - recorded for the test to judge (MLA_TMA=require refusals)
            torch.cuda.synchronize()
            results.append({"error": f"{type(e).__name__}: {e}"})
    torch.save({"library": str(_binding.library().path), "mla_tma": os.environ.get("MLA_TMA"),
                "results": results}, results_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
