"""How to call every ``topg`` op, for any device: one place the common tests read.

Per op in the registry (``torch_topg.ops.OPS``):

* ``sample_inputs(op, device)``: valid calls (:class:`Sample`) in every float dtype, with
  awkward sizes (odd token counts, hidden sizes that are not multiples of 8, tails) and
  non-contiguous views where the op takes them;
* ``op_bad_inputs.bad_inputs(op, device)``: calls that one argument check must refuse
  (:class:`BadInput`: the expected message after ``topg::<op>: ``, as a regex);
* ``op_bad_inputs.special_inputs(op, device)``: NaN / inf / empty inputs
  (:class:`Special`); every op propagates them as its reference does (docs/ops.md,
  "NaN, inf and empty inputs").

Tensors are drawn on the CPU from a seeded generator, then moved: a device sees the same
numbers as the CPU. Sizes stay small (the common tests run on 2 cores in CI).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
F32 = torch.float32
NAN, INF = float("nan"), float("inf")


@dataclass
class Sample:
    """A valid call: ``op(*args, **kwargs)``; outputs compared with the tolerance of
    ``dtype`` widened by ``scale``."""

    desc: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = F32
    scale: float = 1.0


@dataclass
class BadInput:
    """A call one check refuses with a message matching ``topg::<op>: <match>``.

    ``value_check``: the check reads tensor contents (the fake kernel cannot see them).
    ``crashes_native``: why the case runs the native kernel in a subprocess (a kernel
    that lacks the check reads out of bounds or divides by zero).
    """

    desc: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    match: str = ""
    value_check: bool = False
    crashes_native: str = ""


@dataclass
class Special:
    """A NaN / inf / empty call; the kernel must give what the reference gives (NaN where
    the reference has NaN). ``finite``: the output must also be finite (NaN only in
    memory the op must not read)."""

    desc: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    dtype: torch.dtype = F32
    finite: bool = False


class Gen:
    """Seeded tensors made on the CPU and moved to ``device``."""

    def __init__(self, device: str, seed: int = 0) -> None:
        self.device, self.g = device, torch.Generator().manual_seed(seed)

    def randn(self, *shape: int, dtype: torch.dtype = F32, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=self.g) * scale).to(dtype).to(self.device)

    def rand(self, *shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
        return torch.rand(shape, generator=self.g).to(dtype).to(self.device)

    def ints(self, values: Any, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def randint(self, high: int, *shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g).to(dtype).to(self.device)


def other_device(device: str) -> str:
    """A device other than ``device`` whose tensors the checks must refuse (``meta``
    beside the CPU; the CPU beside an accelerator)."""
    return "meta" if device == "cpu" else "cpu"


def group_name() -> str:
    """The default process group's name (the collective samples run in a 1-rank group)."""
    return dist.group.WORLD.group_name if dist.is_initialized() else "0"


def cos_sin(g: Gen, max_pos: int, rot_dim: int, dtype: torch.dtype = F32) -> torch.Tensor:
    """A rotary cache ``[max_pos, rot_dim]``: cos then sin."""
    inv = 1.0 / 10000.0 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    f = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([f.cos(), f.sin()], dim=-1).to(dtype).to(g.device)


def paged(g: Gen, lens: list[int], hq: int, hkv: int, d: int, block_size: int, dtype=F32):
    """``(query, key_cache, value_cache, block_tables, seq_lens)`` for sequences of
    ``lens`` tokens, blocks shuffled, one spare column in the table."""
    max_blocks = max(1, max(-(-n // block_size) for n in lens)) + 1
    num_blocks = len(lens) * max_blocks + 2
    kc, vc = (g.randn(num_blocks, block_size, hkv, d, dtype=dtype) for _ in range(2))
    perm = torch.randperm(num_blocks, generator=g.g)[: len(lens) * max_blocks]
    bt = perm.view(len(lens), max_blocks).int().to(g.device)
    return g.randn(len(lens), hq, d, dtype=dtype), kc, vc, bt, g.ints(lens)


def int8_caches(g: Gen, shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``(key_cache, value_cache, key_scale, value_scale)``: int8 caches of ``shape``
    ``[num_blocks, block_size, Hkv, D]`` and their float32 scales ``[num_blocks,
    block_size, Hkv]``."""
    kq, vq = (g.randint(255, *shape).sub(127).to(torch.int8) for _ in range(2))
    ks, vs = (g.rand(*shape[:3]).div(64) for _ in range(2))
    return kq, vq, ks, vs


def cu(g: Gen, lens: list[int]) -> torch.Tensor:
    return g.ints([0, *itertools.accumulate(lens)])


# --- samples -----------------------------------------------------------------------------
def _norm(g: Gen) -> list[Sample]:
    out = []
    for dt in DTYPES:
        x = g.randn(5, 3, 123, dtype=dt, scale=3)
        out.append(Sample(f"{dt}", (x, g.randn(123, dtype=dt), 1e-5), dtype=dt))
        out.append(Sample(f"{dt} fp32 weight", (x, g.randn(123), 1e-6), dtype=dt))
        strided = g.randn(9, 5, 40, dtype=dt).transpose(0, 1)  # rows not contiguous
        out.append(Sample(f"{dt} strided", (strided, g.randn(40, dtype=dt), 1e-6), dtype=dt))
    return out


def _add_norm(g: Gen) -> list[Sample]:
    return [
        Sample(f"{dt}", (g.randn(4, 3, 17, dtype=dt), g.randn(4, 3, 17, dtype=dt), w, 1e-6), dtype=dt)
        for dt in DTYPES
        for w in (g.randn(17, dtype=dt), g.randn(17))
    ]  # fmt: skip


def _rotary(g: Gen) -> list[Sample]:
    out = []
    for dt in DTYPES:
        cache = cos_sin(g, 37, 20, dt)
        pos = g.randint(37, 5)
        q, k = g.randn(5, 3 * 20, dtype=dt), g.randn(5, 20, dtype=dt)
        out.append(Sample(f"{dt} neox", (pos, q, k, 20, cache, True), dtype=dt))
        q3 = g.randn(5, 2, 16, dtype=dt)  # [T, H, D], partial rotary, gpt-j, no key
        out.append(
            Sample(
                f"{dt} gptj partial", (pos.int(), q3, None, 16, cos_sin(g, 37, 6), False), dtype=dt
            )
        )
        qkv = g.randn(2, 3, (4 + 2 * 2) * 16, dtype=dt)  # slices of a fused qkv: strided rows
        pos2 = g.randint(37, 2, 3)
        qs, ks = qkv[..., : 4 * 16], qkv[..., 4 * 16 : 6 * 16]
        out.append(
            Sample(f"{dt} qkv slice", (pos2, qs, ks, 16, cos_sin(g, 37, 16), True), dtype=dt)
        )
    return out  # fmt: skip


def _gated(approx: tuple[str, ...]) -> Callable[[Gen], list[Sample]]:
    def samples(g: Gen) -> list[Sample]:
        out = []
        for dt, a in itertools.product(DTYPES, approx):
            extra = (a,) if a else ()
            out.append(
                Sample(f"{dt} {a}", (g.randn(3, 2, 2 * 13, dtype=dt, scale=4), *extra), dtype=dt)
            )
            rows = g.randn(7, 3 * 24, dtype=dt)[:, 8 : 8 + 2 * 20]  # row stride 72
            out.append(Sample(f"{dt} {a} row slice", (rows, *extra), dtype=dt))
        return out  # fmt: skip

    return samples


def _attention(g: Gen) -> list[Sample]:
    out = []
    for dt in DTYPES:
        q, k, v = (
            g.randn(2, 9, 4, 20, dtype=dt),
            g.randn(2, 12, 2, 20, dtype=dt),
            g.randn(2, 12, 2, 20, dtype=dt),
        )
        out.append(Sample(f"{dt} causal", (q, k, v), {"causal": True}, dtype=dt))
        tq = g.randn(2, 4, 7, 16, dtype=dt).transpose(1, 2)  # [B, H, S, D] storage
        tk, tv = (g.randn(2, 2, 7, 16, dtype=dt).transpose(1, 2) for _ in range(2))
        kw = {"window_left": 3, "softcap": 5.0, "scale": 0.3}
        out.append(Sample(f"{dt} transposed window softcap", (tq, tk, tv), kw, dtype=dt))
        sinks = g.randn(4)
        out.append(Sample(f"{dt} sinks", (q, k, v), {"causal": True, "sinks": sinks}, dtype=dt))
        mask = torch.rand(2, 1, 9, 12, generator=g.g).to(g.device) > 0.3
        out.append(Sample(f"{dt} bool mask", (q, k, v), {"mask": mask}, dtype=dt))
        lens = [5, 0, 6]
        rq, rk, rv = (
            g.randn(11, 4, 16, dtype=dt),
            g.randn(11, 2, 16, dtype=dt),
            g.randn(11, 2, 16, dtype=dt),
        )
        out.append(
            Sample(
                f"{dt} ragged",
                (rq, rk, rv),
                {"cu_seqlens_q": cu(g, lens), "causal": True},
                dtype=dt,
            )
        )
    return out  # fmt: skip


def _paged_attention(g: Gen) -> list[Sample]:
    out = []
    for dt in DTYPES:
        q, kc, vc, bt, sl = paged(g, [5, 17, 0], 4, 2, 20, 4, dt)
        out.append(Sample(f"{dt} decode", (q, kc, vc, bt, sl), dtype=dt))
        kw = {"window_left": 6, "softcap": 10.0, "scale": 0.2}
        out.append(Sample(f"{dt} window softcap", (q, kc, vc, bt, sl), kw, dtype=dt))
        sk = {"sinks": g.randn(4), "window_left": 6}
        out.append(Sample(f"{dt} sinks", (q, kc, vc, bt, sl), sk, dtype=dt))
        rq = g.randn(2 + 17 + 0, 4, 20, dtype=dt)  # ragged: 2 and 17 new tokens
        out.append(
            Sample(
                f"{dt} ragged", (rq, kc, vc, bt, sl), {"cu_seqlens_q": cu(g, [2, 17, 0])}, dtype=dt
            )
        )
        kq, vq, ks, vs = int8_caches(g, kc.shape)  # the int8 cache with its scales
        s8 = {"key_scale": ks, "value_scale": vs}
        out.append(Sample(f"{dt} int8 cache", (q, kq, vq, bt, sl), {**kw, **s8}, dtype=dt))
        out.append(
            Sample(
                f"{dt} int8 ragged",
                (rq, kq, vq, bt, sl),
                {"cu_seqlens_q": cu(g, [2, 17, 0]), **s8},
                dtype=dt,
            )
        )
    return out  # fmt: skip


def _reshape_and_cache(g: Gen) -> list[Sample]:
    out = []
    for dt, idx in zip(DTYPES, (torch.int64, torch.int32, torch.int64), strict=True):
        key = g.randn(2, 5, 20, dtype=dt).transpose(0, 1)  # [T, Hkv, D] with strided tokens
        value = g.randn(5, 2, 20, dtype=dt)
        kc, vc = g.randn(3, 4, 2, 20, dtype=dt), g.randn(3, 4, 2, 20, dtype=dt)
        slots = g.ints([0, 5, -1, 11, 2], idx)
        out.append(Sample(f"{dt} {idx}", (key, value, kc, vc, slots), dtype=dt))
        kq, vq, ks, vs = int8_caches(g, kc.shape)
        kw = {"key_scale": ks, "value_scale": vs}
        out.append(Sample(f"{dt} {idx} int8 cache", (key, value, kq, vq, slots), kw, dtype=dt))
    return out


def _moe_topk(g: Gen) -> list[Sample]:
    out = []
    base = torch.linspace(-4, 4, 9)  # distinct values: no ties
    for dt in DTYPES:
        logits = base[torch.rand(7, 9, generator=g.g).argsort(-1)].to(dt).to(g.device)
        bias = torch.linspace(0.3, -0.3, 9).to(g.device)
        out.append(Sample(f"{dt} softmax", (logits, 3), {"renormalize": True}, dtype=dt))
        kw = {"scoring": "sigmoid", "correction_bias": bias}
        out.append(Sample(f"{dt} sigmoid bias", (logits, 2), kw, dtype=dt))
    return out


def _fused_moe(g: Gen) -> list[Sample]:
    out = []
    for dt, act in zip(DTYPES, ("silu", "gelu", "gelu_tanh"), strict=True):
        t, e, k, h, i = 5, 3, 2, 24, 20
        x = g.randn(t, h, dtype=dt)
        wgu, wd = (
            g.randn(e, 2 * i, h, dtype=dt, scale=h**-0.5),
            g.randn(e, h, i, dtype=dt, scale=i**-0.5),
        )
        ids = g.randint(e, t, k)
        out.append(
            Sample(
                f"{dt} {act}",
                (x, wgu, wd, g.rand(t, k), ids),
                {"activation": act},
                dtype=dt,
                scale=2,
            )
        )
        out.append(
            Sample(
                f"{dt} int32 ids",
                (x, wgu, wd, g.rand(t, k, dtype=dt), ids.int()),
                dtype=dt,
                scale=2,
            )
        )
    return out  # fmt: skip


def _linear(g: Gen) -> list[Sample]:
    out = []
    for dt in DTYPES:
        w = g.randn(33, 40, dtype=dt, scale=40**-0.5)
        out.append(
            Sample(
                f"{dt} bias",
                (g.randn(5, 3, 40, dtype=dt), w, g.randn(33, dtype=dt)),
                dtype=dt,
                scale=2,
            )
        )
        out.append(Sample(f"{dt} gemv", (g.randn(1, 40, dtype=dt), w), dtype=dt, scale=2))
        out.append(Sample(f"{dt} strided", (g.randn(40, 7, dtype=dt).t(), w), dtype=dt, scale=2))
    return out  # fmt: skip


def packed_weight(g: Gen, fmt: str, n: int, k: int) -> torch.Tensor:
    """A weight ``[n, k]`` packed in ``fmt`` (``torch_topg.quant``): quantised from a
    seeded float weight, or for the K-quants (read from files only) seeded bytes whose
    half scales are set to 2^-10 (q6_k) / 2^-7 and 2^-9 (q4_k, q5_k: d, dmin)."""
    from torch_topg.quant import FORMATS, quantize_weight

    f = FORMATS[fmt]
    if fmt not in ("q4_k", "q5_k", "q6_k"):
        return quantize_weight(g.randn(n, k, scale=max(k, 1) ** -0.5), fmt).to(g.device)
    raw = torch.randint(0, 256, (n * (k // f.block), f.block_bytes), generator=g.g)
    raw = raw.to(torch.uint8)
    half = lambda v: torch.tensor([v], dtype=torch.float16).view(torch.uint8)  # noqa: E731
    if fmt == "q6_k":
        raw[:, 208:210] = half(2.0**-10)
    else:
        raw[:, 0:2], raw[:, 2:4] = half(2.0**-7), half(2.0**-9)
    return raw.reshape(n, f.row_bytes(k)).to(g.device)


def _linear_q(g: Gen) -> list[Sample]:
    out = []
    cases = [
        ("q8_0", 64),
        ("q4_0", 96),
        ("q4_1", 64),
        ("q5_0", 96),
        ("q5_1", 64),
        ("q4_k", 256),
        ("q5_k", 512),
        ("q6_k", 256),
        ("int8", 45),
        ("int4_g32", 40),
        ("int4_g64", 70),
        ("int4_g128", 130),
    ]
    for dt in DTYPES:
        for fmt, k in cases:
            w = packed_weight(g, fmt, 11, k)
            x = g.randn(1, k, dtype=dt)
            out.append(Sample(f"{dt} {fmt} gemv", (x, w, fmt), dtype=dt, scale=2))
            act = {"int8_activations": True}
            out.append(Sample(f"{dt} {fmt} gemv int8 act", (x, w, fmt), act, dtype=dt, scale=2))
        w = packed_weight(g, "int4_g64", 9, 70)
        x, b = g.randn(2, 5, 70, dtype=dt), g.randn(9, dtype=dt)
        out.append(Sample(f"{dt} int4_g64 bias", (x, w, "int4_g64", b), dtype=dt, scale=2))
        xs = g.randn(64, 7, dtype=dt).t()  # rows with stride 1, columns with stride 7
        w = packed_weight(g, "q8_0", 9, 64)
        out.append(Sample(f"{dt} q8_0 strided", (xs, w, "q8_0"), dtype=dt, scale=2))
        kw = {"int8_activations": True}
        out.append(Sample(f"{dt} q8_0 gemm int8 act", (xs, w, "q8_0"), kw, dtype=dt, scale=2))
    return out  # fmt: skip


def _fused_moe_q(g: Gen) -> list[Sample]:
    out = []
    e, t, k, h, i = 3, 5, 2, 64, 40
    experts = lambda fmt, n, kk: torch.stack([packed_weight(g, fmt, n, kk) for _ in range(e)])  # noqa: E731
    for dt, (fmt, down, act) in zip(
        DTYPES,
        [("q4_1", "int4_g32", "silu"), ("q8_0", "int8", "gelu"), ("int4_g64", None, "gelu_tanh")],
        strict=True,
    ):
        wgu, wd = experts(fmt, 2 * i, h), experts(down or fmt, h, i)
        x, ids, tw = g.randn(t, h, dtype=dt), g.randint(e, t, k), g.rand(t, k)
        kw = {"down_format": down, "activation": act}
        out.append(Sample(f"{dt} {fmt} {act}", (x, wgu, wd, tw, ids, fmt), kw, dtype=dt, scale=2))
        kw8 = {**kw, "int8_activations": True}
        out.append(
            Sample(f"{dt} {fmt} int8 act", (x, wgu, wd, tw, ids.int(), fmt), kw8, dtype=dt, scale=2)
        )
    return out  # fmt: skip


def _embedding_q(g: Gen) -> list[Sample]:
    out = []
    for dt, (fmt, d) in zip(DTYPES, [("q8_0", 64), ("q6_k", 256), ("int4_g64", 70)], strict=True):
        w = packed_weight(g, fmt, 13, d)
        ids = g.randint(13, 3, 5)
        out.append(Sample(f"{dt} {fmt}", (ids, w, fmt, d, dt), dtype=dt))
        out.append(Sample(f"{dt} {fmt} int32 ids", (ids[0].int(), w, fmt, d, dt), dtype=dt))
    for fmt, d in [("q4_0", 32), ("q4_1", 64), ("q5_0", 64), ("q5_1", 32), ("q4_k", 256),
                   ("int8", 45), ("int4_g32", 40)]:  # fmt: skip
        w = packed_weight(g, fmt, 7, d)
        out.append(Sample(f"float32 {fmt}", (g.randint(7, 4), w, fmt, d, F32)))
    return out


def _all_reduce(g: Gen) -> list[Sample]:
    return [Sample(f"{dt}", (g.randn(3, 17, dtype=dt), group_name()), dtype=dt) for dt in DTYPES]


def _fused_all_reduce(g: Gen) -> list[Sample]:
    return [
        Sample(f"{dt}", (g.randn(4, 17, dtype=dt), g.randn(4, 17, dtype=dt), g.randn(17, dtype=dt), 1e-6, group_name()), dtype=dt)
        for dt in DTYPES
    ]  # fmt: skip


SAMPLES: dict[str, Callable[[Gen], list[Sample]]] = {
    "rms_norm": _norm,
    "fused_add_rms_norm": _add_norm,
    "rotary_embedding": _rotary,
    "silu_and_mul": _gated(("",)),
    "gelu_and_mul": _gated(("none", "tanh")),
    "attention": _attention,
    "paged_attention": _paged_attention,
    "reshape_and_cache": _reshape_and_cache,
    "moe_topk": _moe_topk,
    "fused_moe": _fused_moe,
    "linear": _linear,
    "linear_q": _linear_q,
    "fused_moe_q": _fused_moe_q,
    "embedding_q": _embedding_q,
    "all_reduce": _all_reduce,
    "fused_all_reduce_add_rms_norm": _fused_all_reduce,
}


def sample_inputs(op: str, device: str) -> list[Sample]:
    return SAMPLES[op](Gen(device))
