"""Shared test set-up: hypothesis profiles, tolerances, kernel-presence skips.

Profiles: ``ci`` (default, quick) and ``thorough`` (on demand):
    TOPG_HYPOTHESIS_PROFILE=thorough make test
The thorough profile also runs the whole product of the model-level test matrices that
the quick one covers by halves (``cover``).
"""

from __future__ import annotations

import os

import pytest
import torch

# Triton decides at import whether its kernels run compiled or in its interpreter, and
# other tests import triton (xgrammar does, the dispatch tests may import the Triton
# kernels): without a GPU the suite runs Triton's interpreter from the start, so the
# Triton kernel tests do not depend on the order the files run in.
if not torch.cuda.is_available() and not os.environ.get("TOPG_TRITON_TEST_CUDA"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

import torch_topg
from torch_topg import _native
from torch_topg.ops import dispatch

# On CUDA, attention / paged_attention / fused_moe / linear run a measured choice among
# several implementations (docs/gpu.md, "Dispatch"). The CUDA tests check topg's own
# kernels, so the suite asks for them; tests/test_cuda_dispatch.py lifts this to check the
# other candidates and the choice itself. CPU calls are not affected.
dispatch.force("topg")

settings.register_profile(
    "ci",
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("TOPG_HYPOTHESIS_PROFILE", "ci"))
THOROUGH = os.environ.get("TOPG_HYPOTHESIS_PROFILE") == "thorough"


def cover(*axes: list) -> list[tuple]:
    """The cases of a model-level test matrix (each case compiles or builds a model: 5-10 s
    on 2 cores): the whole product with the thorough profile; otherwise the cases whose
    indices along the axes sum to an even number, half of them, in which every value of
    every axis appears and, for three axes of which two have two values, every pair of
    values of any two axes (for example 4 presets x batch 1, 8 x fp32, bf16: 8 of 16,
    each preset at both batches and in both dtypes, each batch in both dtypes)."""
    import itertools

    cases = itertools.product(*(list(enumerate(a)) for a in axes))
    return [
        tuple(v for _, v in case) for case in cases if THOROUGH or sum(i for i, _ in case) % 2 == 0
    ]


DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (atol, rtol) for comparing a kernel with its fp32-math reference, per output dtype.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-3, 2e-3),
}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype | None = None,
    scale: float = 1.0,
) -> None:
    """Compare with the tolerance of ``dtype`` (default: ``expected.dtype``), widened by ``scale``."""
    atol, rtol = TOL[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol * scale, rtol=rtol * scale)


def requires_kernel(op: str, key: str = "CPU"):
    """Skip unless ``topg::<op>`` has a native kernel at ``key`` (asks the dispatcher).

    Comparing the op with its reference when no kernel is registered would compare the
    reference with itself, a test that cannot fail.
    """
    return pytest.mark.skipif(
        not _native.has_kernel(op, key),
        reason=f"no native {key} kernel registered for topg::{op} "
        f"({_native.missing_reason(key.lower())})",
    )


NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device: torch.cuda.is_available() is False",
)


def requires_cuda_kernel(op: str):
    """Skip without a CUDA device (said first: it is the deeper reason), else unless
    ``topg::<op>`` has a native kernel at the CUDA key."""
    return NEEDS_CUDA if not torch.cuda.is_available() else requires_kernel(op, "CUDA")


def pytest_sessionstart(session: pytest.Session) -> None:
    # `make test` builds the extension and sets TOPG_REQUIRE_NATIVE=1: a build that did
    # not load must fail the run, not turn every kernel test into a skip.
    if os.environ.get("TOPG_REQUIRE_NATIVE") == "1" and not _native.is_loaded():
        raise pytest.UsageError(
            f"TOPG_REQUIRE_NATIVE=1 but the native extension is not loaded: "
            f"{_native.missing_reason('cpu')}"
        )
    # The CUDA kernels check index values (block ids, slots, positions, expert ids) only
    # when asked (a host sync per call); the suite asks, so that its bad-index cases hold
    # on every device. tests/test_cuda_sync.py turns them off to show the hot path has no
    # synchronisation.
    torch_topg.set_index_checks(True)
