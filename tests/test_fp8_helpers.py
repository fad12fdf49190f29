"""fp8 (e4m3) cache helpers and the reference on a dequantized cache (CPU)."""
import pytest
import torch

from mla_variants import mla_decode_reference
from mla_variants.fp8 import (FP8_DTYPE, FP8_NAN_BYTE, dequantize_kv, quantize_kv, slot_mapping_for,
                              write_kv_cache)
from mla_variants.testing import make_paged_case


@pytest.mark.parametrize("k_scale", [0.0625, 1.0, 37.5])
def test_round_trip_error_is_e4m3_rounding(k_scale):
    real = torch.randn(1000, 576) * 3 * k_scale
    back = dequantize_kv(quantize_kv(real, k_scale), k_scale)
    rel = ((back - real).abs() / real.abs().clamp_min(1e-3 * k_scale)).median()
    assert rel < 2 ** -4  # 3 mantissa bits: half an ulp is 2^-4 relative
    assert torch.isfinite(back).all()


def test_saturates_instead_of_nan_and_nan_byte():
    q = quantize_kv(torch.tensor([1e6, -1e6, 447.0, 0.0]), 1.0)
    assert q.float().tolist() == [448.0, -448.0, 448.0, 0.0]
    assert torch.isnan(torch.tensor([FP8_NAN_BYTE], dtype=torch.uint8).view(FP8_DTYPE).float()).all()


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan"), "x", "2", True, 1e-300, 1e300])
def test_bad_scale(bad):
    with pytest.raises(ValueError, match="k_scale"):
        quantize_kv(torch.ones(3), bad)


def test_write_kv_cache_appends_through_the_slot_mapping():
    case = make_paged_case([5, 17], 2, 8, 1, torch.float32, device="cpu", generator=torch.Generator().manual_seed(0))
    cache = torch.full((case.kv_cache.shape[0], 8, 576), FP8_NAN_BYTE, dtype=torch.uint8).view(FP8_DTYPE)
    # write every token of both requests one position at a time, as decode steps would
    for pos in range(17):
        positions = torch.tensor([pos if pos < 5 else -1, pos])
        slots = slot_mapping_for(case.block_table, positions, 8)
        rows = torch.stack([case.kv_cache.view(-1, 576)[max(int(s), 0)] for s in slots])
        write_kv_cache(cache, slots, rows, k_scale=0.5)
    ref = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale)
    got = mla_decode_reference(case.q, cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=0.5)
    assert torch.isfinite(got[0]).all()
    rel = ((got[0] - ref[0]).norm() / ref[0].norm()).item()
    assert 1e-4 < rel < 2 ** -4, rel  # e4m3 rounding of K and V, nothing more (and not nothing)
    torch.testing.assert_close(got[1], ref[1], atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="k_scale: required"):
        write_kv_cache(cache, torch.tensor([0]), torch.zeros(1, 576))
    with pytest.raises(ValueError, match="slot_mapping: expected slots below"):
        write_kv_cache(cache, torch.tensor([10**6]), torch.zeros(1, 576), k_scale=1.0)
    with pytest.raises(ValueError, match="new_kv: expected shape"):
        write_kv_cache(cache, torch.tensor([0]), torch.zeros(1, 512), k_scale=1.0)
    with pytest.raises(ValueError, match="k_scale: only for a float8_e4m3fn cache"):
        write_kv_cache(case.kv_cache.to(torch.bfloat16), torch.tensor([0]), torch.zeros(1, 576), k_scale=1.0)
    with pytest.raises(ValueError, match="kv_cache: expected dtype bf16, fp16 or torch.float8_e4m3fn"):
        write_kv_cache(case.kv_cache, torch.tensor([0]), torch.zeros(1, 576))  # fp32: no kernel reads it
    with pytest.raises(ValueError, match="k_scale: required"):
        mla_decode_reference(case.q, cache, case.block_table, case.seq_lens, case.softmax_scale)


def test_write_into_a_layer_view_of_a_larger_buffer():
    layers = torch.zeros(3, 4, 16, 576, dtype=torch.uint8).view(FP8_DTYPE)
    layer = layers[1]
    new = torch.randn(2, 576)
    write_kv_cache(layer, torch.tensor([5, 37]), new, k_scale=2.0)
    assert torch.equal(layers[1, 0, 5], quantize_kv(new[0], 2.0)) and torch.equal(layers[1, 2, 5], quantize_kv(new[1], 2.0))
    assert layers[0].float().abs().sum() == 0 and layers[2].float().abs().sum() == 0


@pytest.mark.parametrize("k_scale", [0.0625, 37.5])
def test_fp8_cases_are_poisoned_with_the_nan_byte_and_dequantize_right(k_scale):
    from mla_variants.testing import FP8_TOLERANCE, compare
    case = make_paged_case([3, 40], 2, 16, 2, torch.float8_e4m3fn, device="cpu", kv_std=0.1 * k_scale,
                           k_scale=k_scale, generator=torch.Generator().manual_seed(5))
    assert case.kv_cache.dtype == FP8_DTYPE and case.q.dtype == torch.bfloat16 and case.k_scale == k_scale
    raw = case.kv_cache.view(torch.uint8)
    page0 = case.block_table[0, 0].long()
    assert (raw[page0, 3:] == FP8_NAN_BYTE).all() and not (raw[page0, :3] == FP8_NAN_BYTE).any()
    out, lse = mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale,
                                    k_scale=case.k_scale)
    assert torch.isfinite(out).all()
    real = dequantize_kv(case.kv_cache, k_scale)  # the fp8 reference is the reference on the dequantized cache
    ref = mla_decode_reference(case.q, real, case.block_table, case.seq_lens, case.softmax_scale)
    assert compare(out, lse, *ref, **FP8_TOLERANCE) == []


def test_reference_rejects_k_scale_for_a_bf16_cache():
    case = make_paged_case([3, 40], 2, 16, 1, torch.bfloat16, device="cpu", generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="k_scale: only for a float8_e4m3fn kv_cache"):
        mla_decode_reference(case.q, case.kv_cache, case.block_table, case.seq_lens, case.softmax_scale, k_scale=0.5)


def test_positions_must_match_the_block_table_rows():
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    with pytest.raises(ValueError, match=r"positions: expected an integer tensor of shape \[batch=2\] \(one per "
                                         r"block_table row\), got torch.int64 \(1,\)"):
        slot_mapping_for(table, torch.tensor([0]), 16)
    # break-it findings: float positions were truncated, a position past the table raised torch's IndexError
    with pytest.raises(ValueError, match=r"positions: expected an integer tensor"):
        slot_mapping_for(table, torch.tensor([17.5, 0.0]), 16)
    with pytest.raises(ValueError, match=r"positions: expected positions below max_pages \* page_size = 64 .*got 64 "
                                         r"for request 1"):
        slot_mapping_for(table, torch.tensor([3, 64]), 16)
    with pytest.raises(ValueError, match=r"block_table: expected an integer tensor of shape \[batch, max_pages >= 1\]"):
        slot_mapping_for(table.float(), torch.tensor([3, 4]), 16)


def test_an_unallocated_page_is_named_not_dropped():
    """A position >= 0 whose block_table entry is negative (-1: no page allocated) would give a negative
    slot, which write_kv_cache skips as padding: the token would be lost without a word."""
    table = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table: expected a page id >= 0 for position 20 of request 0, "
                                         r"got block_table\[0, 1\] = -1"):
        slot_mapping_for(table, torch.tensor([20, 5]), 16)
    assert slot_mapping_for(table, torch.tensor([-1, 5]), 16).tolist() == [-1, 37]  # padding stays -1
    for page_size in (0, 2**70):  # 2**70: torch's OverflowError before (break-it finding)
        with pytest.raises(ValueError, match="page_size: expected an int from 1 to 2\\*\\*20"):
            slot_mapping_for(table, torch.tensor([1, 5]), page_size)


def test_helpers_name_an_argument_that_is_not_a_tensor():
    """Break-it findings: a list, None or a meta tensor gave AttributeError or torch's errors."""
    cache = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    table = torch.zeros(2, 4, dtype=torch.int32)
    for call, name in ((lambda: write_kv_cache(cache, [0, 1, 2], torch.randn(3, 576)), "slot_mapping"),
                       (lambda: write_kv_cache(None, torch.tensor([0]), torch.randn(1, 576)), "kv_cache"),
                       (lambda: write_kv_cache(cache, torch.tensor([0]), [[0.0] * 576]), "new_kv"),
                       (lambda: slot_mapping_for(None, torch.tensor([1, 2]), 16), "block_table"),
                       (lambda: slot_mapping_for(table, [1, 2], 16), "positions"),
                       (lambda: slot_mapping_for(table, torch.tensor([1, 2], device="meta"), 16), "positions"),
                       (lambda: quantize_kv([1.0], 1.0), "real"),
                       (lambda: dequantize_kv(None, 1.0), "cache"),
                       (lambda: dequantize_kv(cache.to(torch.float8_e4m3fn), 1.0, dtype="float32"), "dtype")):
        with pytest.raises(ValueError, match=f"^{name}: expected"):
            call()


def test_is_supported_checks_its_numbers():
    """Unbounded num_heads once planned one launch per 128 heads (10**8 heads: seconds and 400 MB)."""
    from mla_variants import MLAInputError, is_supported
    for bad in (10**8, 0, 16.0, True):
        with pytest.raises(MLAInputError, match="num_heads: expected an int from 1 to 2\\*\\*20"):
            is_supported(bad, 64, "bf16")
    with pytest.raises(MLAInputError, match="page_size: expected an int from 1 to 2\\*\\*20"):
        is_supported(16, 64.0, "bf16")
    with pytest.raises(MLAInputError, match="split: expected a bool"):
        is_supported(16, 64, "bf16", split="no")


def test_is_supported_names_an_unknown_dtype():
    from mla_variants import MLAInputError, is_supported
    for bad in ("fp8", torch.float32, None):
        with pytest.raises(MLAInputError, match="dtype: expected torch.bfloat16, torch.float16, torch.float8_e4m3fn"):
            is_supported(16, 64, bad)
