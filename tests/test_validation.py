"""Every wrong input to mla_decode raises MLAInputError naming the argument, the expectation and the value.
Runs on the CPU: validation happens before anything touches the GPU or the library."""
import collections
import re

import pytest
import torch

from mla_variants import MLAInputError, mla_decode


def _args(**over):
    a = dict(q=torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16), kv_cache=torch.zeros(10, 64, 576, dtype=torch.bfloat16),
             block_table=torch.zeros(2, 4, dtype=torch.int32), seq_lens=torch.zeros(2, dtype=torch.int32), softmax_scale=0.1)
    a.update(over)
    return a


def _err(**over):
    kw = {k: over.pop(k) for k in list(over) if k in ("num_kv_splits", "max_seq_len", "out", "lse", "workspace")}
    a = _args(**over)
    with pytest.raises(MLAInputError) as e:
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"], **kw)
    return str(e.value)


@pytest.mark.parametrize("over,words", [
    (dict(q=torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16)), "q: expected last dimension 576"),
    (dict(q=torch.zeros(2, 16, 576, dtype=torch.bfloat16)), "q: expected a 4-d tensor, got shape (2, 16, 576)"),
    (dict(q=torch.zeros(2, 1, 16, 576)), "q: expected dtype torch.bfloat16 or torch.float16, got torch.float32"),
    (dict(q=torch.zeros(2, 9, 16, 576, dtype=torch.bfloat16)), "q: expected q_len (dim 1) from 1 to 8, got 9"),
    (dict(q=[torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16)]), "q: expected a tensor or the pair (q_nope, q_pe)"),
    (dict(q=(torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16), torch.zeros(2, 1, 16, 32, dtype=torch.bfloat16))),
     "q_pe: expected last dimension 64"),
    (dict(q=(torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16), torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16))),
     "q_pe: expected leading shape (2, 1, 16)"),
    (dict(q=(torch.zeros(2, 1, 16, 500, dtype=torch.bfloat16), torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16))),
     "q_nope: expected last dimension 512 (kv_lora_rank)"),
    (dict(kv_cache=torch.zeros(10, 64, 576, dtype=torch.float16)), "kv_cache: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got torch.float16"),
    (dict(kv_cache=torch.zeros(10, 64, 512, dtype=torch.bfloat16)), "kv_cache: expected shape [num_pages, page_size, 576]"),
    (dict(kv_cache=torch.zeros(10, 64, 1, 576, dtype=torch.bfloat16)), "kv_cache: expected a 3-d tensor"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), "block_table: expected dtype torch.int32, got torch.int64"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int32)), "block_table: expected shape [batch=2, max_pages_per_seq >= 1], got shape (3, 4)"),
    (dict(block_table=torch.zeros(4, 2, dtype=torch.int32).t()), "block_table: expected a contiguous last dimension"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), "seq_lens: expected a contiguous tensor of shape [batch=2]"),
    (dict(seq_lens=torch.zeros(2)), "seq_lens: expected dtype torch.int32, got torch.float32"),
    (dict(softmax_scale=0.0), "softmax_scale: expected a finite positive float (at least 1.18e-38 and at most 1e+30"),
    (dict(softmax_scale=float("nan")), "so that scale * log2(e) is a normal fp32), got nan"),
    (dict(softmax_scale=1e-46), "got 1e-46"),   # below fp32's smallest normal: the kernel's scale would be 0
    (dict(softmax_scale=1e39), "got 1e+39"),
    (dict(softmax_scale=10**400), "softmax_scale: expected a finite positive float"),
    (dict(softmax_scale=torch.tensor(0.1)), "softmax_scale: expected a finite positive float"),
    (dict(), "q: expected a CUDA tensor, got a tensor on cpu"),
])
def test_input_errors(over, words):
    assert words in _err(**over)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_nested_and_sparse_csr_q_are_named():
    """torch raises RuntimeError for .stride() of these layouts; the fast check must hand them on."""
    nested = torch.nested.nested_tensor([torch.zeros(1, 16, 576, dtype=torch.bfloat16)] * 2)
    csr = torch.zeros(2, 1, 16, 576).to_sparse_csr().to(torch.bfloat16)
    for q in (nested, csr, (nested, nested)):
        a = _args(q=q)
        with pytest.raises(MLAInputError, match="expected a dense"):
            mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"])


def test_outputs_must_not_share_memory_with_inputs():
    """check_disjoint (mla_decode and MLADecodePlan run it on caller-provided out, lse and workspace):
    byte ranges that overlap an input or an earlier output are refused, views of one buffer that do not
    overlap are not. CPU tensors: only data pointers, shapes and strides are read."""
    from mla_variants.validation import Call as _Call, check_disjoint as _check_disjoint, fill_call as _fill
    q = torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)
    kv_buf = torch.zeros(10 * 64 * 576 + 64, dtype=torch.bfloat16)  # the cache, then 64 values of something else
    kv = kv_buf[: 10 * 64 * 576].view(10, 64, 576)
    bt, sl = torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)

    def call(q_nope, q_pe):
        return _fill(_Call(), q_nope, q_pe, kv, bt, sl, 0.1, None, None, 0)

    c = call(q[..., :512], q[..., 512:])
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping q, got bytes"):
        _check_disjoint(c, False, None, (("out", q[..., :512]),))
    q_nope, q_pe = torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16), torch.zeros(2, 1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping q_pe"):
        _check_disjoint(call(q_nope, q_pe), True, None, (("out", q_pe[1]),))
    with pytest.raises(MLAInputError, match="lse: expected memory of its own, not overlapping seq_lens"):
        _check_disjoint(c, False, None, (("lse", sl.view(torch.float32)),))
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping kv_cache"):
        _check_disjoint(c, False, None, (("out", kv_buf[10 * 64 * 576 - 1:]),))  # from the cache's last value on
    with pytest.raises(MLAInputError, match="out: expected memory of its own, not overlapping block_table"):
        _check_disjoint(c, False, None, (("out", bt[1, 3:]),))
    scale = torch.ones(1)
    with pytest.raises(MLAInputError, match="lse: expected memory of its own, not overlapping k_scale"):
        _check_disjoint(c, False, scale, (("lse", scale),))
    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    out = buf[: 2 * 16 * 512 * 2].view(torch.bfloat16).view(2, 1, 16, 512)
    with pytest.raises(MLAInputError, match="workspace: expected memory of its own, not overlapping out"):
        _check_disjoint(c, False, None, (("out", out), ("lse", None), ("workspace", buf)))
    _check_disjoint(c, False, None, (("out", out), ("workspace", buf[out.numel() * 2:])))  # disjoint: fine
    _check_disjoint(c, False, None, (("out", torch.empty(0)), ("lse", q.new_empty(5)[5:])))  # empty: nothing to overlap
    _check_disjoint(c, False, None, (("out", kv_buf[10 * 64 * 576:]),))  # just past the cache: fine


def test_fast_path_sends_unusual_outputs_to_the_full_check(monkeypatch):
    """_fast_validate (the per-call screen in front of _validate) accepts only the plain layouts of out
    and lse and returns None for everything else, so _validate decides (and names the argument). CPU
    tensors made to report device 0: only shapes, strides, dtypes and pointers are read."""
    from mla_variants.validation import fast_validate as _fast_validate
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    a = _args()
    args = (a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"])
    out = torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16)
    lse = torch.zeros(2, 16, 1)
    c = _fast_validate(*args, out, lse)
    assert c is not None and c.out is out and c.lse is lse and (c.batch, c.num_heads, c.page_size) == (2, 16, 64)
    wide = torch.zeros(2, 1, 16, 1024, dtype=torch.bfloat16)[..., :512]  # row stride 1024: plain enough
    assert _fast_validate(*args, wide, lse) is not None
    assert _fast_validate(*args, None, None) is not None
    # the fast screen and softmax_scale_ok agree on every softmax_scale (break-it finding: the screen let
    # 1e-46 through after the full check learned its lower bound)
    from mla_variants.validation import softmax_scale_ok
    for v in (0.0, 5e-324, 1e-46, 1.1754943508222875e-38, 1e-3, 0.07, 1e30, 1.0000000000000002e30, float("inf"), float("nan")):
        assert (_fast_validate(*args[:4], v, None, None) is not None) == softmax_scale_ok(v), v
    unusual = {
        "out shape": torch.zeros(2, 1, 16, 256, dtype=torch.bfloat16),
        "out dtype": torch.zeros(2, 1, 16, 512, dtype=torch.float16),
        "out column stride": torch.zeros(2, 1, 16, 1024, dtype=torch.bfloat16)[..., ::2],
        "out rows overlap": torch.zeros(2 * 16 * 512, dtype=torch.bfloat16).as_strided((2, 1, 16, 512), (512, 512, 256, 1)),
        "out head stride not a multiple of 4": torch.zeros(2 * 16 * 514, dtype=torch.bfloat16).as_strided(
            (2, 1, 16, 512), (16 * 514, 16 * 514, 514, 1)),
        "out expanded": torch.zeros(1, 1, 1, 512, dtype=torch.bfloat16).expand(2, 1, 16, 512),
    }
    for what, bad in unusual.items():
        assert _fast_validate(*args, bad, lse) is None, what
    assert _fast_validate(*args, out, torch.zeros(2, 16, 2)[..., :1]) is None, "lse not contiguous"
    assert _fast_validate(*args, out, torch.zeros(2, 16, 1, dtype=torch.float64)) is None, "lse dtype"
    # a lazily negated view of any tensor, and a q pair in anything but a tuple or list
    neg = torch._neg_view
    assert _fast_validate(*args, out, neg(lse)) is None and _fast_validate(*args, neg(out), lse) is None
    for i in range(4):
        assert _fast_validate(*[neg(x) if j == i else x for j, x in enumerate(args[:4])], args[4], out, lse) is None, i
    q = a["q"]
    assert _fast_validate((q[..., :512], q[..., 512:]), *args[1:], out, lse) is not None
    assert _fast_validate(collections.deque([q[..., :512], q[..., 512:]]), *args[1:], out, lse) is None
    assert _fast_validate(iter([q[..., :512], q[..., 512:]]), *args[1:], out, lse) is None


@pytest.mark.parametrize("arg", ["q", "kv_cache", "block_table", "seq_lens", "out", "lse"])
def test_a_lazily_negated_view_is_refused(arg):
    """A view with is_neg() (e.g. a complex tensor's .conj().imag) shows negated values but its memory
    holds the others, which the kernel reads or writes: refused, naming the argument."""
    outs = {"out": torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16), "lse": torch.zeros(2, 16, 1)}
    a = _args()
    kw = {}
    if arg in outs:
        kw[arg] = torch._neg_view(outs[arg])
    else:
        a[arg] = torch._neg_view(a[arg])
    with pytest.raises(MLAInputError, match=f"^{arg}: expected a tensor whose memory holds its values"):
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"], **kw)


def test_a_sparse_workspace_is_an_input_error(monkeypatch):
    """A workspace that is not dense gets an MLAInputError naming it (it reached the overlap check,
    which raised torch's RuntimeError). CPU tensors made to report device 0, past the device checks."""
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    a = _args()
    with pytest.raises(MLAInputError, match="^workspace: expected a dense"):
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"],
                   workspace=torch.zeros(64, 64).to_sparse())


def test_debug_must_be_a_bool():
    """debug="no" once turned the checks (and their synchronization) on."""
    a = _args()
    for bad in ("no", 1, None):
        with pytest.raises(MLAInputError, match="debug: expected a bool"):
            mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"], debug=bad)


def test_kv_cache_on_another_device_is_named():
    meta = torch.zeros(10, 64, 576, dtype=torch.bfloat16, device="meta")
    assert "kv_cache: expected a tensor on cpu (where q is), got meta" in _err(kv_cache=meta)


@pytest.mark.parametrize("over,words", [
    (dict(out=torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)), "out: expected shape (2, 1, 16, 512), got shape (2, 1, 16, 576)"),
    (dict(out=torch.zeros(2, 1, 16, 512)), "out: expected dtype torch.bfloat16, got torch.float32"),
    (dict(out=torch.zeros(2, 1, 16, 1024, dtype=torch.bfloat16)[..., ::2]), "out: expected a contiguous last dimension"),
    (dict(lse=torch.zeros(2, 1, 16)), "lse: expected shape (2, 16, 1), got shape (2, 1, 16)"),
    (dict(lse=torch.zeros(2, 16, 1, dtype=torch.float64)), "lse: expected dtype torch.float32, got torch.float64"),
    (dict(num_kv_splits=0), "num_kv_splits: expected an int from 1 to 256, got 0"),
    (dict(num_kv_splits=257), "num_kv_splits: expected an int from 1 to 256, got 257"),
    (dict(num_kv_splits=2.0), "num_kv_splits: expected an int from 1 to 256, got 2.0"),
    # An int past Python's 4300-digit text limit: still MLAInputError, the value shown by its size.
    (dict(num_kv_splits=10**5000), "num_kv_splits: expected an int from 1 to 256, got an int of 16610 bits"),
    (dict(max_seq_len=-10**5000), "max_seq_len: expected None or an int from 1 to 2**31 - 1 (an upper bound of seq_lens), got an int of 16610 bits"),
    (dict(out=torch.empty(2, 1, 1, 512, dtype=torch.bfloat16).expand(2, 1, 16, 512)),
     "out: expected a tensor whose elements do not overlap"),
    (dict(out=torch.empty(2 * 1152, dtype=torch.bfloat16).as_strided((2, 1, 16, 512), (1152, 1152, 4, 1))),
     "out: expected a tensor whose elements do not overlap"),
    (dict(lse=torch.empty(2, 1, 1).expand(2, 16, 1)), "lse: expected a tensor whose elements do not overlap"),
    (dict(q=torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16).to_sparse()), "q: expected a dense (strided) tensor"),
])
def test_output_and_split_errors(over, words):
    assert words in _err(**over)


def test_packed_args_match_the_c_struct_layout():
    import ctypes

    from mla_variants import _binding
    fields = [n for n, _ in _binding.MlaDecodeArgs._fields_][1:]
    values = list(range(1, len(fields) + 1))
    values[fields.index("softmax_scale")] = 0.5
    ref = _binding.MlaDecodeArgs(_binding.ABI_VERSION, *values)
    assert _binding.pack_args(*values) == bytes(ref)
    assert len(_binding.pack_args(*values)) == ctypes.sizeof(_binding.MlaDecodeArgs)


def test_packed_args_match_the_c_header(tmp_path):
    """The ctypes mirror against templates/mla/abi.h itself: a C program prints every field's offset
    and the struct's size (a field added on one side only would shift every later one)."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    from mla_variants import _binding
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    root = Path(__file__).resolve().parents[1]
    names = [n for n, _ in _binding.MlaDecodeArgs._fields_]
    prints = "".join(f'  printf("{n} %zu\\n", offsetof(MlaDecodeArgs, {n}));\n' for n in names)
    src = tmp_path / "abi_offsets.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "mla/abi.h"\nint main(void) {\n' + prints +
                   '  printf("sizeof %zu\\n", sizeof(MlaDecodeArgs));\n  printf("version %d\\n", MLA_ABI_VERSION);\n'
                   '  return 0;\n}\n')
    exe = tmp_path / "abi_offsets"
    p = subprocess.run([cc, f"-I{root / 'templates'}", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    got = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines())
    for n in names:
        assert int(got[n]) == getattr(_binding.MlaDecodeArgs, n).offset, n
    assert int(got["sizeof"]) == ctypes.sizeof(_binding.MlaDecodeArgs)
    assert int(got["version"]) == _binding.ABI_VERSION


def test_workspace_size_rejects_bools():
    from mla_variants import workspace_size
    with pytest.raises(MLAInputError, match="batch: expected a non-negative int, got True"):
        workspace_size(True, 16, 1, 2)


def test_fake_ops_check_shapes():
    import mla_variants.ops  # noqa: F401
    m = dict(device="meta")
    with pytest.raises(ValueError, match="q_nope/q_pe: expected"):
        torch.ops.mla_variants.mla_decode(torch.empty(3, 2, 16, 7, **m), torch.empty(3, 2, 16, 64, **m),
                                          torch.empty(4, 64, 576, **m), torch.empty(3, 4, dtype=torch.int32, **m),
                                          torch.empty(3, dtype=torch.int32, **m), 0.1, 0)


def _meta_args(batch=3, q_len=1, heads=16, kv=(4, 64, 576), kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
               bt_batch=None, scale=0.1, splits=0):
    m = dict(device="meta")
    return (torch.empty(batch, q_len, heads, 512, dtype=q_dtype, **m), torch.empty(batch, q_len, heads, 64, dtype=q_dtype, **m),
            torch.empty(*kv, dtype=kv_dtype, **m), torch.empty(batch if bt_batch is None else bt_batch, 4, dtype=torch.int32, **m),
            torch.empty(batch, dtype=torch.int32, **m), scale, splits)


@pytest.mark.parametrize("over,words", [
    ({"q_len": 9}, "q_nope: expected q_len (dim 1) from 1 to 8"),
    ({"heads": 0}, "num_heads (dim 2) >= 1"),
    ({"kv": (4, 64, 100)}, "kv_cache: expected shape [num_pages, page_size, 576]"),
    ({"kv": (0, 16, 576)}, "kv_cache: expected at least one page"),   # the fake traced it (break-it finding)
    ({"kv_dtype": torch.float32}, "kv_cache: expected dtype"),
    ({"q_dtype": torch.float16, "kv_dtype": torch.float8_e4m3fn}, "kv_cache: expected dtype torch.float16"),
    ({"bt_batch": 2}, "block_table: expected shape [batch=3"),
    ({"scale": float("nan")}, "softmax_scale: expected a finite positive float"),
    ({"scale": -1.0}, "softmax_scale: expected a finite positive float"),
    ({"splits": -5}, "num_kv_splits: expected 0 (the heuristic) or an int from 1 to 256"),
    ({"splits": 1000}, "num_kv_splits: expected 0 (the heuristic)"),
])
def test_fake_ops_refuse_what_the_eager_call_refuses(over, words):
    """Tracing (meta tensors) fails where the eager call would, instead of tracing a graph that raises
    at run time (break-it findings)."""
    import mla_variants.ops  # noqa: F401
    args = _meta_args(**over)
    scale = torch.ones(1, device="meta") if args[2].dtype is torch.float8_e4m3fn else None
    with pytest.raises(MLAInputError, match=re.escape(words)):
        torch.ops.mla_variants.mla_decode(*args, k_scale=scale)


def test_fake_out_op_checks_out_and_lse():
    import mla_variants.ops  # noqa: F401
    args, m = _meta_args(), dict(device="meta")
    lse = torch.empty(3, 16, 1, **m)
    with pytest.raises(MLAInputError, match=re.escape("out: expected shape (3, 1, 16, 512)")):
        torch.ops.mla_variants.mla_decode_out(*args, torch.empty(3, 1, 16, 500, dtype=torch.bfloat16, **m), lse)
    with pytest.raises(MLAInputError, match=re.escape("lse: expected shape (3, 16, 1)")):
        torch.ops.mla_variants.mla_decode_out(*args, torch.empty(3, 1, 16, 512, dtype=torch.bfloat16, **m),
                                              torch.empty(3, 1, 16, **m))
    torch.ops.mla_variants.mla_decode_out(*args, torch.empty(3, 1, 16, 512, dtype=torch.bfloat16, **m), lse)


@pytest.mark.parametrize("kv_dtype,k_scale,words", [
    (torch.float8_e4m3fn, None, "k_scale: expected a 1-element float32 tensor for a float8_e4m3fn kv_cache, None for bf16/fp16, got None with a torch.float8_e4m3fn kv_cache"),
    (torch.bfloat16, torch.ones(1), "got a tensor with a torch.bfloat16 kv_cache"),
    (torch.float8_e4m3fn, torch.ones(2), "k_scale: expected a 1-element float32 tensor, got a torch.float32 tensor of shape (2,)"),
    (torch.float8_e4m3fn, torch.ones(1, dtype=torch.float64), "got a torch.float64 tensor of shape (1,)"),
])
def test_fake_ops_check_k_scale_while_tracing(kv_dtype, k_scale, words):
    """On meta tensors (what torch.compile traces with) the ops refuse a k_scale that does not match
    the cache's dtype, before any kernel runs."""
    import mla_variants.ops  # noqa: F401
    m = dict(device="meta")
    args = (torch.empty(3, 1, 16, 512, dtype=torch.bfloat16, **m), torch.empty(3, 1, 16, 64, dtype=torch.bfloat16, **m),
            torch.empty(4, 64, 576, dtype=kv_dtype, **m), torch.empty(3, 4, dtype=torch.int32, **m),
            torch.empty(3, dtype=torch.int32, **m), 0.1, 0)
    scale = None if k_scale is None else k_scale.to("meta")
    with pytest.raises(MLAInputError, match=re.escape(words)):
        torch.ops.mla_variants.mla_decode(*args, k_scale=scale)
    out = torch.empty(3, 1, 16, 512, dtype=torch.bfloat16, **m)
    with pytest.raises(MLAInputError, match=re.escape(words)):
        torch.ops.mla_variants.mla_decode_out(*args, out, torch.empty(3, 16, 1, **m), k_scale=scale)


# -- fp8 caches: q must be bf16, k_scale must come with the fp8 cache and only with it ---------------
_FP8 = torch.float8_e4m3fn


def _err_fp8(k_scale, **over):
    a = _args(**{"kv_cache": torch.zeros(10, 64, 576, dtype=_FP8), **over})
    with pytest.raises(MLAInputError) as e:
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"], k_scale=k_scale)
    return str(e.value)


@pytest.mark.parametrize("k_scale,over,words", [
    (None, {}, "k_scale: expected the dequantization scale of the float8_e4m3fn kv_cache"),
    (0.0, {}, "k_scale: expected a positive finite float or a 1-element float32 tensor, got 0.0"),
    (-2.0, {}, "k_scale: expected a positive finite float"),
    (float("nan"), {}, "k_scale: expected a positive finite float"),
    (float("inf"), {}, "k_scale: expected a positive finite float"),
    (True, {}, "k_scale: expected a positive finite float"),
    ("0.5", {}, "k_scale: expected a positive finite float"),
    (torch.ones(2), {}, "k_scale: expected a positive float or a 1-element float32 (strided) tensor on cpu, got a torch.float32 torch.strided tensor of shape (2,)"),
    (torch.ones(1).to_sparse(), {}, "k_scale: expected a positive float or a 1-element float32 (strided) tensor on cpu, got a torch.float32 torch.sparse_coo tensor"),
    (1e-50, {}, "k_scale: expected a value in [1.18e-38, 1.33e+36] (fp32's normal range, less the kernel's 2^8 q prescale)"),
    (1e39, {}, "k_scale: expected a value in [1.18e-38, 1.33e+36]"),
    (1e37, dict(softmax_scale=1e-8), "k_scale: expected a value in [1.18e-38, 1.33e+36]"),  # 256 x k_scale overflows fp32
    (1.0, dict(softmax_scale=float("nan")), "softmax_scale: expected a finite positive float"),
    (1.0, dict(softmax_scale=1e31), "softmax_scale: expected a finite positive float"),
    (1.0, dict(softmax_scale=10**400), "softmax_scale: expected a finite positive float"),
    (torch.tensor([1 + 2j]).conj().imag, {}, "k_scale: expected a tensor whose memory holds its value"),
    (1e32, {}, "k_scale: expected softmax_scale * k_scale from 1.18e-38 to 1e+30 (the kernel's fp32 score scale, a normal fp32), got k_scale 1e+32 with softmax_scale 0.1"),
    (1e-20, dict(softmax_scale=1e-20), "k_scale: expected softmax_scale * k_scale from 1.18e-38"),  # a denormal product
    (torch.ones(1, dtype=torch.float64), {}, "k_scale: expected a positive float or a 1-element float32 (strided) tensor"),
    (0.5, dict(q=torch.zeros(2, 1, 16, 576, dtype=torch.float16)),
     "q: expected bf16 with a float8_e4m3fn kv_cache (q and out are bf16), got torch.float16"),
])
def test_fp8_input_errors(k_scale, over, words):
    assert words in _err_fp8(k_scale, **over)


def test_k_scale_only_with_fp8_cache():
    a = _args()
    with pytest.raises(MLAInputError, match=r"k_scale: expected None for a torch.bfloat16 kv_cache"):
        mla_decode(a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["softmax_scale"], k_scale=0.5)


def test_k_scale_accepts_any_real_number_type():
    """numpy scalars and ints are real numbers: accepted as k_scale (the call then fails later, on the
    CPU device check, which proves validation of k_scale passed)."""
    np = pytest.importorskip("numpy")
    for k in (np.float32(0.5), np.float64(0.5), 2):
        assert _err_fp8(k).startswith("q: expected a CUDA tensor")


def test_k_scale_parameter_stays_a_device_read():
    """A Parameter (a Tensor subclass) k_scale is passed to the kernel by pointer, never turned into a
    host float (which would sync, freeze its value and break graph capture)."""
    from mla_variants import validation
    c = validation.Call()
    c.dtype = torch.bfloat16
    param = torch.nn.Parameter(torch.tensor([0.5]))
    validation.set_scale(c, torch.zeros(1, 1, 576, dtype=_FP8), param)
    assert c.key_dtype == "fp8_e4m3" and c.k_scale_ptr == param.data_ptr() and c.k_scale_tensor is param


def test_ops_take_k_scale_as_a_tensor_and_require_it_for_fp8():
    from mla_variants import ops
    a = _args(kv_cache=torch.zeros(10, 64, 576, dtype=_FP8))
    q = a["q"]
    args = (q[..., :512], q[..., 512:], a["kv_cache"], a["block_table"], a["seq_lens"], 0.1, 0)
    with pytest.raises(MLAInputError, match="k_scale: expected the dequantization scale of the float8_e4m3fn kv_cache"):
        ops.mla_decode_op._init_fn(*args)
    with pytest.raises(MLAInputError, match="k_scale: expected None or a 1-element float32 tensor .*got 0.5"):
        ops.mla_decode_op._init_fn(*args, k_scale=0.5)
    with pytest.raises(MLAInputError, match="k_scale: expected a positive float or a 1-element float32"):
        ops.mla_decode_op._init_fn(*args, k_scale=torch.tensor([0.5, 1.0]))
    bf16 = (q[..., :512], q[..., 512:], torch.zeros(10, 64, 576, dtype=torch.bfloat16)) + args[3:]
    with pytest.raises(MLAInputError, match="k_scale: expected None for a torch.bfloat16 kv_cache"):
        ops.mla_decode_out_op._init_fn(*bf16, torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16),
                                       torch.zeros(2, 16, 1), k_scale=torch.tensor([0.5]))


@pytest.mark.parametrize("dtype,kv_dtype,words", [
    (torch.float16, _FP8, "dtype: expected torch.bfloat16 with kv_dtype torch.float8_e4m3fn (q and out are bf16), got torch.float16"),
    (torch.bfloat16, torch.float16, "kv_dtype: expected None, torch.bfloat16 (the dtype of q) or torch.float8_e4m3fn, got torch.float16"),
    (torch.bfloat16, torch.int8, "kv_dtype: expected"),
])
def test_plan_rejects_a_cache_dtype_it_cannot_serve(dtype, kv_dtype, words):
    from mla_variants import MLADecodePlan
    with pytest.raises(MLAInputError, match=re.escape(words)):
        MLADecodePlan(4, 16, 64, dtype=dtype, kv_dtype=kv_dtype)

@pytest.mark.parametrize("device", ["junk", -1, 5.5, "cuda:5", "cpu"])
def test_plan_names_a_device_it_cannot_use(device, monkeypatch):
    """A device torch.device refuses, or a GPU index this machine lacks, is an MLAInputError naming device
    (break-it finding: torch's RuntimeError / TypeError). The check sits behind torch.cuda.is_available,
    so a one-GPU machine is faked here."""
    from mla_variants import MLADecodePlan
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(MLAInputError, match="^device: expected"):
        MLADecodePlan(4, 16, 64, device=device)


@pytest.mark.parametrize("value", [True, 0, -1, 3.0, float("nan"), "4096", 2**31, 2**1100])
def test_max_seq_len_is_checked_first(value):
    """max_seq_len (it picks the split count and the fp8 kernel, and goes into the C struct as int32) is
    refused before anything else is looked at, so a CPU machine sees it too."""
    assert "max_seq_len: expected None or an int from 1 to 2**31 - 1" in _err(max_seq_len=value)


@pytest.mark.parametrize("name,value", [("batch", -1), ("batch", 1.5), ("num_heads", 0), ("num_heads", float("nan")),
                                        ("q_len", True), ("max_seq_len", float("inf")), ("max_seq_len", -5),
                                        ("max_seq_len", None), ("num_sms", "132"), ("page_size", 0),
                                        ("page_size", None), ("page_size", 2**40), ("num_heads", 10**9),
                                        ("q_len", 9), ("kv_dtype", "int8"), ("kv_dtype", torch.float32)])
def test_default_num_kv_splits_names_a_bad_argument(name, value):
    """Checked before the build is looked at, so a CPU machine without one sees it too."""
    from mla_variants import default_num_kv_splits
    args = dict(batch=1, num_heads=16, q_len=1, max_seq_len=4096, num_sms=132, page_size=64)
    args[name] = value
    with pytest.raises(MLAInputError, match=f"^{name}: expected"):
        default_num_kv_splits(**args)


def test_shown_survives_a_raising_repr_and_shortens_a_long_one():
    """An argument's value in an error message: a repr that raises still gives a message (the caller
    gets MLAInputError naming the argument, not the repr's error), and a huge one is cut."""
    from mla_variants.validation import SHOWN_MAX, fail, shown

    class Odd:
        def __repr__(self):
            raise RuntimeError("no repr")

    assert shown(Odd()) == "a value of type Odd (its repr() raised)"
    with pytest.raises(MLAInputError, match="^softmax_scale: expected a float, got a value of type Odd"):
        fail("softmax_scale", "a float", shown(Odd()))
    long = shown("x" * 10_000)
    assert len(long) == SHOWN_MAX and long.endswith("...") and long.startswith("'xxx")
    assert shown(0.5) == "0.5" and shown(10 ** 5000) == "an int of 16610 bits"
