"""Decode attention over the paged KV cache (``topg::paged_attention``) as a Pallas kernel.

Cache layout ``[num_blocks, page_size, kv_heads, head_dim]`` (vLLM "flash" layout);
``block_tables [num_seqs, max_pages]`` and ``seq_lens [num_seqs]`` are scalar-prefetched
into SMEM so the index maps can follow each sequence's pages (the gather happens in the
DMA, never as a copy in HBM). Grid ``(num_seqs, page_steps)``: each step loads
``pages_per_step`` pages (one BlockSpec per page, all kv heads of the page) and updates an
online softmax for every query head of the sequence at once, grouped per kv head (GQA).
Steps past the sequence end, or before the sliding window, skip their compute and clamp
their page index to a page already fetched, so they move no data; a page id is also
clamped into ``[0, num_blocks)`` so an unused table entry can never address outside the
cache. Value checks (ids in range, ``seq_lens`` bounds) belong to the caller: a kernel
cannot raise.

Semantics as ``torch_topg.reference.paged_attention``: the query is the last of
``seq_lens[s]`` tokens and sees all of them (window: the last ``window_left + 1``);
``seq_lens[s] == 0`` outputs zeros. Attention sinks (``sinks [Hq]`` float32, a logit per
query head with no value) join the softmax at the last step, from the running max and sum.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import cdiv, compiler_params, div, normalise, vmem

#: Pages per grid step. 128 tokens per step keeps the MXU's kv dimension full for the
#: common page size 16 (8 pages) and amortises the ~0.35 us per-step overhead; the
#: default is ``max(1, 128 // page_size)`` capped at 8 to bound the number of DMAs.
MAX_PAGES_PER_STEP = 8


def default_pages_per_step(page_size: int) -> int:
    return max(1, min(MAX_PAGES_PER_STEP, 128 // max(page_size, 1)))


def _page_range(n, *, page_size: int, window_left: int):  # type: ignore[no-untyped-def]
    """First and last page (inclusive) holding a visible key of a sequence of n tokens."""
    last = div(jnp.maximum(n - 1, 0), page_size)
    first = jnp.int32(0)
    if window_left >= 0:
        first = div(jnp.maximum(n - 1 - window_left, 0), page_size)
    return first, last


def _paged_kernel(
    bt_ref, sl_ref, q_ref, *refs, scale, softcap, window_left, page_size, pps, hkv, with_sinks
):  # type: ignore[no-untyped-def]
    sink_ref = refs[0] if with_sinks else None  # [Hkv, G, 1]
    refs = refs[1:] if with_sinks else refs
    k_refs, v_refs = refs[:pps], refs[pps : 2 * pps]
    o_ref, m_sc, l_sc, acc_sc = refs[2 * pps :]
    s_idx, step = pl.program_id(0), pl.program_id(1)
    n = sl_ref[s_idx]
    first, last = _page_range(n, page_size=page_size, window_left=window_left)
    p0 = step * pps  # first page of this step

    @pl.when(step == 0)
    def _init():  # type: ignore[no-untyped-def]
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((n > 0) & (p0 <= last) & (p0 + pps - 1 >= first))
    def _step():  # type: ignore[no-untyped-def]
        hq, d = q_ref.shape[1], q_ref.shape[2]
        group = hq // hkv
        tokens = pps * page_size
        # [tokens, Hkv, D] -> [Hkv, tokens, D]
        k = jnp.concatenate([r[0] for r in k_refs], axis=0)  # q.k in the storage dtype
        v = jnp.concatenate([r[0].astype(jnp.float32) for r in v_refs], axis=0)
        pos_col = p0 * page_size + lax.broadcasted_iota(jnp.int32, (tokens, 1, 1), 0)
        ok_col = pos_col < n  # tokens past the end hold stale cache data: zero them
        k = jnp.swapaxes(jnp.where(ok_col, k, 0), 0, 1)
        v = jnp.swapaxes(jnp.where(ok_col, v, 0.0), 0, 1)
        q = q_ref[0].astype(k.dtype).reshape(hkv, group, d)
        s = lax.dot_general(q, k, (((2,), (2,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        s = s * scale  # [Hkv, G, tokens]
        if softcap > 0:
            s = softcap * jnp.tanh(s / softcap)
        pos = p0 * page_size + lax.broadcasted_iota(jnp.int32, s.shape, 2)
        vis = pos < n
        if window_left >= 0:
            vis &= pos >= n - 1 - window_left
        s = jnp.where(vis, s, -jnp.inf)
        m_prev = m_sc[...]  # [Hkv, G, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=-1, keepdims=True)
        pv = lax.dot_general(p, v, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = m_new

    @pl.when(step == pl.num_programs(1) - 1)
    def _finish():  # type: ignore[no-untyped-def]
        sink = None if sink_ref is None else sink_ref[...]
        out = normalise(acc_sc[...], l_sc[...], m_sc[...], sink)
        o_ref[0] = out.reshape(o_ref.shape[1:]).astype(o_ref.dtype)


def resolve_pages_per_step(pages_per_step: int | None, page_size: int, max_pages: int) -> int:
    """Pages per grid step actually used: the default for ``None``, at most ``max_pages``."""
    pps = default_pages_per_step(page_size) if pages_per_step is None else pages_per_step
    if not isinstance(pps, int) or pps <= 0:
        raise ValueError(f"argument 'pages_per_step' must be a positive int, got {pages_per_step}")
    return max(1, min(pps, max_pages))


def paged_attention_call(
    block_tables,
    seq_lens,
    query,
    *caches,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    with_sinks: bool = False,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """One ``pallas_call`` (the form torch_xla lowers): block_tables [N, max_pages] and
    seq_lens [N] (int32, scalar-prefetched), query [N, Hq, D], then ``caches``: with
    ``with_sinks`` first the sinks (float32 [Hq]), then the key cache ``pages_per_step``
    times followed by the value cache as often (one operand per page a step reads; the
    same array, no copy). -> [N, Hq, D]."""
    sinks = caches[0] if with_sinks else None
    caches = caches[1:] if with_sinks else caches
    pps = len(caches) // 2
    n_seqs, hq, d = query.shape
    key_cache = caches[0]
    num_blocks, page_size, hkv = key_cache.shape[0], key_cache.shape[1], key_cache.shape[2]
    steps = cdiv(block_tables.shape[1], pps)

    def page_spec(p: int):  # type: ignore[no-untyped-def]
        def index(s, step, bt_ref, sl_ref):  # type: ignore[no-untyped-def]
            first, last = _page_range(sl_ref[s], page_size=page_size, window_left=window_left)
            page = jnp.clip(step * pps + p, first, last)
            return jnp.clip(bt_ref[s, page], 0, num_blocks - 1), 0, 0, 0

        return pl.BlockSpec((1, page_size, hkv, d), index)

    q_spec = pl.BlockSpec((1, hq, d), lambda s, step, bt, sl: (s, 0, 0))
    kernel = functools.partial(
        _paged_kernel,
        scale=float(1.0 / math.sqrt(d) if scale is None else scale),
        softcap=float(softcap),
        window_left=int(window_left),
        page_size=page_size,
        pps=pps,
        hkv=hkv,
        with_sinks=with_sinks,
    )
    group = hq // hkv
    operands, sink_specs = list(caches), []
    if with_sinks:  # [Hkv, G, 1], the layout of the running max: one block, every head
        operands.insert(0, sinks.astype(jnp.float32).reshape(hkv, group, 1))
        sink_specs.append(pl.BlockSpec((hkv, group, 1), lambda s, step, bt, sl: (0, 0, 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(n_seqs, steps),
        in_specs=[q_spec, *sink_specs] + [page_spec(p) for p in range(pps)] * 2,
        out_specs=q_spec,
        scratch_shapes=[
            vmem((hkv, group, 1), jnp.float32),
            vmem((hkv, group, 1), jnp.float32),
            vmem((hkv, group, d), jnp.float32),
        ],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(query.shape, query.dtype),
        compiler_params=compiler_params("parallel", "arbitrary"),
        interpret=interpret,
    )(block_tables, seq_lens, query, *operands)


def paged_attention_kernel(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    *,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks=None,
    pages_per_step: int | None = None,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """query [N, Hq, D], caches [num_blocks, page_size, Hkv, D], block_tables
    [N, max_pages] int32, seq_lens [N] int32, sinks None or float32 [Hq] -> [N, Hq, D]."""
    pps = resolve_pages_per_step(pages_per_step, key_cache.shape[1], block_tables.shape[1])
    first = [] if sinks is None else [sinks]
    return paged_attention_call(
        block_tables, seq_lens, query, *first, *([key_cache] * pps), *([value_cache] * pps),
        scale=scale, window_left=window_left, softcap=softcap, with_sinks=sinks is not None,
        interpret=interpret,
    )  # fmt: skip


def check_paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, sinks=None
) -> None:  # type: ignore[no-untyped-def]
    if query.ndim != 3:
        raise ValueError(
            f"argument 'query' must be [num_seqs, heads, head_dim], got {tuple(query.shape)}"
        )
    if key_cache.ndim != 4 or key_cache.shape[3] != query.shape[2]:
        raise ValueError(
            f"argument 'key_cache' must be [num_blocks, page_size, kv_heads, head_dim "
            f"{query.shape[2]}], got {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"argument 'value_cache' must have the shape of 'key_cache' "
            f"{tuple(key_cache.shape)}, got {tuple(value_cache.shape)}"
        )
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(
            f"argument 'key_cache' has {key_cache.shape[2]} kv heads, which must divide the "
            f"{query.shape[1]} query heads of 'query'"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != query.shape[0]:
        raise ValueError(
            f"argument 'block_tables' must be [num_seqs {query.shape[0]}, max_pages], "
            f"got {tuple(block_tables.shape)}"
        )
    if seq_lens.shape != (query.shape[0],):
        raise ValueError(
            f"argument 'seq_lens' must be [{query.shape[0]}], got {tuple(seq_lens.shape)}"
        )
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(
            f"argument 'sinks' must be [{query.shape[1]}] (the query heads of 'query'), "
            f"got {tuple(sinks.shape)}"
        )


def paged_attention(
    query,
    key_cache,
    value_cache,
    block_tables,
    seq_lens,
    *,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks=None,
    pages_per_step: int | None = None,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """``topg::paged_attention``: query [N, Hq, D] (one decode token per sequence),
    caches [num_blocks, page_size, Hkv, D], block_tables [N, max_pages] and seq_lens [N]
    (int32; int64 is narrowed), sinks None or float32 [Hq] -> [N, Hq, D] in the query's
    dtype.

    ``pages_per_step`` (default ``max(1, min(8, 128 // page_size))``): pages each grid
    step reads; need not divide ``max_pages``."""
    check_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, sinks)
    return paged_attention_kernel(
        query,
        key_cache,
        value_cache,
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        scale=scale,
        window_left=window_left,
        softcap=softcap,
        sinks=sinks,
        pages_per_step=pages_per_step,
        interpret=interpret,
    )
