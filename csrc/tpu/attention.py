"""Flash-style prefill attention (``topg::attention``, dense batches) as a Pallas kernel.

Grid ``(batch, q_heads, q_blocks, kv_blocks)``; the kv axis is the sequential reduction
with the online-softmax state (running max ``m``, sum ``l``, fp32 accumulator) in VMEM
scratch. GQA maps query head ``h`` to kv head ``h // (Hq // Hkv)`` in the kv index map, so
K/V are never repeated in memory. Causal (bottom-right aligned) and the sliding window
skip kv blocks that no query of the q block can see: their compute is skipped
(``pl.when``) and their index map is clamped to a needed block, so a skipped step fetches
nothing new. Partial last blocks (lengths that blocks do not divide) are masked: padded
keys and values are zeroed before use, padded query rows are discarded on write-back.

Semantics as ``torch_topg.reference.attention``: scores ``q.k * scale``, then softcap
``c * tanh(s / c)``, then the causal / window mask; a query that sees no key outputs zeros.
Attention sinks (``sinks [Hq]`` float32: a logit per query head with no value) join the
softmax at the end, from the running max and sum.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ._common import cdiv, check_block, compiler_params, div, fit_block, normalise, vmem

#: Default q / kv block lengths. 128 fills the MXU (128x128 on v4/v5e; v6e's 256x256 MXU
#: prefers 256 when head_dim is 256). A q block of 128 x D 128 in fp32 is 64 KiB; the
#: scores block [128, 128] fp32 is 64 KiB: far inside VMEM, leaving room for pipelining.
BLOCK_Q = 128
BLOCK_K = 128


def _needed(q_first, k_first, *, bq: int, bk: int, off: int, causal: bool, window_left: int):  # type: ignore[no-untyped-def]
    """Whether any query of the q block sees any key of the kv block (traced bool)."""
    ok = jnp.bool_(True)
    if causal:  # the last query of the block sees keys up to its position
        ok &= k_first <= q_first + bq - 1 + off
    if window_left >= 0:  # the first query sees keys from its position - window_left
        ok &= k_first + bk - 1 >= q_first + off - window_left
    return ok


def _attn_kernel(
    q_ref,
    k_ref,
    v_ref,
    *refs,
    has_sinks,
    scale,
    softcap,
    causal,
    window_left,
    sq,
    sk,
    bq,
    bk,
):  # type: ignore[no-untyped-def]
    sink_ref = refs[0] if has_sinks else None  # [1, 1, 1]: this head's sink
    o_ref, m_sc, l_sc, acc_sc = refs[1:] if has_sinks else refs
    i, j = pl.program_id(2), pl.program_id(3)
    off = sk - sq  # bottom-right alignment: query i sits at key position i + off

    @pl.when(j == 0)
    def _init():  # type: ignore[no-untyped-def]
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    q_first, k_first = i * bq, j * bk

    @pl.when(
        _needed(q_first, k_first, bq=bq, bk=bk, off=off, causal=causal, window_left=window_left)
    )
    def _step():  # type: ignore[no-untyped-def]
        kpos_col = k_first + lax.broadcasted_iota(jnp.int32, (bk, 1), 0)
        k_ok = kpos_col < sk  # padded rows of a partial kv block hold garbage (NaN)
        # q.k in the storage dtype (bf16 products are exact in the fp32 accumulator, and
        # bf16 runs the MXU at full rate); p.v in fp32 like the reference.
        q = q_ref[0, 0]  # [bq, D]
        k = jnp.where(k_ok, k_ref[0, 0], 0)  # [bk, D]
        v = jnp.where(k_ok, v_ref[0, 0].astype(jnp.float32), 0.0)
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s * scale  # [bq, bk]
        if softcap > 0:
            s = softcap * jnp.tanh(s / softcap)
        qpos = q_first + off + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
        kpos = k_first + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        vis = kpos < sk
        if causal:
            vis &= kpos <= qpos
        if window_left >= 0:
            vis &= kpos >= qpos - window_left
        s = jnp.where(vis, s, -jnp.inf)
        m_prev = m_sc[...]  # [bq, 1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # rows with nothing seen yet
        p = jnp.exp(s - m_safe)
        alpha = jnp.exp(m_prev - m_safe)
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=-1, keepdims=True)
        # p stays fp32 (the reference's math); a bf16 p would double MXU throughput.
        pv = lax.dot_general(p, v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        acc_sc[...] = alpha * acc_sc[...] + pv
        m_sc[...] = m_new

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():  # type: ignore[no-untyped-def]
        sink = None if sink_ref is None else sink_ref[0]  # [1, 1]
        out = normalise(acc_sc[...], l_sc[...], m_sc[...], sink)
        o_ref[0, 0] = out.astype(o_ref.dtype)


def attention_kernel(
    q,
    k,
    v,
    sinks=None,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """One ``pallas_call`` in the kernel layout: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D],
    sinks None or float32 [Hq] -> [B, Hq, Sq, D] in q's dtype."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    bq = fit_block(check_block("block_q", block_q), sq)
    bk = fit_block(check_block("block_k", block_k), sk)
    nq, nk = cdiv(sq, bq), cdiv(sk, bk)
    off = sk - sq

    def kv_index(bi, h, i, j):  # type: ignore[no-untyped-def]
        # Clamp j into the kv blocks this q block needs: skipped steps re-use the block.
        hi = nk - 1
        lo = 0
        if causal:
            hi = jnp.minimum(div(jnp.maximum(i * bq + bq - 1 + off, 0), bk), nk - 1)
        if window_left >= 0:
            lo = jnp.minimum(div(jnp.maximum(i * bq + off - window_left, 0), bk), nk - 1)
        return bi, div(h, group), jnp.clip(j, lo, hi), 0

    kernel = functools.partial(
        _attn_kernel,
        scale=float(1.0 / math.sqrt(d) if scale is None else scale),
        softcap=float(softcap),
        causal=bool(causal),
        window_left=int(window_left),
        sq=sq,
        sk=sk,
        bq=bq,
        bk=bk,
        has_sinks=sinks is not None,
    )
    q_spec = pl.BlockSpec((1, 1, bq, d), lambda bi, h, i, j: (bi, h, i, 0))
    kv_spec = pl.BlockSpec((1, 1, bk, d), kv_index)
    operands, in_specs = [q, k, v], [q_spec, kv_spec, kv_spec]
    if sinks is not None:  # [Hq, 1, 1]: each head's block is its own sink
        operands.append(sinks.astype(jnp.float32).reshape(hq, 1, 1))
        in_specs.append(pl.BlockSpec((1, 1, 1), lambda bi, h, i, j: (h, 0, 0)))
    return pl.pallas_call(
        kernel,
        grid=(b, hq, nq, nk),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[
            vmem((bq, 1), jnp.float32),
            vmem((bq, 1), jnp.float32),
            vmem((bq, d), jnp.float32),
        ],
        compiler_params=compiler_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=interpret,
    )(*operands)


def check_attention(q, k, v, sinks=None) -> None:  # type: ignore[no-untyped-def]
    if q.ndim != 4:
        raise ValueError(
            f"argument 'query' must be [batch, seq, heads, head_dim], got {tuple(q.shape)}"
        )
    for name, t in (("key", k), ("value", v)):
        if t.ndim != 4 or t.shape[0] != q.shape[0] or t.shape[3] != q.shape[3]:
            raise ValueError(
                f"argument '{name}' must be [batch {q.shape[0]}, seq, kv_heads, head_dim "
                f"{q.shape[3]}], got {tuple(t.shape)}"
            )
    if v.shape != k.shape:
        raise ValueError(
            f"argument 'value' must have the shape of 'key' {tuple(k.shape)}, got {tuple(v.shape)}"
        )
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"argument 'key' has {k.shape[2]} kv heads, which must divide the {q.shape[2]} "
            "query heads of 'query'"
        )
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(
            f"argument 'sinks' must be [{q.shape[2]}] (the query heads of 'query'), "
            f"got {tuple(sinks.shape)}"
        )


def attention(
    q,
    k,
    v,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks=None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """``topg::attention`` on dense batches: q [B, Sq, Hq, D], k/v [B, Sk, Hkv, D],
    sinks None or [Hq] -> [B, Sq, Hq, D]. ``block_q`` / ``block_k``: positive multiples
    of 8 (default 128); a sequence shorter than a block uses one whole-length block."""
    check_attention(q, k, v, sinks)
    if q.shape[1] == 0:
        return jnp.zeros(q.shape, q.dtype)
    if k.shape[1] == 0:  # nothing to see
        return jnp.zeros(q.shape, q.dtype)
    out = attention_kernel(
        jnp.swapaxes(q, 1, 2),
        jnp.swapaxes(k, 1, 2),
        jnp.swapaxes(v, 1, 2),
        sinks,
        causal=causal,
        scale=scale,
        window_left=window_left,
        softcap=softcap,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
    )
    return jnp.swapaxes(out, 1, 2)
