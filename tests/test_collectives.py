"""topg::all_reduce and topg::fused_all_reduce_add_rms_norm: argument checks, fake
kernels, opcheck and the compile pass in a 1-rank gloo group (in process); the sums and
the fusion against the reference in a spawned 2-rank group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from compile_utils import compile_topg, replaced
from conftest import assert_close
from torch._subclasses.fake_tensor import FakeTensorMode
from tp_utils import assert_ok, run_ranks

from torch_topg import ops, reference


def test_needs_a_process_group():
    # every in-process group of the suite is destroyed after use: a leaked one fails here
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    with pytest.raises(RuntimeError, match="'group_name' .* torch.distributed is not init"):
        torch.ops.topg.all_reduce(torch.ones(2), "0")
    with pytest.raises(RuntimeError, match="argument 'group' needs torch.distributed"):
        ops.all_reduce(torch.ones(2))


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_world_of_one_is_identity(group, dtype):
    x, r, w = torch.randn(3, 16).to(dtype), torch.randn(3, 16).to(dtype), torch.rand(16).to(dtype)
    assert torch.equal(ops.all_reduce(x, group), x)
    a, ra = x.clone(), r.clone()
    ops.fused_all_reduce_add_rms_norm(a, ra, w, 1e-5, group)
    b, rb = x.clone(), r.clone()
    reference.fused_add_rms_norm(b, rb, w, 1e-5)
    assert_close(a, b, dtype)
    assert torch.equal(ra, rb)


def test_opcheck(group):
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32)
    torch.library.opcheck(torch.ops.topg.all_reduce.default, (x, group))
    torch.library.opcheck(
        torch.ops.topg.fused_all_reduce_add_rms_norm.default, (x, r, w, 1e-6, group)
    )


@pytest.mark.parametrize("fake", [False, True])
def test_bad_inputs_name_the_argument(group, fake):
    x, r, w = torch.randn(4, 32), torch.randn(4, 32), torch.rand(32)
    cases = [
        ("all_reduce", (x.long(), group), "argument 'input'"),
        ("all_reduce", (x, ""), "argument 'group_name'"),
        ("fused_all_reduce_add_rms_norm", (x, r[:2], w, 1e-6, group), "argument 'residual'"),
        ("fused_all_reduce_add_rms_norm", (x, r, w[:8], 1e-6, group), "argument 'weight'"),
        ("fused_all_reduce_add_rms_norm", (x.t(), r.t(), w[:4], 1e-6, group), "argument 'input'"),
        ("fused_all_reduce_add_rms_norm", (x, r.half(), w, 1e-6, group), "argument 'residual'"),
    ]
    for op, args, msg in cases:
        fn = getattr(torch.ops.topg, op).default
        if fake:
            with FakeTensorMode() as mode:
                args = tuple(
                    mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args
                )
                with pytest.raises(RuntimeError, match=msg):
                    fn(*args)
        else:
            with pytest.raises(RuntimeError, match=f"topg::{op}: {msg}"):
                fn(*args)
    if not fake:
        with pytest.raises(RuntimeError, match="'group_name' \\('nope'\\) is not a known"):
            torch.ops.topg.all_reduce(x, "nope")


def _llama_rms(x, w, eps=1e-6):
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@pytest.mark.parametrize("disable", [(), ("add_rms_norm",)])
def test_all_reduce_norm_pass(group, disable):
    """A tensor-parallel residual stream: h2 = h + all_reduce(linear(h)); norm(h2).
    Fused after ``add_rms_norm`` (form A) and without it (form B)."""
    x, w = torch.randn(3, 32), torch.rand(32)
    a, b = torch.randn(32, 32) * 0.2, torch.randn(32, 32) * 0.2

    def fn(x, w, a, b):
        h = F.linear(x, a)
        h2 = h + torch.ops.topg.all_reduce.default(F.linear(h, b), group)
        return F.linear(_llama_rms(h2, w), b), h2 * 2

    expected, actual, sites = compile_topg(fn, x, w, a, b, options={"disable": list(disable)})
    assert replaced(sites, "all_reduce_norm") == (1, 1), sites
    for e, o in zip(expected, actual, strict=True):
        assert_close(o, e, scale=4)


def test_all_reduce_norm_pass_keeps_shared_input(group):
    """The all-reduce input is read again later: it must not be overwritten in place."""
    x, w, a = torch.randn(3, 32), torch.rand(32), torch.randn(32, 32) * 0.2

    def fn(x, w, a):
        h = F.linear(x, a)
        p = F.linear(h, a)
        h2 = h + torch.ops.topg.all_reduce.default(p, group)
        return _llama_rms(h2, w), p * 3

    expected, actual, sites = compile_topg(fn, x, w, a)
    assert replaced(sites, "all_reduce_norm")[0] == 0
    for e, o in zip(expected, actual, strict=True):
        assert_close(o, e, scale=4)


def test_two_ranks_against_reference(tmp_path):
    """all_reduce (float32 / bfloat16 / float16, awkward shapes, non-contiguous input,
    compiled) and the fused op against the reference and the unfused sequence."""
    results = run_ranks("collectives", tmp_path, timeout=90)
    assert_ok(results)
    for r in results:
        assert len(r.lines("OK ")) == 29, r.output
