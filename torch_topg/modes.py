"""Process-wide kernel modes: ``torch_topg.index_checks``, batch invariance, the CPU kernels'
forms."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch

from torch_topg import _native


def set_index_checks(enabled: bool) -> bool:
    """Turn the CUDA kernels' index checks on or off for the whole process; returns the
    previous setting.

    With the checks on, each CUDA call of ``rotary_embedding`` (positions),
    ``reshape_and_cache`` (slots), ``paged_attention`` (block ids, lengths, offsets) and
    ``fused_moe`` (expert ids) validates those values before launching and raises an error
    naming the argument, at the cost of one host synchronisation per call (skipped while
    a CUDA graph is captured). Off by default (``TOPG_CUDA_INDEX_CHECKS=1`` at start-up
    turns them on), as in vLLM and flash-attn: the kernels bound every index themselves,
    so a bad index never reads or writes out of range, but it gives wrong values instead
    of an error. The CPU kernels always check (their indices are already on the host).
    """
    if not _native.is_loaded():
        return False  # no CUDA kernels: the reference fallback always checks
    return bool(torch.ops.topg._set_index_checks.default(bool(enabled)))


@contextlib.contextmanager
def index_checks(enabled: bool = True) -> Iterator[None]:
    """``with torch_topg.index_checks():`` the CUDA index checks on inside the block
    (see :func:`set_index_checks`); the previous setting is restored on exit."""
    prev = set_index_checks(enabled)
    try:
        yield
    finally:
        set_index_checks(prev)


_batch_invariant = {"on": False}


def batch_invariant_enabled() -> bool:
    """Whether :func:`batch_invariant_mode` is on in this process. The CUDA dispatch
    (``torch_topg.ops.dispatch``) reads it: while it is on, each op runs one fixed
    implementation, whatever the batch or the tuning table."""
    return _batch_invariant["on"]


def batch_invariant_mode() -> Callable[[], None]:
    """Turn on the kernels' batch-invariant mode (``topg::_set_batch_invariant``: a row's
    result does not depend on the other rows of the batch) for the whole process; returns
    the function that restores the previous setting. ``Engine(deterministic=True)`` uses
    it. The CUDA dispatch then fixes one implementation per op
    (:func:`batch_invariant_enabled`). Without the native kernels the reference runs,
    whose invariance is not guaranteed: a ``RuntimeWarning`` says so and the kernels'
    mode is not changed."""
    was = _batch_invariant["on"]
    _batch_invariant["on"] = True

    def restore_flag() -> None:
        _batch_invariant["on"] = was

    if not _native.is_loaded():
        warnings.warn(
            "Engine(deterministic=True): the native kernels are not loaded, so the reference "
            "fallback runs and batch invariance is not guaranteed",
            RuntimeWarning,
            stacklevel=4,
        )
        return restore_flag
    prev = torch.ops.topg._set_batch_invariant.default(True)

    def restore() -> None:
        torch.ops.topg._set_batch_invariant.default(prev)
        restore_flag()

    return restore


def cpu_kernels() -> list[str]:
    """The instruction-set forms the native CPU kernels chose at run time, from the CPU's
    features and the ``TOPG_DISABLE_AVX512`` / ``TOPG_DISABLE_AMX`` switches: ``"avx2"``
    (the build's baseline), ``"avx512"`` (fp32 GEMV of 3-16 rows; 1-16 on Intel CPUs),
    ``"avx512_bf16"`` (bf16 GEMV and paged attention), ``"avx512_bf16split"`` (bf16 GEMV of
    1-16 rows on AVX-512 CPUs without BF16), ``"avx512_vnni"`` (int8-activation GEMV and GEMM),
    ``"amx_bf16"`` (bf16 GEMV of 1-16 rows on AMX tiles). Empty without the native library.
    Benchmarks record it beside their figures."""
    if not _native.is_loaded():
        return []
    return list(torch.ops.topg._cpu_kernels.default())


def set_amx(enabled: bool) -> bool:
    """Turn the AMX bf16 GEMV (1-16 rows: decode and verify steps) on or off for the whole
    process from the next call; returns whether it was in use. Off, those calls take the
    AVX-512 BF16 path. For comparing both paths in one process (``TOPG_DISABLE_AMX=1`` at
    start-up turns it off for good); a CPU without AMX ignores it."""
    if not _native.is_loaded():
        return False
    return bool(torch.ops.topg._set_amx.default(bool(enabled)))
