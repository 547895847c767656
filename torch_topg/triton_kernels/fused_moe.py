"""Triton kernel for ``topg::fused_moe``: align, two grouped GEMMs, a fixed-order sum.

Semantics are those of :func:`torch_topg.reference.fused_moe`; the steps are the ones GPU
serving engines use for routed experts:

1. **align** (:func:`moe_align`, a few torch ops, no host synchronisation): the ``T * k``
   (token, slot) assignments are sorted by expert and each expert's segment is padded to a
   multiple of ``BLOCK_M``, so that every ``BLOCK_M`` block of sorted rows belongs to one
   expert. Padding rows hold the sentinel ``T * k``.
2. **gate/up GEMM** (``_gate_up_kernel``, grid ``(blocks, ceil(I / BLOCK_N))``): a program
   gathers the token rows of one block, multiplies them by its expert's gate rows and the
   matching up rows (two accumulators in one loop over ``H``) and writes
   ``act(gate) * up`` to the intermediate ``[T * k, I]`` (row = assignment), in the input
   dtype so that the second GEMM runs on tensor cores as the first does.
3. **down GEMM** (``_down_kernel``, grid ``(blocks, ceil(H / BLOCK_N))``): the intermediate
   rows of a block times ``w_down[e]^T``, scaled by each row's routing weight in the
   epilogue, written in fp32 to ``[T, k, H]``.
4. **sum** (``_sum_slots_kernel``, grid ``(T, ceil(H / BLOCK_H))``): ``out[t] = sum_j
   y[t, j]`` for ``j = 0 .. k-1`` in that order, rounded once to the output dtype. No
   atomics: the result does not depend on how programs were scheduled.

Blocks past the last expert's segment (the grid is sized by an upper bound, so no host
read of the block count is needed) leave at once. Expert ids are checked before launching
(one host read; skipped while a CUDA graph is captured) and the align step drops ids
outside ``[0, E)`` in any case, so no kernel reads an expert that does not exist.

Imports ``triton``; under ``TRITON_INTERPRET=1`` (set before ``triton`` is imported) the
kernels run on CPU tensors, which is how the tests run them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torch_topg.reference.fused_moe import ACTIVATIONS

try:
    import triton
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"torch_topg.triton_kernels.fused_moe needs triton (pip install triton): {exc}"
    ) from exc

__all__ = ["CONFIG_KEYS", "MoeAlignment", "default_config", "fused_moe", "moe_align", "supports"]

_OP = "fused_moe"
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)
#: ``activation`` -> the ``ACT`` constant of the kernels (names from the reference's table).
_ACT_CODE = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
assert set(_ACT_CODE) == set(ACTIVATIONS), "the kernels must cover the reference's activations"

#: The keys of ``config``: block sizes of both GEMMs and Triton's launch options.
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_SUM_BLOCK_H = 128


# --- kernels ------------------------------------------------------------------------------


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 0:  # silu
        return x * tl.sigmoid(x)
    elif ACT == 1:  # gelu, exact (erf)
        return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    else:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x * tl.sigmoid(2.0 * z)


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]
    h_ptr,  # [T * k, I] out: act(gate) * up, row = assignment
    sorted_ptr,  # [blocks * BLOCK_M] int32 assignment ids, sentinel n_assign
    block_expert_ptr,  # [blocks] int32, -1 past the last segment
    n_assign,
    hidden,
    inter,
    stride_xt,
    stride_xh,
    stride_we,  # w_gate_up.stride(0) = 2I * H
    up_offset,  # I * H: the up rows after the gate rows
    TOP_K: tl.constexpr,
    ACT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < n_assign
    token = (rows // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    # A: gathered token rows [BLOCK_M, BLOCK_K]; B: weight rows read as [BLOCK_K, BLOCK_N]
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    gate_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * hidden + offs_k[:, None]
    up_ptrs = gate_ptrs + up_offset
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(hidden, BLOCK_K)):
        k_ok = offs_k < hidden - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_xh
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    h = _activation(acc_gate, ACT) * acc_up
    h_ptrs = h_ptr + rows[:, None].to(tl.int64) * inter + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,  # [T * k, I]
    w_ptr,  # [E, H, I]
    weights_ptr,  # [T * k] routing weights
    y_ptr,  # [T * k, H] fp32 out: weight * h @ w_down[e]^T
    sorted_ptr,
    block_expert_ptr,
    n_assign,
    hidden,
    inter,
    stride_we,  # w_down.stride(0) = H * I
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = rows < n_assign
    rows64 = rows.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = h_ptr + rows64[:, None] * inter + offs_k[None, :]
    b_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * inter + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(inter, BLOCK_K)):
        k_ok = offs_k < inter - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    weight = tl.load(weights_ptr + rows64, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    tl.store(
        y_ptr + rows64[:, None] * hidden + offs_n[None, :],
        acc,
        mask=row_ok[:, None] & n_ok[None, :],
    )


@triton.jit
def _sum_slots_kernel(
    y_ptr,  # [T, k, H] fp32
    ids_ptr,  # [T, k] expert ids
    out_ptr,  # [T, H]
    num_experts,
    hidden,
    TOP_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # slots in order 0 .. k-1: a fixed summation order
        e = tl.load(ids_ptr + t * TOP_K + j)
        # a slot whose id align dropped (out of range) was never written: skip it
        slot_ok = (e >= 0) & (e < num_experts)
        acc += tl.load(y_ptr + (t * TOP_K + j) * hidden + offs, mask=h_ok & slot_ok, other=0.0)
    tl.store(out_ptr + t * hidden + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


#: Whether the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` when
#: ``triton.jit`` ran, i.e. when this module was imported).
INTERPRETED: bool = isinstance(_gate_up_kernel, InterpretedFunction)


# --- align --------------------------------------------------------------------------------


class MoeAlignment(NamedTuple):
    """The sorted, padded assignment order of one call (all on the device of the ids).

    ``sorted_ids``: ``[blocks * BLOCK_M]`` int32, flat assignment ids ``t * k + j`` grouped
    by expert, each expert's segment padded with the sentinel ``T * k`` to a multiple of
    ``BLOCK_M``; ``expert_ids``: ``[blocks]`` int32, the expert of each block, ``-1`` for
    blocks past the last segment; ``num_tokens_post_padded``: ``[1]`` int32, the length of
    the used part of ``sorted_ids``. ``blocks`` is the upper bound
    ``ceil(T * k / BLOCK_M) + min(E, T * k)``, known without reading the ids.
    """

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_tokens_post_padded: torch.Tensor


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """Sort the assignments of ``topk_ids`` ``[T, k]`` by expert, padding each expert's
    rows to a multiple of ``block_m`` (see :class:`MoeAlignment`).

    Within an expert, assignments keep their flat order (a stable sort). Ids outside
    ``[0, num_experts)`` are dropped. Torch ops only, no host synchronisation.
    """
    flat = topk_ids.reshape(-1).long()
    n, dev = flat.numel(), flat.device
    blocks = -(-n // block_m) + min(num_experts, n)
    # out-of-range ids go to a bucket past the last expert, which gets no rows
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    # where each bucket starts in `order` (counting by search: no atomics, no host read)
    first = torch.searchsorted(sorted_bucket, torch.arange(num_experts + 1, device=dev))
    padded_blocks = (first[1:] - first[:-1] + block_m - 1) // block_m  # [E]
    block_end = padded_blocks.cumsum(0)  # [E]
    block_start = torch.cat([block_end.new_zeros(1), block_end])  # [E + 1]; [E] = total
    in_bucket = torch.arange(n, device=dev) - first[sorted_bucket]
    pos = block_start[sorted_bucket] * block_m + in_bucket
    # dropped ids are written to one spare slot past the end, then cut off
    pos = torch.where(sorted_bucket < num_experts, pos, blocks * block_m)
    sorted_ids = torch.full((blocks * block_m + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    expert_ids = torch.searchsorted(block_end, torch.arange(blocks, device=dev), right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    total = (block_start[-1:] * block_m).to(torch.int32)
    return MoeAlignment(sorted_ids[:-1], expert_ids, total)


# --- configuration ------------------------------------------------------------------------


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def default_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int) -> dict:
    """Block sizes and launch options for a call of ``T`` tokens, top-``k``, ``E`` experts,
    hidden size ``H`` and expert width ``I``: a plain starting point, until a table tuned
    per GPU and shape replaces it.

    * ``BLOCK_M`` follows the expected rows per expert, ``ceil(T * k / E)``: 16 up to 16
      rows (decode: little padding), 32 up to 64, else 64.
    * ``BLOCK_N`` = ``BLOCK_K`` = the smaller of ``H`` and ``I`` rounded up to a power of
      two, clamped to ``[16, 64]`` (each is the N of one GEMM and the K of the other; the
      gate/up program holds two ``BLOCK_M x BLOCK_N`` accumulators).
    * ``num_warps`` 4 (8 when ``BLOCK_M`` is 64 and ``BLOCK_N`` 64), ``num_stages`` 3.
    """
    rows = -(-num_tokens * top_k // max(num_experts, 1))
    block_m = 16 if rows <= 16 else 32 if rows <= 64 else 64
    block_nk = min(64, max(16, _pow2_at_least(min(hidden, inter))))
    warps = 8 if block_m == 64 and block_nk == 64 else 4
    return {
        "BLOCK_M": block_m,
        "BLOCK_N": block_nk,
        "BLOCK_K": block_nk,
        "num_warps": warps,
        "num_stages": 3,
    }


def _resolve_config(config: dict | None, default: dict) -> dict:
    """``config`` over the defaults; a ``ValueError`` names a key or value it cannot use."""
    if config is None:
        return default
    unknown = sorted(set(config) - set(CONFIG_KEYS))
    if unknown:
        raise ValueError(f"fused_moe config: unknown key(s) {unknown}; expected {CONFIG_KEYS}")
    merged = {**default, **config}
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = merged[key]
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"fused_moe config: {key} must be a power of two >= 16, got {v!r}")
    for key in ("num_warps", "num_stages"):
        v = merged[key]
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"fused_moe config: {key} must be a positive int, got {v!r}")
    return merged


# --- checks -------------------------------------------------------------------------------


def _describe(t: torch.Tensor) -> str:
    shape = ", ".join(map(str, t.shape))
    return f"(shape [{shape}], dtype {_dname(t.dtype)}, device {t.device})"


def _dname(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _require(cond: bool, name: str, t: torch.Tensor, what: str) -> None:
    """``topg::fused_moe: argument '<name>' (shape .., dtype .., device ..) expected <what>``,
    the wording of ``torch_topg/ops/_checks.py`` and the native checks."""
    if not cond:
        raise RuntimeError(f"topg::{_OP}: argument '{name}' {_describe(t)} expected {what}")


def _check_inputs(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> None:
    """The structure checks of the op (same order and messages as the op's own)."""
    named = {
        "hidden_states": hidden_states,
        "w_gate_up": w_gate_up,
        "w_down": w_down,
        "topk_weights": topk_weights,
        "topk_ids": topk_ids,
    }
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(
                f"topg::{_OP}: argument '{name}' expected a Tensor, got {type(t).__name__}"
            )
    x, hs = hidden_states, "hidden_states"
    _require(x.dim() == 2, hs, x, "2 dimensions")
    _require(x.dtype in _FLOAT_DTYPES, hs, x, "dtype " + " or ".join(map(_dname, _FLOAT_DTYPES)))
    hidden, same_dtype = x.shape[1], f"dtype {_dname(x.dtype)} (the dtype of '{hs}')"
    same_device = f"device {x.device} (the device of '{hs}')"
    hidden_size = f"size {hidden} at dim {{}} (the hidden size of '{hs}')"
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        _require(w.dim() == 3, name, w, "3 dimensions")
        _require(w.dtype == x.dtype, name, w, same_dtype)
        _require(w.device == x.device, name, w, same_device)
        if name == "w_gate_up":
            _require(w.shape[2] == hidden, name, w, hidden_size.format(2))
            _require(w.is_contiguous(), name, w, "a contiguous tensor")
            two_inter = w.shape[1]
            _require(two_inter % 2 == 0, name, w, "an even size at dim 1 ([gate; up] rows)")
    experts = w_gate_up.shape[0]
    wd = w_down
    _require(wd.shape[0] == experts, "w_down", wd, f"size {experts} at dim 0 (the experts of 'w_gate_up')")  # fmt: skip
    _require(wd.shape[1] == hidden, "w_down", wd, hidden_size.format(1))
    _require(wd.shape[2] == two_inter // 2, "w_down", wd, f"size {two_inter // 2} at dim 2 (half of dim 1 of 'w_gate_up')")  # fmt: skip
    _require(wd.is_contiguous(), "w_down", wd, "a contiguous tensor")
    tokens, tw, ids = x.shape[0], topk_weights, topk_ids
    _require(tw.dim() == 2, "topk_weights", tw, "2 dimensions")
    _require(tw.dtype in (torch.float32, x.dtype), "topk_weights", tw, same_dtype)
    _require(tw.shape[0] == tokens, "topk_weights", tw, f"size {tokens} at dim 0 (the tokens of '{hs}')")  # fmt: skip
    _require(tw.device == x.device, "topk_weights", tw, same_device)
    _require(ids.dim() == 2, "topk_ids", ids, "2 dimensions")
    _require(ids.dtype in _INDEX_DTYPES, "topk_ids", ids, "dtype int32 or int64")
    _require(ids.device == x.device, "topk_ids", ids, same_device)
    _require(ids.shape[0] == tokens, "topk_ids", ids, f"size {tokens} at dim 0 (the tokens of '{hs}')")  # fmt: skip
    _require(ids.shape[1] == tw.shape[1], "topk_ids", ids, f"size {tw.shape[1]} at dim 1 (the top-k of 'topk_weights')")  # fmt: skip
    if activation not in _ACT_CODE:
        names = ", ".join(f"'{a}'" for a in _ACT_CODE)
        raise RuntimeError(f"topg::{_OP}: activation '{activation}' is not one of {names}")


def _check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Every id in ``[0, E)``: one host read (not while a CUDA graph is captured; align
    drops bad ids anyway, so they never index a weight)."""
    if topk_ids.numel() == 0:
        return
    if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    flat = topk_ids.reshape(-1)
    bad = (flat < 0) | (flat >= num_experts)
    if bool(bad.any()):
        i = int(bad.int().argmax())
        raise RuntimeError(
            f"topg::{_OP}: argument 'topk_ids' holds expert id {int(flat[i])} at flat index {i}, "
            f"expected ids in [0, {num_experts}) (the experts of 'w_gate_up')"
        )


# --- entry points -------------------------------------------------------------------------


def supports(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> str | None:
    """None when :func:`fused_moe` can run this call here, else a short reason.

    Looks at what the kernel can do (activation, dtype, device, interpreter), not at
    whether the call is valid: invalid calls pass and :func:`fused_moe` refuses them with
    the op's error. Reasons: ``"activation 'x'"``, ``"dtype float64"``, ``"bf16 under the
    Triton interpreter"`` (its ``tl.dot`` gives wrong bfloat16 results), ``"device cpu
    without TRITON_INTERPRET"``, ``"device <type>"``, ``"more than 2^31 - 1 assignments"``.
    """
    if activation not in _ACT_CODE:
        return f"activation '{activation}'"
    dtype = hidden_states.dtype
    if dtype not in _FLOAT_DTYPES:
        return f"dtype {_dname(dtype)}"
    device = hidden_states.device.type
    if INTERPRETED:
        if dtype == torch.bfloat16:
            return "bf16 under the Triton interpreter"
    elif device == "cpu":
        return "device cpu without TRITON_INTERPRET"
    elif device != "cuda":
        return f"device {device}"
    if topk_ids.numel() >= 2**31 - 1:  # assignment ids are int32
        return "more than 2^31 - 1 assignments"
    return None


def fused_moe(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    config: dict | None = None,
) -> torch.Tensor:
    """``topg::fused_moe`` with Triton kernels: ``out[t] = sum_j topk_weights[t, j] *
    (act(x Wg[e]^T) * (x Wu[e]^T)) Wd[e]^T``, ``e = topk_ids[t, j]``, ``x = hidden_states[t]``.

    Args:
        hidden_states: ``[T, H]`` float32 / float16 / bfloat16 (any strides).
        w_gate_up: ``[E, 2I, H]`` contiguous, the dtype of ``hidden_states``; rows
            ``0..I-1`` gate, ``I..2I-1`` up.
        w_down: ``[E, H, I]`` contiguous, the dtype of ``hidden_states``.
        topk_weights: ``[T, k]`` float32 or the dtype of ``hidden_states``.
        topk_ids: ``[T, k]`` int32 / int64 in ``[0, E)``; repeats in a row are allowed
            (each slot counts).
        activation: ``"silu"``, ``"gelu"`` (erf) or ``"gelu_tanh"``.
        config: block sizes and launch options (keys :data:`CONFIG_KEYS`); missing keys
            come from :func:`default_config`.

    Returns:
        ``[T, H]`` in the dtype of ``hidden_states``. fp32 accumulation; the
        intermediate ``act(gate) * up`` is stored in the input dtype (as the GPU engines
        do); the k slots are summed in fp32 in slot order and rounded once. fp32 inputs
        use IEEE fp32 dot products (no TF32), as the reference does.

    Raises:
        RuntimeError: a bad argument (named, with what was expected), an expert id outside
            ``[0, E)``, or a call :func:`supports` refuses.
        ValueError: a bad ``config``.
    """
    _check_inputs(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation)
    reason = supports(
        hidden_states, w_gate_up, w_down, topk_weights, topk_ids, activation=activation
    )
    if reason is not None:
        raise RuntimeError(f"topg::{_OP}: the Triton kernel cannot run this call: {reason}")
    tokens, hidden = hidden_states.shape
    experts, inter, top_k = w_gate_up.shape[0], w_down.shape[2], topk_ids.shape[1]
    _check_expert_ids(topk_ids, experts)
    cfg = _resolve_config(config, default_config(tokens, top_k, experts, hidden, inter))
    dev, dtype = hidden_states.device, hidden_states.dtype
    if tokens == 0 or hidden == 0:
        return hidden_states.new_empty(tokens, hidden)
    if inter == 0 or top_k == 0:
        return hidden_states.new_zeros(tokens, hidden)

    n = tokens * top_k
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    precision = "ieee" if dtype == torch.float32 else None  # None: the backend default
    align = moe_align(topk_ids, experts, block_m)
    blocks = align.expert_ids.numel()
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    h = torch.empty(n, inter, dtype=dtype, device=dev)
    y = torch.empty(tokens, top_k, hidden, dtype=torch.float32, device=dev)
    out = torch.empty(tokens, hidden, dtype=dtype, device=dev)

    _gate_up_kernel[(blocks, triton.cdiv(inter, block_n))](
        hidden_states, w_gate_up, h, align.sorted_ids, align.expert_ids, n, hidden, inter,
        hidden_states.stride(0), hidden_states.stride(1), w_gate_up.stride(0), inter * hidden,
        TOP_K=top_k, ACT=_ACT_CODE[activation], PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )  # fmt: skip
    _down_kernel[(blocks, triton.cdiv(hidden, block_n))](
        h, w_down, weights, y, align.sorted_ids, align.expert_ids, n, hidden, inter, w_down.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )  # fmt: skip
    _sum_slots_kernel[(tokens, triton.cdiv(hidden, _SUM_BLOCK_H))](
        y, ids, out, experts, hidden, TOP_K=top_k, BLOCK_H=_SUM_BLOCK_H
    )
    return out
