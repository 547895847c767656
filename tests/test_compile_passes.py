"""Each pass of the topg backend on the smallest function that has its pattern: the
compiled output matches eager and the site is reported replaced (or not, with why)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from compile_utils import all_replaced, compile_topg, replaced
from conftest import assert_close
from hypothesis import example, given
from hypothesis import strategies as st

from torch_topg.compile.passes import PASS_NAMES

FLOATS = [torch.float32, torch.bfloat16]


def _rand(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


def _repeat_kv(x, n):  # transformers' repeat_kv
    b, h, s, d = x.shape
    if n == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


# --- attention ------------------------------------------------------------------------
@given(
    b=st.integers(1, 2),
    s=st.integers(1, 19),
    hkv=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    d=st.sampled_from([8, 16, 24]),
    dtype=st.sampled_from(FLOATS),
    causal=st.booleans(),
    gqa=st.sampled_from(["enable_gqa", "repeat_kv"]),
)
@example(b=1, s=1, hkv=1, group=1, d=8, dtype=torch.float32, causal=False, gqa="enable_gqa")
def test_sdpa(b, s, hkv, group, d, dtype, causal, gqa):
    hq = hkv * group
    q, k, v = (
        _rand(b, hq, s, d, dtype=dtype),
        _rand(b, hkv, s, d, dtype=dtype),
        _rand(b, hkv, s, d, dtype=dtype),
    )

    def fn(q, k, v):
        if gqa == "enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=group > 1)
        return F.scaled_dot_product_attention(
            q, _repeat_kv(k, group), _repeat_kv(v, group), is_causal=causal
        )

    expected, actual, sites = compile_topg(fn, q, k, v)
    all_replaced(sites, "attention")
    assert_close(actual, expected, dtype, scale=2)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_sdpa_padding_mask(dtype, kind):
    b, h, s, d = 2, 4, 9, 16
    q, k, v = (_rand(b, h, s, d, dtype=dtype) for _ in range(3))
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, :3] = False  # left padding of the first sequence
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    mask = causal[None, None] & keep[:, None, None, :]
    mask[0, :, :3, 0] = True  # padded queries see one key (no fully masked rows)
    if kind == "additive":
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)

    expected, actual, sites = compile_topg(fn, q, k, v, mask)
    all_replaced(sites, "attention")
    assert_close(actual, expected, dtype, scale=2)


def test_sdpa_not_replaced():
    q = _rand(1, 2, 4, 8)
    k = _rand(1, 2, 6, 8)

    def dropout(q, k):  # dropout is not topg's business
        return F.scaled_dot_product_attention(q, k, k, dropout_p=0.5)

    def top_left_causal(q, k):  # Sq != Sk: SDPA's is_causal is top-left aligned
        return F.scaled_dot_product_attention(q, k, k, is_causal=True)

    _, _, sites = compile_topg(top_left_causal, q, k)
    assert replaced(sites, "attention") == (0, 1)
    assert "not provably equal" in sites[0].detail
    torch._dynamo.reset()
    with torch.inference_mode():
        torch.compile(dropout, backend="topg")(q, k)  # runs (random), not replaced


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("masked", [False, True])
def test_eager_attention(dtype, masked):
    """transformers' eager_attention_forward: matmul -> (+mask) -> softmax fp32 -> matmul."""
    b, hkv, group, s, d = 1, 2, 2, 7, 16
    q = _rand(b, hkv * group, s, d, dtype=dtype)
    k, v = _rand(b, hkv, s, d, dtype=dtype), _rand(b, hkv, s, d, dtype=dtype)
    mask = torch.zeros(b, 1, s, s, dtype=dtype)
    mask.masked_fill_(~torch.tril(torch.ones(s, s, dtype=torch.bool)), torch.finfo(dtype).min)

    def fn(q, k, v, mask):
        ks, vs = _repeat_kv(k, group), _repeat_kv(v, group)
        w = torch.matmul(q, ks.transpose(2, 3)) * (1.0 / math.sqrt(d))
        if masked:
            w = w + mask
        w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        w = F.dropout(w, p=0.0, training=False)
        return torch.matmul(w, vs).transpose(1, 2).contiguous()

    expected, actual, sites = compile_topg(fn, q, k, v, mask)
    all_replaced(sites, "attention")
    assert_close(actual, expected, dtype, scale=2)


# --- norms ----------------------------------------------------------------------------
def _llama_rms(x, w, eps=1e-6):
    dt = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return w * h.to(dt)


@given(t=st.integers(1, 9), h=st.sampled_from([8, 33, 64]), dtype=st.sampled_from(FLOATS))
def test_rms_norm(t, h, dtype):
    x, w = _rand(t, h, dtype=dtype), _rand(h, dtype=dtype)
    expected, actual, sites = compile_topg(lambda x, w: _llama_rms(x, w) * 2, x, w)
    all_replaced(sites, "rms_norm")
    assert_close(actual, expected, dtype, scale=2)


def _olmo2_rms(x, w, eps=1e-6):  # the weight applied in float32, rounded once
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (w * h).to(x.dtype)


def _gemma_rms(x, w, eps=1e-6):  # (1 + w) in float32, rounded once
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("norm", [_olmo2_rms, _gemma_rms], ids=["olmo2", "gemma"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_rounded_once(norm, dtype):
    """(w * y).to(x.dtype) with a float32 product: replaced in every dtype (topg rounds
    once, as this form does), not only where the product is already in x's dtype."""
    x, w = _rand(5, 33, dtype=dtype), _rand(33, dtype=dtype)
    expected, actual, sites = compile_topg(lambda x, w: norm(x, w) * 2, x, w)
    all_replaced(sites, "rms_norm")
    assert_close(actual, expected, dtype, scale=2)


def test_functional_rms_norm():
    x, w = _rand(5, 32), _rand(32)
    fn = lambda x, w: F.rms_norm(x, (32,), w, 1e-5)  # noqa: E731
    expected, actual, sites = compile_topg(fn, x, w)
    all_replaced(sites, "rms_norm")
    assert_close(actual, expected)


@pytest.mark.parametrize("dtype", FLOATS)
def test_add_rms_norm(dtype):
    """A residual stream: h = x + f(x); y = norm(h); out = h + g(y)."""
    x = _rand(3, 32, dtype=dtype)
    w1, w2 = _rand(32, dtype=dtype), _rand(32, dtype=dtype)
    a, b = _rand(32, 32, dtype=dtype, scale=0.2), _rand(32, 32, dtype=dtype, scale=0.2)

    def fn(x, w1, w2, a, b):
        h = x @ a
        h = h + F.linear(h, b)
        y = _llama_rms(h, w1)
        h2 = h + F.linear(y, a)
        return F.linear(_llama_rms(h2, w2), b), h2

    expected, actual, sites = compile_topg(fn, x, w1, w2, a, b)
    all_replaced(sites, "rms_norm", at_least=2)
    assert replaced(sites, "add_rms_norm")[0] >= 1
    for e, o in zip(expected, actual, strict=True):
        assert_close(o, e, dtype, scale=4)


def test_add_rms_norm_keeps_inputs():
    """An operand that is a graph input or read later is never overwritten in place."""
    x, r, w = _rand(4, 16), _rand(4, 16), _rand(16)
    fn = lambda x, r, w: (_llama_rms(x + r, w), x * 2, r)  # noqa: E731
    expected, actual, sites = compile_topg(fn, x, r, w)
    assert replaced(sites, "add_rms_norm")[0] == 0
    for e, o in zip(expected, actual, strict=True):
        assert_close(o, e)


# --- rotary ---------------------------------------------------------------------------
def _rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


@given(
    b=st.integers(1, 2),
    s=st.integers(1, 11),
    d=st.sampled_from([8, 32]),
    dtype=st.sampled_from(FLOATS),
    start=st.integers(0, 50),
)
def test_rotary(b, s, d, dtype, start):
    """transformers' rotary module + apply_rotary_pos_emb on projection outputs."""
    hq, hk = 4, 2
    x = _rand(b, s, 16, dtype=dtype)
    wq, wk = _rand(hq * d, 16, dtype=dtype), _rand(hk * d, 16, dtype=dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))

    def fn(x, wq, wk, inv_freq):
        pos = (torch.arange(s) + start)[None]
        freqs = pos[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * 1.0).to(x.dtype), (emb.sin() * 1.0).to(x.dtype)
        q = F.linear(x, wq).view(b, s, -1, d).transpose(1, 2)
        k = F.linear(x, wk).view(b, s, -1, d).transpose(1, 2)
        c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + _rotate_half(q) * sn, k * c + _rotate_half(k) * sn

    expected, actual, sites = compile_topg(fn, x, wq, wk, inv_freq)
    all_replaced(sites, "rotary", at_least=2)
    for e, o in zip(expected, actual, strict=True):
        assert_close(o, e, dtype, scale=4)


# --- MLP, linear ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gated_mlp_fuses_weights_once(dtype, act):
    mlp = torch.nn.ModuleDict(
        {
            "gate": torch.nn.Linear(16, 40, bias=False),
            "up": torch.nn.Linear(16, 40, bias=False),
            "down": torch.nn.Linear(40, 16, bias=False),
        }
    ).to(dtype)
    f = {
        "silu": F.silu,
        "gelu": F.gelu,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    }[act]

    def fn(x):
        return mlp["down"](f(mlp["gate"](x)) * mlp["up"](x))

    x = _rand(3, 16, dtype=dtype)
    expected, actual, sites = compile_topg(fn, x)
    all_replaced(sites, "mlp")
    assert_close(actual, expected, dtype, scale=2)
    # gate and up now live in one buffer: resident once, not twice
    g, u = mlp["gate"].weight, mlp["up"].weight
    assert g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
    assert g.untyped_storage().nbytes() == 2 * g.numel() * g.element_size()
    # and an in-place update of a parameter reaches the fused buffer
    with torch.no_grad():
        mlp["up"].weight.mul_(0.5)
    e2, a2, _ = compile_topg(fn, x)
    assert_close(a2, e2, dtype, scale=2)


@pytest.mark.parametrize("fmt", ["q4_1", "int8"])
def test_gated_mlp_fuses_quantised_gate_up(fmt):
    """QuantizedLinear gate / up: one linear_q over their packed rows concatenated (the
    buffers re-pointed into it), then silu_and_mul; equal to eager within fp32
    tolerance (eager's silu is aten's)."""
    from torch_topg.quant import QuantizedLinear

    lin = {
        n: torch.nn.Linear(64, o, bias=False) for n, o in (("gate", 96), ("up", 96), ("down", 64))
    }
    mlp = torch.nn.ModuleDict({n: QuantizedLinear.from_linear(m, fmt) for n, m in lin.items()})

    def fn(x):
        return F.silu(mlp["gate"](x)) * mlp["up"](x)

    x = _rand(3, 64)
    expected, actual, sites = compile_topg(fn, x)
    all_replaced(sites, "mlp")
    assert any("gate/up fused (" + fmt + ")" in s.detail for s in sites)
    assert_close(actual, expected, torch.float32)
    g, u = mlp["gate"].qweight, mlp["up"].qweight
    assert g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()


@given(
    m=st.integers(1, 20),
    k=st.sampled_from([8, 24]),
    n=st.sampled_from([4, 16]),
    dtype=st.sampled_from(FLOATS),
    bias=st.booleans(),
)
def test_linear(m, k, n, dtype, bias):
    lin = torch.nn.Linear(k, n, bias=bias).to(dtype)
    x = _rand(m, k, dtype=dtype)
    expected, actual, sites = compile_topg(lin, x)
    all_replaced(sites, "linear")
    assert_close(actual, expected, dtype, scale=2)


def test_qkv_fusion():
    """Projections of one input that are reshaped into heads become one linear."""
    x = _rand(2, 3, 16)
    ws = [_rand(n, 16) for n in (16, 8, 8)]
    ps = [torch.nn.Parameter(w) for w in ws]

    def fn(x):
        return tuple(F.linear(x, p).view(2, 3, -1, 4).transpose(1, 2) for p in ps)

    expected, actual, sites = compile_topg(fn, x)
    assert any("3 projections fused" in s.detail for s in sites), sites
    for e, o in zip(expected, actual, strict=True):
        assert_close(o, e)


# --- MoE routing ----------------------------------------------------------------------
@given(
    t=st.integers(1, 9),
    e=st.sampled_from([4, 8]),
    k=st.sampled_from([1, 2]),
    renorm=st.booleans(),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
)
def test_moe_router(t, e, k, renorm, scoring):
    logits = _rand(t, e, scale=3)

    def fn(logits):
        p = F.softmax(logits.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
        w, ids = torch.topk(p, k, dim=-1)
        if renorm:
            w /= w.sum(dim=-1, keepdim=True)
        return w, ids

    expected, actual, sites = compile_topg(fn, logits)
    all_replaced(sites, "moe_router")
    assert torch.equal(actual[1], expected[1]) and actual[1].dtype == expected[1].dtype
    assert_close(actual[0], expected[0])


# --- pass manager ---------------------------------------------------------------------
def test_disable_passes():
    x, w = _rand(5, 32), _rand(32)
    _, _, sites = compile_topg(
        lambda x, w: _llama_rms(x, w), x, w, options={"disable": ["rms_norm"]}
    )
    assert replaced(sites, "rms_norm") == (0, 0)


def test_unknown_options_are_errors():
    for bad, msg in (
        ({"nope": 1}, "unknown option"),
        ({"disable": ["nope"]}, "unknown passes"),
        ({"strict": "yes"}, "expected a bool"),
    ):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=msg):
            torch.compile(lambda x: x + 1, backend="topg", options=bad)(torch.ones(2))
    torch._dynamo.reset()


class _Broken:
    """A pass that damages the graph, then fails."""

    name = "broken"
    pattern = "broken"

    def run(self, ctx):
        g = ctx.gm.graph
        for n in list(g.nodes):
            if n.op == "call_function":
                with g.inserting_before(n):
                    g.call_function(torch.neg, (n.args[0],))
                n.args = (n.args[0], n.args[0])
                break
        raise ValueError("planted failure")


def test_failing_pass_leaves_graph_unchanged(monkeypatch):
    import torch_topg.compile.backend as backend

    monkeypatch.setattr(backend, "PASSES", [_Broken, *backend.PASSES])
    backend._warned.clear()
    x, w = _rand(5, 32), _rand(32)
    fn = lambda x, w: _llama_rms(x, w) + x  # noqa: E731
    torch._dynamo.reset()
    backend.clear_reports()
    with torch.inference_mode(), pytest.warns(RuntimeWarning, match="planted failure"):
        out = torch.compile(fn, backend="topg")(x, w)
    assert_close(out, fn(x, w))
    assert backend.REPORTS[-1].errors[0][0] == "broken"
    assert replaced(backend.REPORTS[-1].sites, "rms_norm") == (1, 1)  # later passes ran
    torch._dynamo.reset()
    with torch.inference_mode(), pytest.raises(Exception, match="planted failure"):
        torch.compile(fn, backend="topg", options={"strict": True})(x, w)
    torch._dynamo.reset()


def test_grad_mode_runs_unfused():
    lin = torch.nn.Linear(8, 8)
    x = _rand(2, 8)
    torch._dynamo.reset()
    import torch_topg.compile.backend as backend

    backend.clear_reports()
    out = torch.compile(lin, backend="topg")(x)
    out.sum().backward()  # autograd works: the graph was left as traced
    assert lin.weight.grad is not None
    assert backend.REPORTS[-1].skipped == "grad mode"
    torch._dynamo.reset()


def test_pass_names_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "compile.md").read_text()
    for name in PASS_NAMES:
        assert f"`{name}`" in doc, name
