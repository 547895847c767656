"""The Triton kernels of :mod:`torch_topg.triton_kernels.paged_attention` (the host side,
checks and launch logic live there): the decode split kernel, the merge of its
partitions, and the multi-query kernel. Imported by that module only.
"""

from __future__ import annotations

import triton
import triton.language as tl

# --- kernels -------------------------------------------------------------------------


@triton.jit
def _attend(
    q,  # [BLOCK_M, BLOCK_D] query rows, in the dot dtype
    t_begin,
    t_end,  # keys t_begin <= t < t_end are walked
    lo_r,
    hi_r,  # [BLOCK_M]: row r sees keys lo_r <= t < hi_r
    bt_row,  # this sequence's row of block_tables
    kc,
    vc,  # the caches at this KV head
    ks,
    vs,  # the scales at this KV head (int8 caches only)
    block_size,
    num_blocks,
    num_kv_heads,
    head_dim,
    scale,
    softcap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the rows over keys [t_begin, t_end): fp32 (max, sum, acc)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    kv_row = num_kv_heads * head_dim  # elements per cache token
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(t_begin, t_end, BLOCK_N):
        t = start + offs_n
        tmask = t < t_end
        blk = tl.load(bt_row + t // block_size, mask=tmask, other=0)
        blk = tl.minimum(tl.maximum(blk, 0), num_blocks - 1).to(tl.int64)
        slot = blk * block_size + (t % block_size)
        kvmask = tmask[:, None] & dmask[None, :]
        k = tl.load(kc + slot[:, None] * kv_row + offs_d[None, :], mask=kvmask, other=0)
        v = tl.load(vc + slot[:, None] * kv_row + offs_d[None, :], mask=kvmask, other=0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        if QUANT:  # int8 values are exact in every dot dtype; the key scale factors out
            k_scale = tl.load(ks + slot * num_kv_heads, mask=tmask, other=0.0)
            s = s * k_scale[None, :]
            v_scale = tl.load(vs + slot * num_kv_heads, mask=tmask, other=0.0)
            v = v.to(tl.float32) * v_scale[:, None]
        s = s * scale
        if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        visible = (t[None, :] >= lo_r[:, None]) & (t[None, :] < hi_r[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.exp(s - m_use[:, None])
        alpha = tl.exp(m - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return m, l_i, acc


@triton.jit
def _visible_range(n, window):
    """A decode row of a sequence of n tokens sees keys [lo, n)."""
    lo = tl.where(window >= 0, tl.maximum(n - 1 - window, 0), 0)
    return lo


@triton.jit
def _partitions(span, split_keys, max_splits):
    """Keys per partition and partitions of a row that sees `span` keys (its own length
    only: batch invariance)."""
    units = tl.cdiv(span, split_keys)
    part_keys = split_keys * tl.maximum(tl.cdiv(units, max_splits), 1)
    return part_keys, tl.cdiv(span, part_keys)


@triton.jit(do_not_specialize=["seq0", "window", "num_progs"])
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    sl_ptr,
    out_ptr,
    pm_ptr,
    pl_ptr,
    po_ptr,
    seq0,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_bt,
    num_heads,
    num_kv_heads,
    group,
    chunks,
    head_dim,
    num_blocks,
    block_size,
    capacity,
    window,
    scale,
    softcap,
    split_keys,
    max_splits,
    slots,
    num_progs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    ls = tl.program_id(0)  # the sequence within this launch
    s = (seq0 + ls).to(tl.int64)
    hc = tl.program_id(1)
    j = tl.program_id(2)
    kvh = hc // chunks
    g = (hc % chunks) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = g < group
    heads = kvh * group + g
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    qmask = rmask[:, None] & dmask[None, :]
    q = tl.load(
        q_ptr + s * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=qmask, other=0
    )
    n = tl.minimum(tl.maximum(tl.load(sl_ptr + s), 0), capacity)
    lo = _visible_range(n, window)
    bt_row = bt_ptr + s * stride_bt
    kc = kc_ptr + kvh * head_dim
    vc = vc_ptr + kvh * head_dim
    ks = ks_ptr + kvh
    vs = vs_ptr + kvh
    part_keys, parts = _partitions(n - lo, split_keys, max_splits)
    if DIRECT:  # one partition slot: the whole row here, straight to the output
        lo_r = tl.full([BLOCK_M], 0, tl.int32) + lo
        hi_r = tl.full([BLOCK_M], 0, tl.int32) + n
        m, l_i, acc = _attend(
            q, lo, n, lo_r, hi_r, bt_row, kc, vc, ks, vs, block_size, num_blocks,
            num_kv_heads, head_dim, scale, softcap, BLOCK_M, BLOCK_N, BLOCK_D, QUANT,
            SOFTCAP, DOT_PRECISION,
        )  # fmt: skip
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        optr = out_ptr + s * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        for part in range(j, parts, num_progs):
            t0 = lo + part * part_keys
            t1 = tl.minimum(t0 + part_keys, n)
            lo_r = tl.full([BLOCK_M], 0, tl.int32) + t0
            hi_r = tl.full([BLOCK_M], 0, tl.int32) + t1
            m, l_i, acc = _attend(
                q, t0, t1, lo_r, hi_r, bt_row, kc, vc, ks, vs, block_size, num_blocks,
                num_kv_heads, head_dim, scale, softcap, BLOCK_M, BLOCK_N, BLOCK_D, QUANT,
                SOFTCAP, DOT_PRECISION,
            )  # fmt: skip
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            idx = (ls * num_heads + heads).to(tl.int64) * slots + part
            tl.store(po_ptr + idx[:, None] * head_dim + offs_d[None, :], o, mask=qmask)
            tl.store(pm_ptr + idx, m, mask=rmask)
            tl.store(pl_ptr + idx, l_i, mask=rmask)


@triton.jit(do_not_specialize=["seq0", "window"])
def _reduce_kernel(
    out_ptr,
    pm_ptr,
    pl_ptr,
    po_ptr,
    sl_ptr,
    seq0,
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    capacity,
    window,
    split_keys,
    max_splits,
    slots,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    ls = tl.program_id(0)
    s = (seq0 + ls).to(tl.int64)
    h = tl.program_id(1)
    n = tl.minimum(tl.maximum(tl.load(sl_ptr + s), 0), capacity)
    lo = _visible_range(n, window)
    _part_keys, parts = _partitions(n - lo, split_keys, max_splits)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    smask = offs_s < parts
    base = (ls * num_heads + h).to(tl.int64) * slots
    pm = tl.load(pm_ptr + base + offs_s, mask=smask, other=float("-inf"))
    pl = tl.load(pl_ptr + base + offs_s, mask=smask, other=0.0)
    po = tl.load(
        po_ptr + (base + offs_s)[:, None] * head_dim + offs_d[None, :],
        mask=smask[:, None] & dmask[None, :],
        other=0.0,
    )
    mx = tl.max(pm, 0)
    mx = tl.where(parts > 0, mx, 0.0)
    w = tl.where(smask, pl * tl.exp(pm - mx), 0.0)
    total = tl.sum(w, 0)
    merged = tl.sum(w[:, None] * po, 0) / tl.where(total > 0, total, 1.0)
    first = tl.load(po_ptr + base * head_dim + offs_d, mask=dmask & (parts > 0), other=0.0)
    o = tl.where(parts == 1, first, tl.where(parts == 0, 0.0, merged))
    tl.store(out_ptr + s * stride_os + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=dmask)  # fmt: skip


@triton.jit(do_not_specialize=["num_seqs", "total_q", "search_steps", "window"])
def _multi_query_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    ks_ptr,
    vs_ptr,
    bt_ptr,
    sl_ptr,
    cu_ptr,
    out_ptr,
    num_seqs,
    total_q,
    search_steps,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    num_kv_heads,
    group,
    chunks,
    chunk_heads,
    block_q,
    head_dim,
    num_blocks,
    block_size,
    capacity,
    window,
    scale,
    softcap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    hc = tl.program_id(1)
    # This program's sequence: the last s with cu[s] // block_q + s <= pid.
    first = 0
    last = num_seqs - 1
    for _ in range(search_steps):
        mid = (first + last + 1) // 2
        ok = tl.load(cu_ptr + mid) // block_q + mid <= pid
        first = tl.where(ok, mid, first)
        last = tl.where(ok, last, mid - 1)
    s = first.to(tl.int64)
    q0 = tl.load(cu_ptr + s)
    qb = pid - (q0 // block_q + s)  # the query block within the sequence
    n = tl.minimum(tl.maximum(tl.load(sl_ptr + s), 0), capacity)
    q_len = tl.minimum(tl.maximum(tl.load(cu_ptr + s + 1) - q0, 0), n)

    offs_m = tl.arange(0, BLOCK_M)
    tok = offs_m // chunk_heads
    g = (hc % chunks) * chunk_heads + offs_m % chunk_heads
    kvh = hc // chunks
    i = qb * block_q + tok  # the row's index among the sequence's new tokens
    row = q0 + i
    rmask = (tok < block_q) & (g < group) & (i < q_len) & (row >= 0) & (row < total_q)
    heads = kvh * group + g
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    qmask = rmask[:, None] & dmask[None, :]
    row = row.to(tl.int64)
    q = tl.load(
        q_ptr + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=qmask,
        other=0,
    )
    pos = n - q_len + i  # bottom-right aligned
    lo_r = tl.where(window >= 0, tl.maximum(pos - window, 0), 0)
    lo_r = tl.where(rmask, lo_r, 0)
    hi_r = tl.where(rmask, pos + 1, 0)
    t_begin = tl.min(tl.where(rmask, lo_r, capacity), 0)
    t_end = tl.max(hi_r, 0)
    _m, l_i, acc = _attend(
        q, t_begin, t_end, lo_r, hi_r, bt_ptr + s * stride_bt, kc_ptr + kvh * head_dim,
        vc_ptr + kvh * head_dim, ks_ptr + kvh, vs_ptr + kvh, block_size, num_blocks,
        num_kv_heads, head_dim, scale, softcap, BLOCK_M, BLOCK_N, BLOCK_D, QUANT, SOFTCAP,
        DOT_PRECISION,
    )  # fmt: skip
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    optr = out_ptr + row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(optr, o.to(out_ptr.dtype.element_ty), mask=qmask)
