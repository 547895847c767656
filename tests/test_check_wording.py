"""Each argument check says the same thing on every path.

For every bad input of tests/op_bad_inputs.py that a structure check refuses (shape,
dtype, device, layout), the native kernel of the device (C++, ``csrc/common/op_checks.h``),
the reference fallback (``CompositeExplicitAutograd``, the Python check of ``torch_topg/ops``)
and the fake kernel (``FakeTensorMode``, the same Python check) must raise the very same
message: ``topg::<op>: argument '<name>' (shape [..], dtype .., device ..) expected <what>``.

The samples of tests/op_samples.py pass every Python check (no path is stricter than
the native one).

Value checks (positions, slots, block ids, offsets, expert ids) need the data: the fake
cannot run them, and the reference words them without the tensor's description; they are
matched by regex on the native and fallback paths in tests/test_ops_common.py.

Under ``TOPG_DISABLE_NATIVE=1`` only the fallback and the fake are compared.
"""

from __future__ import annotations

import pytest
from conftest import NEEDS_CUDA
from op_bad_inputs import (
    DISPATCH_KEY,
    bad_inputs,
    call_fake,
    call_fallback,
    error_of,
    native_error,
)
from op_samples import sample_inputs

from torch_topg.ops import OPS


def _cases() -> list:
    cases = []
    for op in OPS:
        for case in bad_inputs(op, "cpu"):
            if case.value_check:
                continue
            for device, marks in (("cpu", []), ("cuda", [NEEDS_CUDA])):
                cases.append(
                    pytest.param(
                        op, device, case.desc, marks=marks, id=f"{op}-{device}-{case.desc}"
                    )
                )
    return cases


@pytest.mark.parametrize(("op", "device", "desc"), _cases())
def test_same_message_on_every_path(op, device, desc):
    spec = OPS[op]
    case = next(c for c in bad_inputs(op, device) if c.desc == desc)
    messages = {
        "fallback": error_of(lambda: call_fallback(spec, case.args, case.kwargs)),
        "fake": error_of(lambda: call_fake(spec, case.args, case.kwargs)),
    }
    if spec.has_kernel(DISPATCH_KEY[device]):
        messages["native"] = native_error(op, device, desc)
    assert messages["fallback"] is not None, "the fallback accepted the bad input"
    assert messages["fallback"].startswith(f"topg::{op}: "), messages["fallback"]
    differ = {path: m for path, m in messages.items() if m != messages["fallback"]}
    assert not differ, f"fallback says {messages['fallback']!r}; " + "; ".join(
        f"{path} says {m!r}" for path, m in differ.items()
    )


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)])
@pytest.mark.parametrize("op", list(OPS))
def test_valid_samples_pass_every_check(op, device):
    """No check is stricter in Python than in C++: every sample (which the native kernel
    runs in test_ops_common) passes the Python check and the fake kernel."""
    spec = OPS[op]
    for s in sample_inputs(op, device):
        spec.check(*s.args, **s.kwargs)
        call_fake(spec, s.args, s.kwargs)


def test_every_op_has_a_structure_check_case():
    for op in OPS:
        assert any(not c.value_check for c in bad_inputs(op, "cpu")), op
