"""Argument checks shared by the fake kernels and the reference fallback.

Messages use the same wording as the native checks in ``csrc/common/checks.h`` and
``csrc/common/op_checks.h`` (``tests/test_check_wording.py`` compares them):
``topg::<op>: argument '<name>' (shape [..], dtype .., device ..) expected <what>``.
Size comparisons go through ``torch._check`` so they also hold for symbolic sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def _dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def describe(t: torch.Tensor) -> str:
    """``(shape [..], dtype .., device ..)``, as ``describe`` in ``csrc/common/checks.h``."""
    return (
        f"(shape [{', '.join(map(str, t.shape))}], dtype {_dtype_name(t.dtype)}, device {t.device})"
    )


class Arg:
    """Fluent checker for one tensor argument of one op."""

    def __init__(self, op: str, name: str, t: object) -> None:
        self.op, self.name = op, name
        if not isinstance(t, torch.Tensor):
            raise RuntimeError(
                f"topg::{op}: argument '{name}' expected a Tensor, got {type(t).__name__}"
            )
        self.t = t

    def message(self, what: str) -> Callable[[], str]:
        """The message, built lazily (``torch._check`` only formats it on failure)."""
        return lambda: f"topg::{self.op}: argument '{self.name}' {describe(self.t)} expected {what}"

    def fail(self, what: str) -> NoReturn:
        raise RuntimeError(self.message(what)())

    def dim(self, *ndims: int) -> Arg:
        if self.t.dim() not in ndims:
            self.fail(f"{' or '.join(map(str, ndims))} dimensions")
        return self

    def min_dim(self, n: int) -> Arg:
        if self.t.dim() < n:
            self.fail(f"at least {n} dimensions")
        return self

    def size(self, d: int, expected: int, what: str | None = None) -> Arg:
        torch._check(
            self.t.shape[d] == expected,
            self.message(f"size {expected} at dim {d}" + (f" ({what})" if what else "")),
        )
        return self

    def dtype(self, dtypes: Sequence[torch.dtype]) -> Arg:
        if self.t.dtype not in dtypes:
            self.fail("dtype " + " or ".join(_dtype_name(d) for d in dtypes))
        return self

    def floating(self) -> Arg:
        return self.dtype(FLOAT_DTYPES)

    def index(self) -> Arg:
        return self.dtype(INDEX_DTYPES)

    def same_dtype(self, other: torch.Tensor, other_name: str) -> Arg:
        if self.t.dtype != other.dtype:
            self.fail(f"dtype {_dtype_name(other.dtype)} (the dtype of '{other_name}')")
        return self

    def same_device(self, other: torch.Tensor, other_name: str) -> Arg:
        if self.t.device != other.device:
            self.fail(f"device {other.device} (the device of '{other_name}')")
        return self

    def contiguous(self) -> Arg:
        if not self.t.is_contiguous():
            self.fail("a contiguous tensor")
        return self

    def last_dim_contiguous(self) -> Arg:
        if self.t.dim() > 0 and self.t.shape[-1] != 1 and self.t.stride(-1) != 1:
            self.fail("stride 1 in the last dimension")
        return self


def check_op(cond: bool, op: str, message: str) -> None:
    """A check that concerns several arguments or a non-tensor argument."""
    if not cond:
        raise RuntimeError(f"topg::{op}: {message}")
