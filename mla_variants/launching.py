"""The call packing: a validated :class:`~mla_variants.validation.Call` and its launches (dispatch.Launch,
one per head group) become one packed ``MlaDecodeArgs`` per launch (templates/mla/abi.h), passed to the
compiled launchers on the current CUDA stream of the tensors' device."""
from __future__ import annotations

from functools import lru_cache

import torch

from . import _binding
from .validation import Call, fail, shown

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream(device_index: int) -> int:
    """The raw handle of the current CUDA stream of a device."""
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


@lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The device's multiprocessor count."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def tma_mode(tma) -> int:
    """MlaDecodeArgs.tma_mode of a `tma` argument ("auto", "off" or "require"); MLAInputError otherwise."""
    code = _binding.TMA_MODES.get(tma) if isinstance(tma, str) else None
    if code is None:
        fail("tma", '"auto", "off" or "require"', shown(tma))
    return code


def pack(c: Call, launches, num_kv_splits: int, workspace: torch.Tensor | None, workspace_bytes: int,
         stream: int, schedule: int = 0, sched_ctas: int = 0, max_seq_len: int = 0,
         tma: int = 0) -> list[tuple[str, bytes]]:
    """One packed MlaDecodeArgs per launch (head group): [(launcher symbol, struct bytes)]. schedule: the
    device address of a balanced schedule (MLADecodePlan.schedule) for sched_ctas CTAs per row block, or 0.
    max_seq_len: the caller's bound of seq_lens (0: none), from which the launcher picks a variant's
    second kernel for short splits (templates/mla/launch.cuh). tma: MlaDecodeArgs.tma_mode (tma_mode()).
    A varlen call (c.loc_ptr set, varlen.py) passes query_start_loc and total_q_tokens; its q / out / lse
    strides are the packed layout's (batch stride 0)."""
    o, ls = c.out, c.lse
    o_ptr, o_st, l_ptr, l_st = o.data_ptr(), o.stride(), ls.data_ptr(), ls.stride()
    if c.loc_ptr:  # varlen: out [total_q_tokens, heads, 512], lse [heads, total_q_tokens], no batch dimension
        o_st, l_st = (0, o_st[0], o_st[1]), (0, l_st[0], l_st[1])
    qn_st, qp_st = c.qn_st, c.qp_st
    ws_ptr = workspace.data_ptr() if workspace_bytes else 0
    return [(l.symbol, _binding.pack_args(
        c.batch, c.q_len, l.num_heads, c.max_pages, num_kv_splits, max_seq_len,
        c.qn_ptr + l.head_start * qn_st[2] * 2, qn_st[0], qn_st[1], qn_st[2],
        c.qp_ptr + l.head_start * qp_st[2] * 2, qp_st[0], qp_st[1], qp_st[2],
        c.kv_ptr, c.kv_st[0], c.kv_st[1], c.k_scale, c.k_scale_ptr, c.bt_ptr, c.bt_st, c.sl_ptr, c.scale,
        o_ptr + l.head_start * o_st[2] * 2, o_st[0], o_st[1], o_st[2],
        l_ptr + l.head_start * l_st[1] * 4, l_st[0], l_st[1], l_st[2],
        ws_ptr, workspace_bytes, schedule, sched_ctas, c.total_q_tokens, c.loc_ptr, tma, stream)) for l in launches]


def launch(c: Call, launches, num_kv_splits: int, workspace: torch.Tensor | None, workspace_bytes: int,
           schedule: int = 0, sched_ctas: int = 0, max_seq_len: int = 0, tma: int = 0) -> None:
    """Call the compiled launchers on the current stream of the tensors' device."""
    if c.device_index != torch.cuda.current_device():  # launch on the tensors' device, not the current one
        with torch.cuda.device(c.device_index):
            return launch(c, launches, num_kv_splits, workspace, workspace_bytes, schedule, sched_ctas, max_seq_len,
                          tma)
    lib = _binding.library()
    for symbol, packed in pack(c, launches, num_kv_splits, workspace, workspace_bytes, current_stream(c.device_index),
                               schedule, sched_ctas, max_seq_len, tma):
        lib.launch(symbol, packed)
