"""Guard-removal check: delete each memory-safety guard of the CPU kernels in turn, rebuild,
and show that tests/test_guards.py then fails. Not part of the suite (it rebuilds the
extension once per guard: about 10 minutes on 2 cores); run it after changing a guard:

    .venv/bin/python tests/guard_mutations.py [--only NAME] [--keep]

It works on a copy of the working tree in a temporary folder (your tree and build are
untouched). A guard in csrc/common/op_checks.h is removed from a copy of that header that
only the binding under test includes, so each mutation recompiles one file. Prints one
row per guard: the test that failed without it, or "SURVIVED" (a guard no test notices).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = "csrc/common/op_checks.h"


@dataclass(frozen=True)
class Guard:
    name: str
    binding: str  # the csrc/cpu/*.cpp whose op the tests call
    file: str  # where the guard is (CHECKS or the binding itself)
    old: str  # the guard's text (must occur exactly once in `file`)
    new: str  # the text without the guard
    tests: str  # pytest -k expression over tests/test_guards.py


GUARDS = [
    Guard("rotary: rot_dim > head_size", "rotary", CHECKS,
          "s.rot_dim % 2 != 0 || s.rot_dim > head_size ||", "s.rot_dim % 2 != 0 ||",
          "rot_dim_above_head_size"),
    Guard("rotary: negative positions", "rotary", "csrc/cpu/rotary.cpp",
          "if (pmin < 0 || pmax >= max_pos)", "if (pmax >= max_pos)",
          "positions_outside_the_cache and -1"),
    Guard("rotary: last-dim stride of query/key", "rotary", CHECKS,
          "Arg(op, name, t).floating().last_dim_contiguous();", "Arg(op, name, t).floating();",
          "rotary_last_dim_stride"),
    Guard("reshape_and_cache: contiguous caches", "cache", CHECKS,
          'Arg(op, name, *t).dim(4).same_dtype(key, "key").same_device(key, "key").contiguous();',
          'Arg(op, name, *t).dim(4).same_dtype(key, "key").same_device(key, "key");',
          "cache_write_needs_a_contiguous_cache"),
    Guard("reshape_and_cache: last-dim stride of key", "cache", CHECKS,
          'Arg(op, "key", key).dim(3).floating().device(dev).last_dim_contiguous();',
          'Arg(op, "key", key).dim(3).floating().device(dev);',
          "cache_write_last_dim_stride and key"),
    Guard("reshape_and_cache: last-dim stride of value", "cache", CHECKS,
          'Arg(op, "value", value)\n      .dim(3)\n      .same_dtype(key, "key")\n'
          '      .same_device(key, "key")\n      .last_dim_contiguous();',
          'Arg(op, "value", value).dim(3).same_dtype(key, "key").same_device(key, "key");',
          "cache_write_last_dim_stride and value"),
    Guard("reshape_and_cache: slot range", "cache", "csrc/cpu/cache.cpp",
          "if (int64_t(slots[t]) >= num_slots)", "if (false)", "slot_out_of_range"),
    Guard("paged_attention: contiguous caches", "paged_attention", CHECKS,
          """Arg(op, name, *t).size(3, q.size(2), "head_dim of 'query'").contiguous();""",
          """Arg(op, name, *t).size(3, q.size(2), "head_dim of 'query'");""",
          "paged_attention_needs_a_contiguous_cache"),
    Guard("paged_attention: last-dim stride of query", "paged_attention", CHECKS,
          'Arg(op, "query", q).dim(3).floating().device(dev).last_dim_contiguous();',
          'Arg(op, "query", q).dim(3).floating().device(dev);',
          "paged_attention_query_last_dim_stride"),
    Guard("paged_attention: block_size 0", "paged_attention", CHECKS,
          "if (kc.size(1) <= 0)", "if (false)", "block_size_zero"),
    Guard("paged_attention: index values", "paged_attention", "csrc/cpu/paged_attention.cpp",
          "paged::check_indices(OP,", "if (false) paged::check_indices(OP,",
          "paged_attention_index_values"),
    Guard("attention: last-dim stride of query", "attention", CHECKS,
          'Arg(op, "query", q).dim(nd).floating().device(dev).last_dim_contiguous();',
          'Arg(op, "query", q).dim(nd).floating().device(dev);',
          "attention_last_dim_stride and query"),
    Guard("attention: last-dim stride of key", "attention", CHECKS,
          'Arg(op, "key", k).dim(nd).same_dtype(q, "query").same_device(q, "query").last_dim_contiguous();',
          'Arg(op, "key", k).dim(nd).same_dtype(q, "query").same_device(q, "query");',
          "attention_last_dim_stride and key"),
    Guard("attention: last-dim stride of value", "attention", CHECKS,
          'Arg(op, "value", v).dim(nd).same_dtype(q, "query").same_device(q, "query").last_dim_contiguous();',
          'Arg(op, "value", v).dim(nd).same_dtype(q, "query").same_device(q, "query");',
          "attention_last_dim_stride and value"),
    Guard("attention: ragged offsets", "attention", "csrc/cpu/attention.cpp",
          "if (!ok)\n", "if (false)\n", "ragged_offsets_out_of_range"),
    Guard("rms_norm: contiguous weight", "norm", CHECKS,
          '      .same_device(input, "input")\n      .contiguous()\n',
          '      .same_device(input, "input")\n', "rms_norm_weight_contiguous"),
    Guard("fused_add_rms_norm: contiguous input", "norm", CHECKS,
          'Arg(op, "input", input).contiguous();', "", "fused_add_rms_norm_contiguous and input"),
    Guard("fused_add_rms_norm: contiguous residual", "norm", CHECKS,
          'Arg(op, "residual", residual).same_dtype(input, "input").same_device(input, "input").contiguous();',
          'Arg(op, "residual", residual).same_dtype(input, "input").same_device(input, "input");',
          "fused_add_rms_norm_contiguous and residual"),
    Guard("fused_moe: contiguous w_gate_up", "fused_moe", CHECKS,
          """      .size(2, s.hidden, "the hidden size of 'hidden_states'")\n      .contiguous();""",
          """      .size(2, s.hidden, "the hidden size of 'hidden_states'");""",
          "fused_moe_weights_contiguous and w_gate_up"),
    Guard("fused_moe: contiguous w_down", "fused_moe", CHECKS,
          """      .size(2, s.inter, "half of dim 1 of 'w_gate_up'")\n      .contiguous();""",
          """      .size(2, s.inter, "half of dim 1 of 'w_gate_up'");""",
          "fused_moe_weights_contiguous and w_down"),
    Guard("fused_moe: device of topk_weights", "fused_moe", CHECKS,
          'Arg(op, "topk_weights", topk_weights).same_device(hidden, "hidden_states");', "",
          "fused_moe_routing_device and topk_weights"),
    Guard("fused_moe: device of topk_ids", "fused_moe", CHECKS,
          '      .index()\n      .same_device(hidden, "hidden_states")\n',
          "      .index()\n", "fused_moe_routing_device and topk_ids"),
    Guard("fused_moe: expert id range", "fused_moe", "csrc/cpu/fused_moe.cpp",
          "if (ids[i] < 0 || ids[i] >= E)", "if (false)", "fused_moe_expert_ids"),
    Guard("moe_topk: device of correction_bias", "moe_topk", CHECKS,
          '        .same_device(logits, "router_logits")\n', "", "correction_bias_device"),
    Guard("moe_topk: NaN order", "moe_topk", "csrc/cpu/moe_topk.cpp",
          "return std::isnan(a) ? !std::isnan(b) : a > b;", "return a > b;", "nan_logit"),
    Guard("linear: contiguous weight", "linear", CHECKS,
          """Arg(op, "weight", weight).size(1, input.size(-1), "the last dim of 'input'").contiguous();""",
          """Arg(op, "weight", weight).size(1, input.size(-1), "the last dim of 'input'");""",
          "linear_weight_contiguous"),
]  # fmt: skip


def sh(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="run the guards whose name contains this")
    ap.add_argument("--keep", action="store_true", help="keep the temporary tree")
    args = ap.parse_args()
    guards = [g for g in GUARDS if not args.only or args.only in g.name]
    py = sys.executable
    bin_dir = str(Path(py).parent)
    tmp = Path(tempfile.mkdtemp(prefix="topg-guards-"))
    tree, build = tmp / "tree", tmp / "build"
    files = sh(["git", "ls-files", "-co", "--exclude-standard"], ROOT).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (tree / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tree / f)
    so = tree / "torch_topg" / (ROOT / "torch_topg").glob("_C*.so").__next__().name
    env = {**os.environ, "PYTHONPATH": str(tree), "TOPG_REQUIRE_NATIVE": "1"}
    env.pop("TOPG_DISABLE_NATIVE", None)
    cmake = shutil.which("cmake", path=bin_dir) or "cmake"
    ninja = shutil.which("ninja", path=bin_dir) or "ninja"
    cfg = sh([cmake, "-S", str(tree), "-B", str(build), "-G", "Ninja",
              f"-DCMAKE_MAKE_PROGRAM={ninja}", f"-DPython3_EXECUTABLE={py}",
              f"-DTOPG_OUTPUT_DIR={build / 'out'}", "-DTOPG_CUDA=OFF"], tree)  # fmt: skip
    if cfg.returncode:
        print(cfg.stdout[-3000:], cfg.stderr[-3000:])
        return 2

    def build_and_test(expr: str) -> tuple[bool, bool, str]:
        b = sh([cmake, "--build", str(build), "--", f"-j{os.environ.get('MAX_JOBS', '2')}"], tree)
        if b.returncode:
            return False, False, "build failed: " + (b.stdout + b.stderr)[-800:]
        shutil.copy2(build / "out" / "_C.so", so)
        shutil.copy2(build / "out" / "_build_info.json", tree / "torch_topg" / "_build_info.json")
        t = sh([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_guards.py",
                "-k", expr], tree, env)  # fmt: skip
        tail = t.stdout.strip().splitlines()[-1] if t.stdout.strip() else t.stderr[-300:]
        ran = " passed" in tail or " failed" in tail
        return True, t.returncode == 0 and ran, tail

    t0 = time.monotonic()
    ok_build, passed, tail = build_and_test(" or ".join(f"({g.tests})" for g in guards))
    print(f"baseline (all guards in place): {'pass' if passed else 'FAIL'}: {tail}", flush=True)
    if not passed:
        return 2
    survived = 0
    for g in guards:
        target = tree / g.file
        text = target.read_text()
        if text.count(g.old) != 1:
            print(f"{g.name:45s} NOT FOUND ({text.count(g.old)} matches in {g.file})")
            survived += 1
            continue
        binding = tree / "csrc" / "cpu" / f"{g.binding}.cpp"
        saved = binding.read_text()
        if g.file == CHECKS:  # a private copy of the header, included by this binding only
            (tree / "csrc/common/op_checks_mut.h").write_text(text.replace(g.old, g.new))
            binding.write_text(saved.replace('"common/op_checks.h"', '"common/op_checks_mut.h"'))
        else:
            target.write_text(text.replace(g.old, g.new))
        try:
            ok_build, passed, tail = build_and_test(g.tests)
        finally:
            binding.write_text(saved)
            target.write_text(text)
        verdict = "build failed" if not ok_build else ("SURVIVED" if passed else "caught")
        survived += verdict != "caught"
        print(f"{g.name:45s} {verdict:9s} -k '{g.tests}': {tail}", flush=True)
    print(f"{len(guards) - survived}/{len(guards)} guards caught; {time.monotonic() - t0:.0f} s")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
