"""The split heuristic: how many KV splits a call takes when the caller does not say (flash-decoding's
idea: split the keys when the batch alone cannot fill the GPU). It reads which kernel a variant runs
from the variant's path facts (the build's manifest), never from rules of its own."""
from __future__ import annotations

import functools

import torch

from codegen.variant import FP8_FAST

from . import _binding
from .dispatch import PathFacts, VariantNotCompiledError
from .validation import DTYPE_TOKEN, DTYPE_TOKENS, MAX_Q_LEN, fail, shown

HEURISTIC_MAX_SPLITS = 64  # never more: beyond it the combine costs more than the finer split saves
# The wave model of _for_rows, for requests of at least WAVE_MIN_REQUEST_ROWS query rows (compute-bound
# CTAs; below it a partial wave still draws the memory bandwidth): a piece's fixed cost (its Q load, the
# pipeline's refill, its epilogue and share of the combine) in tiles, and the percentage of the one-wave
# rule's modelled time another count must stay below to be taken.
WAVE_MIN_REQUEST_ROWS = 128
PIECE_COST_TILES = 6
WAVE_MARGIN_PERCENT = 90
# fp8 fast variants: pieces short enough for the exact short-split kernel give way to pieces of
# FAST_PIECE_KEYS keys on the fast kernel when those still make FAST_PIECE_MIN_CTAS CTAs (fast_pieces).
FAST_PIECE_KEYS = 256
FAST_PIECE_MIN_CTAS = 32


def _request_rows(num_heads: int, q_len: int, variant_heads: int | None) -> tuple[int, int]:
    """(q_rows, per_req): the launched variant's query rows per request (its compiled head count, default
    num_heads, x q_len), which decide its rows per CTA, and the rows a request's CTAs cover (masked heads
    included, or all head groups' together)."""
    return (variant_heads or num_heads) * q_len, max(num_heads, variant_heads or 0) * q_len


@functools.lru_cache(maxsize=4096)  # pure in its ints; a serving loop repeats its shapes
def _for_rows(batch: int, rows_per_req: int, rows: int, max_seq_len: int, num_sms: int, tile_keys: int) -> int:
    """The count for CTAs of `rows` query rows (num_kv_splits_for)."""
    ctas = batch * -(-rows_per_req // rows)
    if ctas == 0:
        return 1
    tiles = -(-max_seq_len // tile_keys)  # integer ceil: any int, however large
    cap = max(1, min(tiles if batch == 1 else tiles // 2, HEURISTIC_MAX_SPLITS))
    n = 1 if ctas >= num_sms else min(num_sms // ctas, cap)  # one wave
    if rows_per_req < WAVE_MIN_REQUEST_ROWS:
        return n
    # A last wave that leaves SMs idle: the count whose waves x (tiles a piece + its fixed cost) is least.
    def cost(k: int) -> int:
        return -(-ctas * k // num_sms) * (-(-tiles // k) + PIECE_COST_TILES)
    best = min(range(1, cap + 1), key=lambda k: (cost(k), k))
    return best if 100 * cost(best) < WAVE_MARGIN_PERCENT * cost(n) else n


def num_kv_splits_for(facts: PathFacts, batch: int, num_heads: int, q_len: int, max_seq_len: int,
                      num_sms: int, *, variant_heads: int | None = None) -> int:
    """The heuristic for a variant with these path facts, on arguments known to be in range.

    The unsplit grid is batch * ceil(num_heads * q_len / rows) CTAs, one CTA per SM at a time, where rows
    = facts.rows_for(variant_heads * q_len): the launched variant's compiled head count (default
    num_heads) decides its rows per CTA (a transposed variant holds up to 32 rows of one request). If that fills the SMs: 1. Otherwise as many pieces as fill the SMs once, at most
    ceil(max_seq_len / tile) // 2 (two tiles per piece: one round of the two math warpgroups) or, for a
    single request, ceil(max_seq_len / tile) (one tile per piece: its combine is small), at most
    HEURISTIC_MAX_SPLITS. Then, for requests of at least WAVE_MIN_REQUEST_ROWS rows (num_heads x q_len,
    where the tensor cores bind), the wave model, time ~ waves x (tiles a piece + PIECE_COST_TILES) with
    waves = ceil(CTAs x k / num_sms) for k pieces: the count up to that cap with the least modelled time
    replaces this one when it models below WAVE_MARGIN_PERCENT % of it (a last wave that leaves SMs
    idle, e.g. 192 CTAs on 132 SMs: 2 pieces). When the pieces this gives are short enough for the
    variant's second kernel (facts.runs_second), which has other rows per CTA, the count is taken again
    for that kernel's CTAs.
    """
    q_rows, per_req = _request_rows(num_heads, q_len, variant_heads)
    rows = facts.rows_for(q_rows)
    n = _for_rows(batch, per_req, rows, max_seq_len, num_sms, facts.tile_keys)
    launch_rows = facts.launch_rows(max_seq_len, n, q_rows)
    if launch_rows != rows:
        n = _for_rows(batch, per_req, launch_rows, max_seq_len, num_sms, facts.tile_keys)
    return n


def fast_pieces(facts: PathFacts, n: int, batch: int, num_heads: int, q_len: int, max_seq_len: int, *,
                variant_heads: int) -> int:
    """The split count of an fp8_e4m3_fast launch, given the heuristic's count n for it.

    When n's pieces are short enough that the launch runs the variant's second kernel (the exact
    short-split one, facts.runs_second), the launch takes instead ceil(max_seq_len / FAST_PIECE_KEYS)
    pieces (of whole tiles, at most FAST_PIECE_KEYS keys each, so the fast kernel runs them) if that is
    at least 2 pieces making at least FAST_PIECE_MIN_CTAS CTAs (batch x row blocks per request, as
    num_kv_splits_for counts them, x pieces). Otherwise n. docs/design.md section 6 has the
    measurements (1 x 4096 at 128 heads: 64 pieces of 64 keys 23.2 us, 16 of 256 keys 21.2 us).
    """
    if not facts.runs_second(max_seq_len, n):
        return n
    tiles = -(-max_seq_len // facts.tile_keys)
    pieces = -(-tiles // (FAST_PIECE_KEYS // facts.tile_keys))
    q_rows, per_req = _request_rows(num_heads, q_len, variant_heads)
    row_blocks = -(-per_req // facts.rows_for(q_rows))
    if pieces > 1 and batch * row_blocks * pieces >= FAST_PIECE_MIN_CTAS and not facts.runs_second(max_seq_len, pieces):
        return pieces
    return n


def choose(lib, num_heads: int, page_size: int, dtype_token: str, batch: int, q_len: int, max_seq_len: int,
           num_sms: int):
    """(launches, num_kv_splits) of an unforced call: the heuristic on the split variant's path facts
    (num_kv_splits_for, then fast_pieces for an fp8_e4m3_fast variant); one
    split on the unsplit variants when it gives 1 or the build has no split variant (VariantNotCompiledError
    when nothing serves the call). Used by mla_decode, MLADecodePlan and default_num_kv_splits alike."""
    try:
        split_launches = lib.plan(num_heads, page_size, dtype_token, True)
    except VariantNotCompiledError:
        return lib.plan(num_heads, page_size, dtype_token, False), 1
    facts, (variant_heads, _, dtype, _) = split_launches[0].facts, split_launches[0].key
    n = num_kv_splits_for(facts, batch, num_heads, q_len, max_seq_len, num_sms, variant_heads=variant_heads)
    if dtype == FP8_FAST:
        n = fast_pieces(facts, n, batch, num_heads, q_len, max_seq_len, variant_heads=variant_heads)
    if n > 1:
        return split_launches, n
    return lib.plan(num_heads, page_size, dtype_token, False), 1


def default_num_kv_splits(batch: int, num_heads: int, q_len: int, max_seq_len: int, num_sms: int, *,
                          page_size: int, kv_dtype=torch.bfloat16) -> int:
    """The split count mla_decode and MLADecodePlan choose when none is given, for the variant a call
    would run (with the JIT on, that variant is compiled here if nothing loaded serves the call).

    batch >= 0 requests; num_heads and q_len of the call; max_seq_len in tokens (the longest sequence the
    call may see; block_table's width times page_size when the caller gives nothing better); num_sms the
    GPU's multiprocessor count; page_size (1 to 2**20) and kv_dtype (torch.bfloat16, torch.float16,
    torch.float8_e4m3fn or 'bf16' / 'fp16' / 'fp8_e4m3' / 'fp8_e4m3_fast') pick the variant, whose path facts say how many
    query rows its CTAs hold (:func:`num_kv_splits_for` has the rule, :func:`fast_pieces` the fast
    variants' amendment; docs/design.md section 6 the measurements).
    Returns 1 when the build has no split variant for the call. All sizes are ints (not bools): batch
    and max_seq_len >= 0, num_sms >= 1, num_heads 1 to 2**20 (MLADecodePlan's bound), q_len 1 to 8. Raises MLAInputError naming a bad argument,
    VariantNotCompiledError when no variant serves (page_size, kv_dtype), LibraryNotBuiltError when
    nothing was built (both only with the JIT off or failing).
    """
    for name, v in (("batch", batch), ("max_seq_len", max_seq_len), ("num_sms", num_sms)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name != "num_sms" else 1):
            fail(name, "a non-negative int" if name != "num_sms" else "a positive int", shown(v))
    for name, v, hi in (("num_heads", num_heads, 2**20), ("q_len", q_len, MAX_Q_LEN), ("page_size", page_size, 2**20)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            fail(name, f"an int from 1 to {hi}", shown(v))
    token = DTYPE_TOKEN.get(kv_dtype, kv_dtype) if isinstance(kv_dtype, (torch.dtype, str)) else None
    if token not in DTYPE_TOKENS:
        fail("kv_dtype", "torch.bfloat16, torch.float16, torch.float8_e4m3fn or 'bf16'/'fp16'/'fp8_e4m3'/'fp8_e4m3_fast'",
             shown(kv_dtype))
    return choose(_binding.library(), num_heads, page_size, token, batch, q_len, max_seq_len, num_sms)[1]
