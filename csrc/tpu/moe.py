"""Mixture-of-experts kernels: ``moe_topk`` routing and ``fused_moe`` as grouped matmuls.

``moe_topk``: rows of router logits are tiled (``block_tokens``); per row the kernel
scores (softmax or sigmoid, fp32), adds the optional correction bias for the *selection*
only, and picks the top k by k rounds of "max, lowest index holding it, knock it out",
so ties go to the lower expert index as in the reference.

``fused_moe``, megablox style (the grouped-matmul design of JAX's TPU MoE kernels):
1. the ``T * k`` (token, expert) pairs are sorted by expert (stable), giving ``M = T*k``
   rows of hidden states in expert order and ``group_sizes [E]``;
2. ``gmm_gate_up``: a tiled grouped matmul over the sorted rows in which each row tile is
   multiplied by the weights of the expert(s) whose rows it holds, with the activation
   fused into the epilogue: ``act(x W_gate^T) * (x W_up^T)`` -> [M, I] fp32; the gate and
   up tiles are two BlockSpecs over the same ``w_gate_up [E, 2I, H]`` (no weight copy);
3. ``gmm``: the same grouped matmul for ``w_down [E, H, I]`` -> [M, H] fp32;
4. the combine: rows back to pair order, times the routing weights, summed over k.

The grouped matmul walks "visits": one per (row tile, expert) pair that overlaps, at most
``tiles + E - 1`` of them, computed up front (``gmm_metadata``) and scalar-prefetched. A
row tile shared by two experts is visited twice in a row; each visit writes only its own
expert's rows into the resident output tile. Tiles that blocks do not divide (rows, N,
K) are masked: padded K columns are zeroed in both operands, padded rows and columns are
never written back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._common import cdiv, check_block, compiler_params, fit_block, vmem

#: Router rows per block (E is small: 8..256 experts fit one block row).
BLOCK_TOKENS = 256
#: Grouped-matmul tiles (rows, output columns, contraction). 128 matches the v5e MXU
#: (use 256 on v6e); a [128, 512] bf16 lhs tile + [128, 512] rhs tile + [128, 128] fp32
#: accumulator is ~0.3 MiB, leaving VMEM for double buffering.
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 512

ACTIVATIONS = {
    "silu": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


# --- moe_topk ------------------------------------------------------------------------
def _topk_kernel(*refs, top_k: int, scoring: str, has_bias: bool):  # type: ignore[no-untyped-def]
    if has_bias:
        x_ref, b_ref, w_ref, i_ref = refs
    else:
        x_ref, w_ref, i_ref = refs
    logits = x_ref[...].astype(jnp.float32)  # [bt, E]
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    else:
        scores = jax.nn.sigmoid(logits)
    keys = scores + b_ref[...].astype(jnp.float32) if has_bias else scores
    rows, experts = scores.shape
    col = lax.broadcasted_iota(jnp.int32, (rows, experts), 1)
    slot = lax.broadcasted_iota(jnp.int32, (rows, top_k), 1)
    weights = jnp.zeros((rows, top_k), jnp.float32)
    ids = jnp.zeros((rows, top_k), jnp.int32)
    for j in range(top_k):  # k is small (1..8): unrolled
        best = jnp.max(keys, axis=-1, keepdims=True)
        pick = jnp.min(jnp.where(keys == best, col, experts), axis=-1, keepdims=True)
        hit = col == pick
        w = jnp.sum(jnp.where(hit, scores, 0.0), axis=-1, keepdims=True)
        weights = jnp.where(slot == j, w, weights)
        ids = jnp.where(slot == j, pick, ids)
        keys = jnp.where(hit, -jnp.inf, keys)
    w_ref[...] = weights
    i_ref[...] = ids


def moe_topk_kernel(
    logits,
    *bias,
    top_k: int,
    scoring: str = "softmax",
    block_tokens: int = BLOCK_TOKENS,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """One ``pallas_call``: logits [T, E] and optionally the correction bias [1, E]
    (positional, so torch_xla passes it as an operand) -> (weights [T, k] fp32, ids
    [T, k] int32), not renormalised."""
    t, e = logits.shape
    bt = fit_block(check_block("block_tokens", block_tokens), t)
    row = pl.BlockSpec((bt, e), lambda i: (i, 0))
    out = pl.BlockSpec((bt, top_k), lambda i: (i, 0))
    has_bias = len(bias) == 1
    in_specs = [row] + ([pl.BlockSpec((1, e), lambda i: (0, 0))] if has_bias else [])
    return pl.pallas_call(
        functools.partial(_topk_kernel, top_k=top_k, scoring=scoring, has_bias=has_bias),
        grid=(cdiv(t, bt),),
        in_specs=in_specs,
        out_specs=[out, out],
        out_shape=[
            jax.ShapeDtypeStruct((t, top_k), jnp.float32),
            jax.ShapeDtypeStruct((t, top_k), jnp.int32),
        ],
        compiler_params=compiler_params("parallel"),
        interpret=interpret,
    )(logits, *bias)


def moe_topk(
    router_logits,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias=None,
    block_tokens: int = BLOCK_TOKENS,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """``topg::moe_topk``: router_logits [T, E] -> (weights [T, k] fp32, ids [T, k] int32)."""
    if router_logits.ndim != 2:
        raise ValueError(
            f"argument 'router_logits' must be [tokens, experts], got {tuple(router_logits.shape)}"
        )
    t, e = router_logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"argument 'top_k' must be in [1, {e}] (the experts), got {top_k}")
    if scoring not in ("softmax", "sigmoid"):
        raise ValueError(f"argument 'scoring' must be 'softmax' or 'sigmoid', got {scoring!r}")
    if correction_bias is not None and correction_bias.shape != (e,):
        raise ValueError(
            f"argument 'correction_bias' must have shape ({e},), got {tuple(correction_bias.shape)}"
        )
    if t == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    bias = () if correction_bias is None else (correction_bias.reshape(1, e),)
    weights, ids = moe_topk_kernel(
        router_logits, *bias, top_k=top_k, scoring=scoring,
        block_tokens=block_tokens, interpret=interpret,
    )  # fmt: skip
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids


# --- grouped matmul -------------------------------------------------------------------
def gmm_metadata(group_sizes, rows: int, block_m: int, num_groups: int):  # type: ignore[no-untyped-def]
    """Visits of the grouped matmul: (group_ids, tile_ids, num_visits), int32.

    ``group_sizes [E]``: rows per group, in order; the arrays have the static length
    ``tiles + E - 1`` (a bound on overlapping (tile, group) pairs); unused trailing
    visits repeat the last real one and are skipped in the kernel."""
    tiles = cdiv(rows, block_m)
    size = tiles + num_groups - 1
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first = starts // block_m
    last = (ends - 1) // block_m
    count = jnp.where(group_sizes > 0, last - first + 1, 0)
    visit_end = jnp.cumsum(count)
    total = visit_end[-1]
    v = jnp.minimum(jnp.arange(size, dtype=jnp.int32), jnp.maximum(total - 1, 0))
    group = jnp.searchsorted(visit_end, v, side="right").astype(jnp.int32)
    group = jnp.minimum(group, num_groups - 1)
    tile = first[group] + v - (visit_end[group] - count[group])
    return group.astype(jnp.int32), tile.astype(jnp.int32), total.astype(jnp.int32).reshape(1)


def _gmm_kernel(
    gid_ref, tid_ref, nv_ref, start_ref, end_ref, lhs_ref, *refs, k_total, bm, bk, act, fused
):  # type: ignore[no-untyped-def]
    if fused:
        gate_ref, up_ref, o_ref, acc_g, acc_u = refs
    else:
        gate_ref, o_ref, acc_g = refs
    v, kk = pl.program_id(1), pl.program_id(2)
    nk = pl.num_programs(2)

    @pl.when(kk == 0)
    def _init():  # type: ignore[no-untyped-def]
        acc_g[...] = jnp.zeros(acc_g.shape, jnp.float32)
        if fused:
            acc_u[...] = jnp.zeros(acc_u.shape, jnp.float32)

    @pl.when(v < nv_ref[0])
    def _step():  # type: ignore[no-untyped-def]
        # Zero the contraction padding of a partial last K tile in both operands.
        kcol = kk * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)
        k_ok = kcol < k_total
        # Operands stay in their common dtype (bf16 x bf16 runs the MXU at full rate and
        # its products are exact in the fp32 accumulator); fp32 lhs (the down projection's
        # activations) promotes the weights.
        dt = jnp.promote_types(lhs_ref.dtype, gate_ref.dtype)
        x = jnp.where(k_ok, lhs_ref[...].astype(dt), 0)  # [bm, bk]
        dims = (((1,), (1,)), ((), ()))  # x @ w.T with w [bn, bk]: the MXU's native form
        w = jnp.where(k_ok, gate_ref[0].astype(dt), 0)
        acc_g[...] += lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
        if fused:
            w = jnp.where(k_ok, up_ref[0].astype(dt), 0)
            acc_u[...] += lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)

    @pl.when((kk == nk - 1) & (v < nv_ref[0]))
    def _write():  # type: ignore[no-untyped-def]
        g = gid_ref[v]
        row = tid_ref[v] * bm + lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        mine = (row >= start_ref[g]) & (row < end_ref[g])  # this visit's expert's rows only
        res = act(acc_g[...]) * acc_u[...] if fused else acc_g[...]
        o_ref[...] = jnp.where(mine, res, o_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def gmm_tiles(
    m: int, n_full: int, k: int, activation: str | None, block_m: int, block_n: int, block_k: int
) -> tuple[int, int, int]:
    """The (bm, bn, bk) tiles used for lhs [m, k] and rhs [G, n_full, k]: each block is
    checked (a positive multiple of 8) and shrunk to a short dimension; in the gated form
    ``bn`` must divide N = n_full / 2 (the up tile starts at column N), else it is N."""
    n = n_full // 2 if activation is not None else n_full
    bm = fit_block(check_block("block_m", block_m), m)
    bn = fit_block(check_block("block_n", block_n), n)
    bk = fit_block(check_block("block_k", block_k), k)
    if activation is not None and n % bn:
        bn = n
    return bm, bn, bk


def gmm_call(
    group_ids,
    tile_ids,
    num_visits,
    starts,
    ends,
    lhs,
    *weights,
    activation: str | None = None,
    bm: int,
    bn: int,
    bk: int,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """One ``pallas_call`` (the form torch_xla lowers): the visit metadata of
    ``gmm_metadata`` and the group ``starts`` / ``ends`` [G] (int32, scalar-prefetched),
    ``lhs [M, K]`` sorted by group, and ``weights``: ``(rhs,)`` or, in the gated form,
    ``(rhs, rhs)`` (the same array twice: one operand for the gate tiles, one for the up
    tiles). Tiles from ``gmm_tiles``. Returns fp32 [M, N]."""
    m, k_total = lhs.shape
    fused = activation is not None
    n = weights[0].shape[1] // 2 if fused else weights[0].shape[1]
    n_tiles, visits, k_tiles = cdiv(n, bn), group_ids.shape[0], cdiv(k_total, bk)
    up_offset = n // bn

    lhs_spec = pl.BlockSpec((bm, bk), lambda j, v, kk, gid, tid, *_: (tid[v], kk))
    gate_spec = pl.BlockSpec((1, bn, bk), lambda j, v, kk, gid, tid, *_: (gid[v], j, kk))
    up_spec = pl.BlockSpec((1, bn, bk), lambda j, v, kk, gid, tid, *_: (gid[v], j + up_offset, kk))
    out_spec = pl.BlockSpec((bm, bn), lambda j, v, kk, gid, tid, *_: (tid[v], j))
    scratch = [vmem((bm, bn), jnp.float32)] * (2 if fused else 1)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(n_tiles, visits, k_tiles),
        in_specs=[lhs_spec, gate_spec] + ([up_spec] if fused else []),
        out_specs=out_spec,
        scratch_shapes=scratch,
    )
    kernel = functools.partial(
        _gmm_kernel, k_total=k_total, bm=bm, bk=bk,
        act=ACTIVATIONS[activation] if fused else None, fused=fused,
    )  # fmt: skip
    # Visits must run in order (a shared row tile is revisited by the next visit).
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        compiler_params=compiler_params("parallel", "arbitrary", "arbitrary"),
        interpret=interpret,
    )(group_ids, tile_ids, num_visits, starts, ends, lhs, *weights)


def gmm_kernel(
    lhs,
    rhs,
    group_sizes,
    *,
    activation: str | None = None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """Grouped matmul: rows of ``lhs [M, K]`` sorted by group, ``rhs [G, N', K]``,
    ``group_sizes [G]`` int32 -> fp32 [M, N] with ``out[r] = lhs[r] @ rhs[g(r)].T``.

    ``activation=None``: N = N'. ``activation='silu'|'gelu'|'gelu_tanh'``: the gated
    form, N = N'/2, ``out = act(lhs @ gate.T) * (lhs @ up.T)`` with gate = rhs[:, :N],
    up = rhs[:, N:]. Blocks: multiples of 8 (on TPU, 128 for ``block_n``/``block_k``)."""
    m, k_total = lhs.shape
    bm, bn, bk = gmm_tiles(m, rhs.shape[1], k_total, activation, block_m, block_n, block_k)
    gid, tid, nv = gmm_metadata(group_sizes, m, bm, rhs.shape[0])
    ends = jnp.cumsum(group_sizes).astype(jnp.int32)
    starts = (ends - group_sizes).astype(jnp.int32)
    weights = (rhs, rhs) if activation is not None else (rhs,)
    return gmm_call(
        gid, tid, nv, starts, ends, lhs, *weights,
        activation=activation, bm=bm, bn=bn, bk=bk, interpret=interpret,
    )  # fmt: skip


# --- fused_moe ------------------------------------------------------------------------
def sort_pairs(topk_ids, num_experts: int):  # type: ignore[no-untyped-def]
    """(order, group_sizes): ``order`` sorts the flattened (token, slot) pairs by expert
    (stable, so tokens stay in order inside an expert)."""
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, sizes


def fused_moe(
    hidden_states,
    w_gate_up,
    w_down,
    topk_weights,
    topk_ids,
    *,
    activation: str = "silu",
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """``topg::fused_moe``: hidden [T, H], w_gate_up [E, 2I, H], w_down [E, H, I],
    topk_weights [T, k], topk_ids [T, k] (ids in [0, E), not checked here: a traced
    value cannot raise) -> [T, H] in hidden's dtype."""
    if hidden_states.ndim != 2:
        raise ValueError(
            f"argument 'hidden_states' must be [tokens, hidden], got {tuple(hidden_states.shape)}"
        )
    t, h = hidden_states.shape
    if w_gate_up.ndim != 3 or w_gate_up.shape[2] != h or w_gate_up.shape[1] % 2:
        raise ValueError(
            f"argument 'w_gate_up' must be [experts, 2 * inter, hidden {h}], got {tuple(w_gate_up.shape)}"
        )
    e, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    if w_down.shape != (e, h, inter):
        raise ValueError(
            f"argument 'w_down' must be [{e}, {h}, {inter}], got {tuple(w_down.shape)}"
        )
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"arguments 'topk_weights' / 'topk_ids' must both be [{t}, top_k], got "
            f"{tuple(topk_weights.shape)} / {tuple(topk_ids.shape)}"
        )
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"argument 'activation' must be one of {sorted(ACTIVATIONS)}, got {activation!r}"
        )
    if t == 0 or topk_ids.shape[1] == 0:
        return jnp.zeros((t, h), hidden_states.dtype)
    top_k = topk_ids.shape[1]
    order, sizes = sort_pairs(topk_ids, e)
    x = hidden_states[order // top_k]  # [M, H] rows in expert order
    blocks = dict(block_m=block_m, block_n=block_n, block_k=block_k, interpret=interpret)
    act = gmm_kernel(x, w_gate_up, sizes, activation=activation, **blocks)  # [M, I] fp32
    y = gmm_kernel(act, w_down, sizes, **blocks)  # [M, H] fp32
    pairs = jnp.zeros_like(y).at[order].set(y).reshape(t, top_k, h)
    out = jnp.sum(pairs * topk_weights.astype(jnp.float32)[..., None], axis=1)
    return out.astype(hidden_states.dtype)
