"""Compile the Triton kernels for a CUDA GPU on a machine that has none.

``triton.compile`` lowers a kernel to PTX and runs the ``ptxas`` that ships with triton,
so the compiled path (which the interpreter tests do not exercise: constexpr
specialisation, layouts, the pipeliner, the types of scalars) is checked without a GPU.
Must run in a process where ``TRITON_INTERPRET`` is unset when ``triton.jit`` runs (the
interpreter tests set it), hence a script:

    python tests/triton_aot.py fused_moe [--arch 90]

Exit status 0: every case compiled (one line each: kernel, case, shared memory); 77: this
triton cannot compile for CUDA here (the reason on stderr); anything else: a failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

#: exit status for "cannot check here" (the test turns it into a skip)
SKIP = 77


class Case(NamedTuple):
    """One compilation: the kernel's non-constexpr argument types, its constexprs, the
    launch options, and whether pointers and sizes are 16-divisible (``aligned``, as the
    JIT specialises for 16-aligned tensors and sizes such as 4096 or 14336)."""

    fn: Callable
    name: str
    signature: dict
    constexprs: dict
    options: dict
    aligned: bool = True


def _fused_moe_cases(kernels: object) -> list[Case]:
    """``triton_kernels.fused_moe``: every dtype, a decode and a prefill block shape, the
    three activations, and one unaligned shape (H or I not a multiple of 16)."""
    cases = []
    for dtype, precision in (("fp16", None), ("bf16", None), ("fp32", "ieee")):
        p = "*" + dtype
        gate_up_sig = {
            "x_ptr": p, "w_ptr": p, "h_ptr": p, "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
            "n_assign": "i32", "hidden": "i32", "inter": "i32", "stride_xt": "i32",
            "stride_we": "i64", "up_offset": "i64",
        }  # fmt: skip
        down_sig = {
            "h_ptr": p, "w_ptr": p, "weights_ptr": "*fp32", "y_ptr": "*fp32", "sorted_ptr": "*i32",
            "block_expert_ptr": "*i32", "n_assign": "i32", "hidden": "i32", "inter": "i32",
            "stride_we": "i64",
        }  # fmt: skip
        for block_m, warps in ((16, 4), (64, 8)):
            blocks = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 64}
            options = {"num_warps": warps, "num_stages": 3}
            name = f"{dtype} BLOCK_M={block_m}"
            # stride_xh = 1: contiguous rows of hidden_states, as the JIT specialises
            consts = {"stride_xh": 1, "TOP_K": 2, "ACT": 0, "PRECISION": precision, **blocks}
            cases.append(Case(kernels._gate_up_kernel, name, gate_up_sig, consts, options))
            consts = {"PRECISION": precision, **blocks}
            cases.append(Case(kernels._down_kernel, name, down_sig, consts, options))
        sum_sig = {"y_ptr": "*fp32", "ids_ptr": "*i64", "out_ptr": p, "num_experts": "i32", "hidden": "i32"}  # fmt: skip
        sum_consts = {"TOP_K": 8, "BLOCK_H": 128}
        cases.append(Case(kernels._sum_slots_kernel, dtype, sum_sig, sum_consts, {"num_warps": 4}))
        if dtype == "fp16":
            blocks = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}
            for act in (1, 2):
                consts = {"stride_xh": 1, "TOP_K": 1, "ACT": act, "PRECISION": None, **blocks}
                name = f"fp16 ACT={act}"
                cases.append(Case(kernels._gate_up_kernel, name, gate_up_sig, consts, {}))
            consts = {"TOP_K": 2, "ACT": 0, "PRECISION": None, **blocks}
            unaligned = gate_up_sig | {"stride_xh": "i32"}
            cases.append(
                Case(kernels._gate_up_kernel, "fp16 unaligned", unaligned, consts, {}, False)
            )
            consts = {"PRECISION": None, **blocks}
            cases.append(Case(kernels._down_kernel, "fp16 unaligned", down_sig, consts, {}, False))
    return cases


def _cases(op: str) -> list[Case]:
    import importlib

    module = importlib.import_module(f"torch_topg.triton_kernels.{op}")
    return {"fused_moe": _fused_moe_cases}[op](module)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("op", choices=["fused_moe"])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET is set: the kernels would not be compiled", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(f"triton cannot be imported: {exc}", file=sys.stderr)
        return SKIP
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        print("this triton has no NVIDIA backend", file=sys.stderr)
        return SKIP
    target = GPUTarget("cuda", args.arch, 32)
    for case in _cases(args.op):
        names = case.fn.arg_names
        signature = {n: "constexpr" if n in case.constexprs else case.signature[n] for n in names}
        attrs = {}
        if case.aligned:  # 16-divisible pointers and sizes (n_assign is T * k: anything)
            hinted = [i for i, n in enumerate(names) if n in case.signature and n != "n_assign"]
            attrs = {(i,): [["tt.divisibility", 16]] for i in hinted}
        src = ASTSource(fn=case.fn, signature=signature, constexprs=case.constexprs, attrs=attrs)
        compiled = triton.compile(src, target=target, options=case.options)
        ttgir = compiled.asm["ttgir"]
        print(
            f"{case.fn.__name__} [{case.name}] sm_{args.arch}: shared {compiled.metadata.shared} B, "
            f"async copies {ttgir.count('async_copy_global_to_local')}, "
            f"wgmma {ttgir.count('warp_group_dot ')}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
