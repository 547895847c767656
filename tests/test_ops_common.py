"""Every op of the registry on every device, from one ``sample_inputs(op, device)``.

Parametrised by (op, device) with device ``cpu`` and ``cuda`` (skipped without a GPU):

* correctness of the native kernel against the reference (tolerance per dtype);
* ``torch.library.opcheck`` on the first sample;
* ``torch.compile(fullgraph=True)`` of the wrapper, against eager;
* every bad input (tests/op_bad_inputs.py) on the native kernel and on the reference
  fallback, the message matching the expected wording;
* NaN / inf / empty inputs: the native kernel gives what the reference gives.

A test that compares the native kernel with the reference skips when the device has no
native kernel for the op (it would compare the reference with itself): under
``TOPG_DISABLE_NATIVE=1`` those skip and the fallback, fake and compile tests still run.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from conftest import NEEDS_CUDA, TOL
from op_bad_inputs import (
    BAD_INPUTS,
    DISPATCH_KEY,
    SPECIAL_INPUTS,
    bad_inputs,
    call_fallback,
    error_of,
    native_error,
    special_inputs,
)
from op_samples import SAMPLES, sample_inputs

from torch_topg.ops import OPS, OpSpec
from torch_topg.ops._schemas import SCHEMAS

DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]
COLLECTIVES = ("all_reduce", "fused_all_reduce_add_rms_norm")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A 1-rank gloo group for the collectives, destroyed after this module."""
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.fixture
def spec(request, op: str) -> OpSpec:
    if op in COLLECTIVES:
        request.getfixturevalue("world")
    return OPS[op]


def _native_or_skip(spec: OpSpec, device: str) -> None:
    if not spec.has_kernel(DISPATCH_KEY[device]):
        pytest.skip(
            f"no {DISPATCH_KEY[device]} kernel for topg::{spec.name}: the fallback is the reference"
        )


def _clone(x):
    return x.clone() if isinstance(x, torch.Tensor) else x


def _run(fn, spec: OpSpec, args: tuple, kwargs: dict) -> list:
    """The results of ``fn`` on copies of the arguments, then the arguments it writes."""
    args = tuple(map(_clone, args))
    kwargs = {k: _clone(v) for k, v in kwargs.items()}
    out = fn(*args, **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [] if out is None else [out]
    index = {n: spec.arg_names.index(n) for n in spec.mutated_args}
    written = (args[i] if i < len(args) else kwargs.get(n) for n, i in index.items())
    return outs + [t for t in written if t is not None]


def _compare(
    got: list, expected: list, dtype: torch.dtype, scale: float = 1.0, equal_nan=False
) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
        if not b.is_floating_point():
            assert torch.equal(a, b), (a, b)
        else:
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(
                a, b, atol=atol * scale, rtol=rtol * scale, equal_nan=equal_nan
            )


def test_every_op_has_samples():
    assert set(OPS) == set(SCHEMAS), "an op without a registry entry (or the reverse)"
    assert set(SAMPLES) == set(OPS), "every op in the registry needs samples in tests/op_samples.py"
    assert set(BAD_INPUTS) == set(OPS) and set(SPECIAL_INPUTS) == set(OPS)
    for name, s in OPS.items():
        assert s.wrapper is not None and s.wrapper.__name__ == name
        assert s.has_kernel("CompositeExplicitAutograd"), name  # the fallback


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
def test_correctness(spec, device):
    _native_or_skip(spec, device)
    for s in sample_inputs(spec.name, device):
        got = _run(spec.wrapper, spec, s.args, s.kwargs)
        expected = _run(spec.reference, spec, s.args, s.kwargs)
        try:
            _compare(got, expected, s.dtype, s.scale)
        except AssertionError as e:
            raise AssertionError(f"sample '{s.desc}': {e}") from None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
def test_opcheck(spec, device):
    s = sample_inputs(spec.name, device)[0]
    torch.library.opcheck(spec.overload, tuple(map(_clone, s.args)), dict(s.kwargs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
def test_compile_fullgraph(spec, device):
    s = sample_inputs(spec.name, device)[0]
    wrapper = spec.wrapper

    def fn(*args, **kwargs):
        out = wrapper(*args, **kwargs)
        return out, args  # in-place results are read from the arguments

    torch._dynamo.reset()  # one function for every op: no recompilation limit
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = _run(lambda *a, **k: compiled(*a, **k)[0], spec, s.args, s.kwargs)
    expected = _run(wrapper, spec, s.args, s.kwargs)
    _compare(got, expected, s.dtype, s.scale)


def _cases(inputs) -> list:  # type: ignore[no-untyped-def]
    """(op, device, case) parameters for every case ``inputs(op, "cpu")`` lists."""
    cases = []
    for op in OPS:
        for case in inputs(op, "cpu"):
            for device in DEVICES:
                dev = device if isinstance(device, str) else device.values[0]
                marks = list(getattr(device, "marks", ()))
                cases.append(
                    pytest.param(op, dev, case.desc, marks=marks, id=f"{op}-{dev}-{case.desc}")
                )
    return cases


def _expect(op: str, match: str, msg: str | None, path: str) -> None:
    assert msg is not None, f"{path}: no error"
    assert re.search(re.escape(f"topg::{op}: ") + match, msg), (
        f"{path}: {msg!r} does not match {match!r}"
    )


@pytest.mark.parametrize(("op", "device", "desc"), _cases(bad_inputs))
def test_bad_input(spec, device, desc):
    """The fallback refuses the call in the expected words; so does the native kernel
    (where there is one)."""
    case = next(c for c in bad_inputs(spec.name, device) if c.desc == desc)
    _expect(
        spec.name,
        case.match,
        error_of(lambda: call_fallback(spec, case.args, case.kwargs)),
        "fallback",
    )
    if not spec.has_kernel(DISPATCH_KEY[device]):
        return
    _expect(spec.name, case.match, native_error(spec.name, device, desc), "native")


@pytest.mark.parametrize(("op", "device", "desc"), _cases(special_inputs))
def test_nan_inf_empty(spec, device, desc):
    """NaN, inf and empty inputs: the native kernel gives what the reference gives (NaN
    in the same places; ``finite`` cases: no NaN at all)."""
    _native_or_skip(spec, device)
    s = next(c for c in special_inputs(spec.name, device) if c.desc == desc)
    got = _run(spec.wrapper, spec, s.args, s.kwargs)
    expected = _run(spec.reference, spec, s.args, s.kwargs)
    _compare(got, expected, s.dtype, equal_nan=True)
    if s.finite:
        assert all(t.isfinite().all() for t in got if t.is_floating_point()), "not finite"
