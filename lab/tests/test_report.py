"""lab/report.py: the README's tables and the issues' target checks from bench.py result files
(CPU: synthetic results)."""
import json

import pytest


@pytest.fixture(scope="module")
def report(lab_module):
    with lab_module("report") as module:
        yield module


def case(heads, batch, seq, page, cold, peer, ragged=False, graph=None, tbps=1.0, tflops=100.0):
    return {"num_heads": heads, "batch": batch, "seq_mean": seq, "page_size": page, "ragged": ragged, "q_len": 1,
            "seq_total": batch * seq, "cold_us": cold, "graph_us": graph or cold * 0.8, "best_us": peer,
            "best_graph_us": peer, "best_peer": "peer", "tbps": tbps, "pct_read": tbps / 4.463 * 100,
            "tflops": tflops, "pct_matmul": tflops / 786 * 100}


def run(cases):
    ratios = [c["best_us"] / c["cold_us"] for c in cases]
    return {"environment": {"date": "d", "git_commit": "c", "gpu": "g"}, "cases": cases,
            "summary": {"cases_run": len(cases), "geomean_peer_over_ours_cold": 1.2, "geomean_peer_over_ours_graph": 1.2,
                        "at_or_below_peer_cold": sum(r >= 1 for r in ratios), "at_or_below_peer_graph": 0,
                        "compared_cold": len(cases)}}


def test_targets_are_judged_from_the_worst_case(report, capsys):
    cases = [case(16, 1, 1024, 64, cold=11.0, peer=20.0, graph=7.5),
             case(16, 1, 1024, 1, cold=12.5, peer=20.0, graph=7.0),  # above 12 us cold: batch-1 target missed
             case(16, 32, 16384, 64, cold=150.0, peer=147.0, tbps=4.35),  # above its peer
             case(128, 32, 16384, 64, cold=270.0, peer=280.0, tflops=700.0)]
    report.bf16_report(run(cases))
    out = capsys.readouterr().out
    assert "| batch 1 x 1024: <= 12 us cold | 11.0-12.5 us | no |" in out
    assert "| batch 1 x 1024: <= 8 us in a graph | 7.0-7.5 us | yes |" in out
    assert "| memory-bound >= 4.3 TB/s, page 64 | 4.35 TB/s | yes |" in out
    assert "| memory-bound >= 4.3 TB/s, page 1 | - TB/s | no |" in out  # no case: not met
    assert "| 128 heads, batch >= 32, seq >= 16384: >= 680 TFLOP/s | 700 | yes |" in out
    assert "| every case at or below the peer (cold) | 3 of 4 | no |" in out
    assert "16x32x16384 p64 0.98" in out.split("Cases above the peer")[1]


def test_fp8_is_set_against_our_bf16_and_the_bf16_peer(report, capsys, tmp_path, monkeypatch):
    bf16 = run([case(16, 32, 4096, 64, cold=50.0, peer=48.0), case(128, 1, 4096, 64, cold=20.0, peer=25.0)])
    fp8 = run([case(16, 32, 4096, 64, cold=26.4, peer=48.0), case(128, 1, 4096, 64, cold=22.0, peer=25.0)])
    (tmp_path / "bf16.json").write_text(json.dumps(bf16))
    (tmp_path / "fp8.json").write_text(json.dumps(fp8))
    monkeypatch.setattr("sys.argv", ["report.py", str(tmp_path / "bf16.json"), "--fp8", str(tmp_path / "fp8.json")])
    report.main()
    out = capsys.readouterr().out
    assert "| memory-bound shapes: <= 0.55x the best bf16 peer | 16 heads | 0.55x" in out
    assert "| fp8 / our bf16 (geomean; batch 1 range) | 128 heads | 1.100 (1.10) |" in out
