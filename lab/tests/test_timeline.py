"""lab/timeline.py's grouping of a profiler's device timeline into calls (CPU: synthetic records)."""
import pytest


@pytest.fixture(scope="module")
def timeline(lab_module):
    with lab_module("timeline") as module:
        yield module


def test_split_and_plain_calls_are_measured_from_the_spin(timeline):
    k = [("reduce_kernel", 0.0, 100.0), ("spin_kernel", 100.0, 600.0),
         ("void mla::mla_decode_kernel<...>", 603.0, 620.0), ("void mla::mla_combine_kernel<...>", 622.0, 625.0),
         ("reduce_kernel", 700.0, 800.0), ("spin_kernel", 800.0, 1300.0),
         ("void mla::mla_decode_kernel<...>", 1304.0, 1330.0)]
    calls = timeline.split_calls(k)
    assert calls == [
        {"lead": 3.0, "decode": 17.0, "gap": 2.0, "combine": 3.0, "total": 25.0},
        {"lead": 4.0, "decode": 26.0, "gap": None, "combine": None, "total": 30.0},
    ]


def test_a_combine_without_its_decode_kernel_is_ignored(timeline):
    k = [("void mla::mla_combine_kernel<...>", 0.0, 1.0), ("spin_kernel", 1.0, 2.0)]
    assert timeline.split_calls(k) == []
