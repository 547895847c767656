"""Bad inputs and NaN / inf / empty inputs of ``linear_q`` and ``embedding_q`` (the
quantised-weight ops), in the conventions of tests/op_bad_inputs.py, which lists them
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
        BadInput("unknown format", (x, w, "q5_0"), match=re.escape(f"format 'q5_0' is not one of {known}")),
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
