"""RMSNorm and fused residual-add + RMSNorm as Pallas kernels.

Rows are tiled in blocks of ``block_rows``; the hidden size stays whole in each block
(the reduction is over it). Math in fp32, one rounding to the output dtype, exactly as
``torch_topg.reference.norm``. A partial last row block reads padding that only feeds
its own (discarded) rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ._common import cdiv, check_block, compiler_params, fit_block

#: Default rows per block: 256 rows x H 4096 x 4 B = 4 MiB per fp32 buffer; in + out,
#: double buffered, 16 MiB, inside a core's VMEM (16-32 MiB by generation). A multiple
#: of 16 so bf16 rows (packed two per sublane) fill whole vregs.
BLOCK_ROWS = 256


def _normalize(r, w_ref, eps: float):  # type: ignore[no-untyped-def]
    # r: fp32 [rows, H]
    inv = jax.lax.rsqrt(jnp.mean(r * r, axis=-1, keepdims=True) + eps)
    return r * inv * w_ref[...].astype(jnp.float32)


def _rms_kernel(x_ref, w_ref, o_ref, *, eps: float):  # type: ignore[no-untyped-def]
    o_ref[...] = _normalize(x_ref[...].astype(jnp.float32), w_ref, eps).astype(o_ref.dtype)


def _add_rms_kernel(x_ref, res_ref, w_ref, o_ref, res_out_ref, *, eps: float):  # type: ignore[no-untyped-def]
    # The sum is rounded to the residual's dtype first, as the op stores it there.
    r = (x_ref[...].astype(jnp.float32) + res_ref[...].astype(jnp.float32)).astype(res_ref.dtype)
    res_out_ref[...] = r
    o_ref[...] = _normalize(r.astype(jnp.float32), w_ref, eps).astype(o_ref.dtype)


def _specs(rows: int, hidden: int, block_rows: int):  # type: ignore[no-untyped-def]
    br = fit_block(check_block("block_rows", block_rows), rows)
    row_spec = pl.BlockSpec((br, hidden), lambda i: (i, 0))
    w_spec = pl.BlockSpec((1, hidden), lambda i: (0, 0))
    return (cdiv(rows, br),), row_spec, w_spec


def rms_norm_kernel(
    x, weight, epsilon: float, *, block_rows: int = BLOCK_ROWS, interpret: bool = False
):  # type: ignore[no-untyped-def]
    """x: [rows, H]; weight: [1, H] -> [rows, H] in x's dtype."""
    grid, row_spec, w_spec = _specs(x.shape[0], x.shape[1], block_rows)
    return pl.pallas_call(
        functools.partial(_rms_kernel, eps=float(epsilon)),
        grid=grid,
        in_specs=[row_spec, w_spec],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        compiler_params=compiler_params("parallel"),
        interpret=interpret,
    )(x, weight)


def fused_add_rms_norm_kernel(
    x, residual, weight, epsilon: float, *, block_rows: int = BLOCK_ROWS, interpret: bool = False
):  # type: ignore[no-untyped-def]
    """x, residual: [rows, H]; weight [1, H] -> (normed [rows, H], new residual [rows, H]).

    Functional (no ``input_output_aliases``): torch_xla's custom call does not take
    aliasing, and the torch op's in-place update is a ``copy_`` of these outputs."""
    grid, row_spec, w_spec = _specs(x.shape[0], x.shape[1], block_rows)
    return pl.pallas_call(
        functools.partial(_add_rms_kernel, eps=float(epsilon)),
        grid=grid,
        in_specs=[row_spec, row_spec, w_spec],
        out_specs=[row_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct(x.shape, x.dtype),
            jax.ShapeDtypeStruct(residual.shape, residual.dtype),
        ],
        compiler_params=compiler_params("parallel"),
        interpret=interpret,
    )(x, residual, weight)


def _check(x, weight) -> None:  # type: ignore[no-untyped-def]
    if x.ndim < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"argument 'weight' must have shape ({x.shape[-1] if x.ndim else '?'},) "
            f"(the hidden size of 'input'), got {tuple(weight.shape)}"
        )


def rms_norm(
    x, weight, epsilon: float = 1e-6, *, block_rows: int = BLOCK_ROWS, interpret: bool = False
):  # type: ignore[no-untyped-def]
    """``topg::rms_norm``: x [..., H], weight [H] -> [..., H] in x's dtype."""
    _check(x, weight)
    h = x.shape[-1]
    out = rms_norm_kernel(
        x.reshape(-1, h), weight.reshape(1, h), epsilon, block_rows=block_rows, interpret=interpret
    )
    return out.reshape(x.shape)


def fused_add_rms_norm(
    x,
    residual,
    weight,
    epsilon: float = 1e-6,
    *,
    block_rows: int = BLOCK_ROWS,
    interpret: bool = False,
):  # type: ignore[no-untyped-def]
    """``topg::fused_add_rms_norm`` without mutation (JAX arrays are immutable): returns
    ``(rms_norm(residual + x), residual + x)``, both [..., H]."""
    _check(x, weight)
    if residual.shape != x.shape:
        raise ValueError(
            f"argument 'residual' must have the shape of 'input' {tuple(x.shape)}, "
            f"got {tuple(residual.shape)}"
        )
    h = x.shape[-1]
    out, res = fused_add_rms_norm_kernel(
        x.reshape(-1, h),
        residual.reshape(-1, h),
        weight.reshape(1, h),
        epsilon,
        block_rows=block_rows,
        interpret=interpret,
    )
    return out.reshape(x.shape), res.reshape(x.shape)
