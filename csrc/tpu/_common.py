"""Helpers shared by the kernels: block checks and JAX-version shims (jax 0.7 .. 0.10)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import tpu as pltpu

# TPU vregs are 8 sublanes x 128 lanes of 32 bits; a block dimension that is not the whole
# array dimension must be a multiple of 8 (second-to-last) or 128 (last) to lower.
SUBLANE = 8


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_block(name: str, value: int, multiple: int = SUBLANE) -> int:
    """Validate a block-size argument: a positive multiple of ``multiple``."""
    if not isinstance(value, int) or value <= 0 or value % multiple:
        raise ValueError(
            f"argument '{name}' must be a positive multiple of {multiple}, got {value}"
        )
    return value


def fit_block(block: int, length: int) -> int:
    """The block used for a dimension of ``length``: the whole dimension when it is shorter
    than the block (a full-dimension block always lowers), else the block itself; a
    partial last block is masked in the kernels."""
    return length if length <= block else block


def compiler_params(*semantics: str):  # type: ignore[no-untyped-def]
    """``dimension_semantics`` for Mosaic (ignored in interpret mode). jax >= 0.8 names the
    class ``CompilerParams``; 0.7 (torch_xla 2.9's pin) also has ``TPUCompilerParams``."""
    cls = getattr(pltpu, "CompilerParams", None) or pltpu.TPUCompilerParams
    return cls(dimension_semantics=tuple(semantics))


def vmem(shape: tuple[int, ...], dtype):  # type: ignore[no-untyped-def]
    """A VMEM scratch buffer of the grid-spec's ``scratch_shapes``."""
    return pltpu.VMEM(shape, dtype)


def normalise(acc, total, m, sink=None):  # type: ignore[no-untyped-def]
    """The online softmax's result: ``acc / total``, zeros for a row that saw no key
    (``total == 0``). With ``sink`` (a logit broadcastable to ``m``, the attention sink:
    it joins the softmax with no value) ``acc e^(m - M) / (total e^(m - M) + e^(sink - M))``,
    ``M = max(m, sink)``: a NaN sink gives NaN, an ``-inf`` sink is no sink."""
    seen = total > 0
    if sink is None:
        return jnp.where(seen, acc / jnp.where(seen, total, 1.0), 0.0)
    mx = jnp.maximum(m, sink)
    f = jnp.exp(jnp.where(seen, m - mx, 0.0))
    denom = total * f + jnp.exp(sink - mx)
    return jnp.where(seen, acc * f / jnp.where(seen, denom, 1.0), 0.0)


def div(a, b: int):  # type: ignore[no-untyped-def]
    """``a // b`` for traced non-negative ints ``a``. ``jnp.floor_divide`` corrects for
    negative operands with ``sign``, whose Mosaic lowering queries the TPU generation:
    truncating division lowers everywhere and is the same for ``a >= 0``."""
    return lax.div(a, jnp.asarray(b, dtype=a.dtype) if hasattr(a, "dtype") else b)
