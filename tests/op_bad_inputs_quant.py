"""Bad inputs and NaN / inf / empty inputs of ``linear_q``, ``embedding_q`` and
``fused_moe_q`` (the quantised-weight ops), in the conventions of tests/op_bad_inputs.py, which lists them
(its helpers are imported inside the functions: that module imports this one)."""

from __future__ import annotations

import re

import torch
from op_samples import F32, INF, NAN, BadInput, Gen, Special, packed_weight

from torch_topg.quant import FORMATS


def bad_linear_q(g: Gen, other: str) -> list[BadInput]:
    from op_bad_inputs import CONTIG, CRASH_DEVICE, FLOAT, _arg

    x, b = g.randn(3, 64), g.randn(8)
    w = packed_weight(g, "q8_0", 8, 64)  # [8, 68]
    dev = x.device
    known = ", ".join(f"'{f}'" for f in FORMATS)
    return [
        BadInput("int input", (x.int(), w, "q8_0"), match=_arg("input", FLOAT)),
        BadInput("unknown format", (x, w, "q2_k"), match=re.escape(f"format 'q2_k' is not one of {known}")),
        BadInput("K not a multiple of the block", (g.randn(3, 40), packed_weight(g, "int4_g32", 8, 40), "q4_1"), match=_arg("input", "a last dimension that is a multiple of 32 (the block of q4_1)")),
        BadInput("weight dtype", (x, w.view(torch.int8), "q8_0"), match=_arg("weight", "dtype uint8")),
        BadInput("weight device", (x, w.to(other), "q8_0"), match=_arg("weight", f"device {dev} (the device of 'input')"), crashes_native=CRASH_DEVICE),
        BadInput("1-d weight", (x, w[0], "q8_0"), match=_arg("weight", "2 dimensions")),
        BadInput("row bytes of another format", (x, w, "q4_0"), match=_arg("weight", "size 36 at dim 1 (the bytes of a q4_0 row of 64 weights)")),
        BadInput("row bytes short", (x, w[:, :34], "q8_0"), match=_arg("weight", "size 68 at dim 1 (the bytes of a q8_0 row of 64 weights)")),
        BadInput("int8 row bytes", (g.randn(3, 45), w, "int8"), match=_arg("weight", "size 49 at dim 1 (the bytes of a int8 row of 45 weights)")),
        BadInput("strided weight", (x, packed_weight(g, "q8_0", 8, 128)[:, ::2], "q8_0"), match=_arg("weight", CONTIG)),
        BadInput("bias size", (x, w, "q8_0", g.randn(9)), match=_arg("bias", "size 8 at dim 0 (the output features of 'weight')")),
        BadInput("bias dtype", (x, w, "q8_0", b.half()), match=_arg("bias", "dtype float32 (the dtype of 'input')")),
        BadInput("bias device", (x, w, "q8_0", b.to(other)), match=_arg("bias", f"device {dev} (the device of 'input')"), crashes_native=CRASH_DEVICE),
    ]  # fmt: skip


ID_PAST_ROWS = re.escape("argument 'input' holds an id outside [0, 8) (the rows of 'weight')")


def bad_embedding_q(g: Gen, other: str) -> list[BadInput]:
    from op_bad_inputs import CONTIG, CRASH_DEVICE, INDEX, _arg

    w, ids = packed_weight(g, "q8_0", 8, 64), g.ints([0, 7, 3], torch.int64)
    known = ", ".join(f"'{f}'" for f in FORMATS)
    return [
        BadInput("float ids", (ids.float(), w, "q8_0", 64, F32), match=_arg("input", INDEX)),
        BadInput("unknown format", (ids, w, "q2_k", 64, F32), match=re.escape(f"format 'q2_k' is not one of {known}")),
        BadInput("int dtype", (ids, w, "q8_0", 64, torch.int32), match=re.escape("dtype int32 is not one of float32, bfloat16, float16")),
        BadInput("negative dim", (ids, w, "int8", -1, F32), match=re.escape("embedding_dim -1 is negative")),
        BadInput("dim not a multiple of the block", (ids, w, "q8_0", 60, F32), match=re.escape("embedding_dim 60 is not a multiple of 32 (the block of q8_0)")),
        BadInput("weight dtype", (ids, w.view(torch.int8), "q8_0", 64, F32), match=_arg("weight", "dtype uint8")),
        BadInput("weight device", (ids, w.to(other), "q8_0", 64, F32), match=_arg("weight", f"device {ids.device} (the device of 'input')"), crashes_native=CRASH_DEVICE),
        BadInput("row bytes", (ids, w, "q8_0", 96, F32), match=_arg("weight", "size 102 at dim 1 (the bytes of a q8_0 row of 96 weights)")),
        BadInput("strided weight", (ids, packed_weight(g, "q8_0", 8, 128)[:, ::2], "q8_0", 64, F32), match=_arg("weight", CONTIG)),
        BadInput("id past the rows", (g.ints([0, 8]), w, "q8_0", 64, F32), match=ID_PAST_ROWS, value_check=True),
        BadInput("negative id", (g.ints([-1, 2]), w, "q8_0", 64, F32), match=ID_PAST_ROWS, value_check=True),
    ]  # fmt: skip


def _experts(g: Gen, fmt: str, e: int, n: int, k: int) -> torch.Tensor:
    return torch.stack([packed_weight(g, fmt, n, k) for _ in range(e)])


def bad_fused_moe_q(g: Gen, other: str) -> list[BadInput]:
    from op_bad_inputs import CONTIG, CRASH_DEVICE, FLOAT, INDEX, _arg

    x, wgu, wd = g.randn(4, 64), _experts(g, "q8_0", 3, 64, 64), _experts(g, "q8_0", 3, 64, 32)
    tw, ids = g.rand(4, 2), g.ints([[0, 2], [1, 1], [2, 0], [0, 1]], torch.int64)
    dev, hs, known = x.device, "hidden_states", ", ".join(f"'{f}'" for f in FORMATS)
    a = (wgu, wd, tw, ids)
    return [
        BadInput("int hidden", (x.int(), *a, "q8_0"), match=_arg(hs, FLOAT)),
        BadInput("unknown format", (x, *a, "q2_k"), match=re.escape(f"format 'q2_k' is not one of {known}")),
        BadInput("unknown down format", (x, *a, "q8_0"), {"down_format": "f16"}, match=re.escape(f"format 'f16' is not one of {known}")),
        BadInput("hidden not a multiple of the block", (g.randn(4, 40), *a, "q8_0"), match=re.escape("the hidden size 40 is not a multiple of 32 (the block of q8_0)")),
        BadInput("float w_gate_up", (x, g.randn(3, 64, 64), wd, tw, ids, "q8_0"), match=_arg("w_gate_up", "dtype uint8")),
        BadInput("2-d w_gate_up", (x, wgu[0], wd, tw, ids, "q8_0"), match=_arg("w_gate_up", "3 dimensions")),
        BadInput("odd w_gate_up", (x, wgu[:, :63], wd, tw, ids, "q8_0"), match=_arg("w_gate_up", "an even size at dim 1 ([gate; up] rows)")),
        BadInput("w_gate_up row bytes", (x, *a, "q4_0"), match=_arg("w_gate_up", "size 36 at dim 2 (the bytes of a q4_0 row of 64 weights)")),
        BadInput("w_gate_up device", (x, wgu.to(other), wd, tw, ids, "q8_0"), match=_arg("w_gate_up", f"device {dev} (the device of 'hidden_states')"), crashes_native=CRASH_DEVICE),
        BadInput("strided w_gate_up", (x, _experts(g, "q8_0", 3, 64, 128)[:, :, ::2], wd, tw, ids, "q8_0"), match=_arg("w_gate_up", CONTIG)),
        BadInput("inter not a multiple of the block", (x, wgu, wd, tw, ids, "q8_0"), {"down_format": "q4_k"}, match=re.escape("the intermediate size 32 is not a multiple of 256 (the block of q4_k)")),
        BadInput("w_down row bytes of another format", (x, *a, "q8_0"), {"down_format": "int8"}, match=_arg("w_down", "size 36 at dim 2 (the bytes of a int8 row of 32 weights)")),
        BadInput("w_down experts", (x, wgu, wd[:2], tw, ids, "q8_0"), match=_arg("w_down", "size 3 at dim 0 (the experts of 'w_gate_up')")),
        BadInput("w_down hidden", (x, wgu, wd[:, :60].contiguous(), tw, ids, "q8_0"), match=_arg("w_down", "size 64 at dim 1 (the hidden size of 'hidden_states')")),
        BadInput("topk_weights tokens", (x, wgu, wd, tw[:3], ids, "q8_0"), match=_arg("topk_weights", "size 4 at dim 0 (the tokens of 'hidden_states')")),
        BadInput("topk_weights dtype", (x, wgu, wd, tw.bfloat16(), ids, "q8_0"), match=_arg("topk_weights", "dtype float32 (the dtype of 'hidden_states')")),
        BadInput("float topk_ids", (x, wgu, wd, tw, ids.float(), "q8_0"), match=_arg("topk_ids", INDEX)),
        BadInput("topk_ids k", (x, wgu, wd, tw, g.ints([[0, 1, 2]] * 4, torch.int64), "q8_0"), match=_arg("topk_ids", "size 2 at dim 1 (the top-k of 'topk_weights')")),
        BadInput("activation", (x, *a, "q8_0"), {"activation": "relu"}, match=re.escape("activation 'relu' is not one of 'silu', 'gelu', 'gelu_tanh'")),
        BadInput("expert id", (x, wgu, wd, tw, g.ints([[0, 3], [1, 1], [2, 0], [0, 1]], torch.int64), "q8_0"), match=r"argument 'topk_ids' holds .*expert id.*" + re.escape("[0, 3) (the experts of 'w_gate_up')"), value_check=True),
    ]  # fmt: skip


def special_fused_moe_q(g: Gen) -> list[Special]:
    from op_bad_inputs import _put

    x = g.randn(5, 64)
    wgu, wd = _experts(g, "q4_1", 3, 64, 64), _experts(g, "int4_g32", 3, 64, 32)
    tw, ids = g.rand(5, 2), g.ints([[0, 2], [1, 1], [2, 0], [0, 1], [2, 1]], torch.int64)
    a = (wgu, wd, tw, ids, "q4_1")
    kw = {"down_format": "int4_g32"}
    return [
        Special("nan token: its row only", (_put(x, (2, 7), NAN), *a), kw),
        Special("inf token", (_put(x, (4, 0), INF), *a), kw),
        Special("no tokens", (x[:0], wgu, wd, tw[:0], ids[:0], "q4_1"), kw),
    ]


def special_linear_q(g: Gen) -> list[Special]:
    from op_bad_inputs import _put

    # 6 rows: the CPU kernel's exact fp32 path (its int8-activation GEMV at M <= 4 has
    # its own NaN test in tests/test_quant_linear.py)
    x, b = g.randn(6, 64), g.randn(9)
    w = packed_weight(g, "q8_0", 9, 64)
    inf_scale = w.clone()
    inf_scale[2, 34:36] = torch.tensor([INF], dtype=torch.float16).view(torch.uint8)
    return [
        Special("nan input row", (_put(x, (1, 3), NAN), w, "q8_0", b)),
        Special("inf scale: its output column", (x, inf_scale, "q8_0")),
        Special(
            "nan input int4",
            (_put(g.randn(6, 70), (2, 69), NAN), packed_weight(g, "int4_g64", 5, 70), "int4_g64"),
        ),
        Special("no rows", (x[:0], w, "q8_0", b)),
        Special("K = 0: the bias", (g.randn(3, 0), packed_weight(g, "int8", 9, 0), "int8", b)),
    ]


def special_embedding_q(g: Gen) -> list[Special]:
    w = packed_weight(g, "q8_0", 6, 64)
    nan_scale = w.clone()
    nan_scale[4, 0:2] = torch.tensor([NAN], dtype=torch.float16).view(torch.uint8)
    return [
        Special("nan scale: its row's first block", (g.ints([4, 1]), nan_scale, "q8_0", 64, F32)),
        Special("no ids", (g.ints([], torch.int64), w, "q8_0", 64, F32)),
        Special("D = 0", (g.ints([1, 2]), packed_weight(g, "int8", 6, 0), "int8", 0, F32)),
    ]
