"""``python -m torch_topg tune``: measure every candidate of the dispatched ops on this GPU
and write the tuning table (``table.py``).

For each op and dtype, every candidate is first run at a small shape and compared with the
op's reference; one that fails or disagrees is left out of the measurements and the table
says why (``excluded``). Then each case of :data:`CASES` (Llama-3-8B, Mixtral 8x7B and
Qwen3-MoE shaped calls) is timed with ``torch_topg.bench.compare`` on CUDA events, every
candidate that can take it interleaved in the same rounds (Triton candidates once per
config of their module's ``tune_configs(*args, **kwargs)``, when it has one). The whole
run stops starting cases after :data:`TIME_BUDGET_S` (about 3 minutes with the GPU's
start-up; ``--quick``: :data:`QUICK_BUDGET_S`).

:func:`measure` takes the clock, the candidates and the cases as arguments, so the tests
drive the same loop on the CPU with synthetic timings.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.metadata
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from torch_topg.bench.timing import Budget, Clock, CudaClock, compare
from torch_topg.ops._registry import OPS
from torch_topg.ops._schemas import DISPATCHED_ON_CUDA
from torch_topg.ops.dispatch import table as tables
from torch_topg.ops.dispatch.candidates import Candidate, candidates
from torch_topg.ops.dispatch.classes import classify

TIME_BUDGET_S = 150.0
QUICK_BUDGET_S = 60.0
#: Per case: a few rounds of interleaved samples (a case's candidates share its rounds).
CASE_BUDGET = Budget(warmup=2, min_rounds=3, max_rounds=10, budget_s=0.4, min_sample_s=1e-3)
#: (atol, rtol) of a candidate against the fp32-math reference at the small shape.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 5e-2), torch.float16: (5e-3, 5e-3)}

Make = Callable[[torch.device], "tuple[tuple, dict]"]


@dataclass(frozen=True)
class Case:
    """One measured call: ``make(device)`` -> ``(args, kwargs)`` of ``op``."""

    op: str
    label: str
    make: Make
    dtype: torch.dtype = torch.bfloat16
    quick: bool = False


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, std: float = 1.0):
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    return (torch.randn(shape, device=device) * std).to(dtype)


def attention_call(b: int, s: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> Make:
    def make(device: torch.device) -> tuple[tuple, dict]:
        q = _randn((b, s, hq, d), dtype, device)
        k, v = _randn((b, s, hkv, d), dtype, device), _randn((b, s, hkv, d), dtype, device)
        return (q, k, v), {"causal": True}

    return make


def paged_call(
    b: int, ctx: int, hq: int, hkv: int, d: int, dtype: torch.dtype, kv_int8: bool = False,
    block: int = 16,
) -> Make:  # fmt: skip
    def make(device: torch.device) -> tuple[tuple, dict]:
        per = -(-ctx // block)
        nb = b * per
        q = _randn((b, hq, d), dtype, device)
        kw: dict[str, Any] = {}
        if kv_int8:
            kc = torch.zeros((nb, block, hkv, d), dtype=torch.int8, device=device)
            vc = torch.zeros_like(kc)
            if device.type != "meta":
                kc.random_(-127, 128), vc.random_(-127, 128)
            kw = {"key_scale": torch.full((nb, block, hkv), 0.01, device=device),
                  "value_scale": torch.full((nb, block, hkv), 0.01, device=device)}  # fmt: skip
        else:
            kc, vc = (
                _randn((nb, block, hkv, d), dtype, device),
                _randn((nb, block, hkv, d), dtype, device),
            )
        if device.type == "meta":
            bt = torch.empty((b, per), dtype=torch.int32, device=device)
        else:
            bt = torch.randperm(nb, device=device).to(torch.int32).view(b, per)
        sl = torch.full((b,), ctx, dtype=torch.int32, device=device)
        return (q, kc, vc, bt, sl), kw

    return make


def moe_call(t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype) -> Make:
    def make(device: torch.device) -> tuple[tuple, dict]:
        x = _randn((t, h), dtype, device)
        wgu = _randn((e, 2 * inter, h), dtype, device, 0.02)
        wd = _randn((e, h, inter), dtype, device, 0.02)
        if device.type == "meta":
            ids = torch.empty((t, k), dtype=torch.int64, device=device)
            w = torch.empty((t, k), device=device)
        else:
            w, ids = torch.rand(t, e, device=device).softmax(-1).topk(k, dim=-1)
        return (x, wgu, wd, w.float(), ids), {"activation": "silu"}

    return make


def linear_call(m: int, n: int, k: int, dtype: torch.dtype) -> Make:
    def make(device: torch.device) -> tuple[tuple, dict]:
        return (_randn((m, k), dtype, device), _randn((n, k), dtype, device, 0.02)), {}

    return make


BF16 = torch.bfloat16
#: What ``tune`` measures: the shapes of issue 50's targets. Llama-3-8B: 32 query / 8 KV
#: heads of 128, MLP 14336 x 4096; Mixtral 8x7B: 8 experts, top-2, 4096 -> 14336;
#: Qwen3-MoE (30B-A3B): 128 experts, top-8, 2048 -> 768.
CASES: list[Case] = [
    *[Case("attention", f"llama-3-8b prefill S={s}", attention_call(1, s, 32, 8, 128, BF16),
           quick=s in (2048, 8192)) for s in (1024, 2048, 4096, 8192)],
    Case("attention", "llama-3-8b prefill S=2048 fp16", attention_call(1, 2048, 32, 8, 128, torch.float16),
         torch.float16),
    *[Case("paged_attention", f"llama-3-8b decode B={b} ctx={c}", paged_call(b, c, 32, 8, 128, BF16),
           quick=b == 32) for b in (1, 32, 128) for c in (2048, 8192)],
    Case("paged_attention", "llama-3-8b decode B=32 ctx=4096 int8 KV",
         paged_call(32, 4096, 32, 8, 128, BF16, kv_int8=True)),
    *[Case("fused_moe", f"mixtral-8x7b T={t}", moe_call(t, 8, 2, 4096, 14336, BF16),
           quick=t in (1, 16, 256)) for t in (1, 4, 16, 64, 256)],
    *[Case("fused_moe", f"qwen3-moe T={t}", moe_call(t, 128, 8, 2048, 768, BF16),
           quick=t in (1, 16, 256)) for t in (1, 4, 16, 64, 256)],
    *[Case("linear", f"llama-3-8b up/gate M={m}", linear_call(m, 14336, 4096, BF16),
           quick=m in (1, 16, 2048)) for m in (1, 4, 16, 64, 256, 2048)],
]  # fmt: skip

#: The small calls every candidate is checked on before it is timed, per op.
SMALL: dict[str, Callable[[torch.dtype], Make]] = {
    "attention": lambda dt: attention_call(2, 64, 8, 2, 128, dt),
    "paged_attention": lambda dt: paged_call(3, 40, 8, 2, 128, dt),
    "fused_moe": lambda dt: moe_call(5, 8, 2, 64, 32, dt),
    "linear": lambda dt: linear_call(5, 64, 128, dt),
}


def _configs(c: Candidate, args: tuple, kwargs: dict) -> list[dict | None]:
    """A Triton candidate's configs to time: its module's ``tune_configs`` (at most 8), or
    just its defaults."""
    if not c.tunable:
        return [None]
    try:
        mod = importlib.import_module(f"torch_topg.triton_kernels.{c.op}")
    except ImportError:
        return [None]
    fn = getattr(mod, "tune_configs", None)
    found = list(fn(*args, **kwargs))[:8] if callable(fn) else []
    return found or [None]


def _call(c: Candidate, args: tuple, kwargs: dict, config: dict | None = None) -> Any:
    return c.run(*args, config=config, **kwargs) if c.tunable else c.run(*args, **kwargs)


def check_against_reference(
    op: str, cands: Iterable[Candidate], dtype: torch.dtype, device: torch.device
) -> tuple[list[str], dict[str, str]]:
    """Run each candidate (not ``reference``) at the op's small call in ``dtype``;
    returns ``(agreed, {name: why excluded})``. One that cannot take the small call is in
    neither (it is not timed at a shape it was not checked at)."""
    args, kwargs = SMALL[op](dtype)(device)
    want = OPS[op].reference(*args, **kwargs).float()
    atol, rtol = TOLERANCE[dtype]
    agreed, excluded = [], {}
    for c in cands:
        if c.name == "reference" or (c.unavailable() or c.supports(*args, **kwargs)):
            continue
        try:
            got = _call(c, args, kwargs).float()
        except Exception as exc:  # a candidate that fails is reported, not fatal
            excluded[c.name] = f"failed at the small shape: {type(exc).__name__}: {exc}"[:300]
            continue
        if got.shape != want.shape:
            excluded[c.name] = f"shape {list(got.shape)}, the reference's {list(want.shape)}"
        elif not torch.allclose(got, want, atol=atol, rtol=rtol, equal_nan=True):
            err = (got - want).abs().nan_to_num(float("inf")).max().item()
            excluded[c.name] = (
                f"disagrees with the reference: max error {err:.3g} (atol {atol}, rtol {rtol})"
            )
        else:
            agreed.append(c.name)
    return agreed, excluded


def measure(
    cases: Iterable[Case],
    cands: dict[str, list[Candidate]],
    *,
    device: torch.device,
    clock: Clock,
    budget: Budget = CASE_BUDGET,
    time_budget_s: float = TIME_BUDGET_S,
    timer: Callable[[], float] = time.monotonic,
    log: Callable[[str], None] = print,
) -> tuple[list[dict], list[str]]:
    """Check, then time, every case; returns ``(table entries, cases not measured and
    why)``. ``clock`` times the samples (CUDA events on a GPU; the tests pass a synthetic
    one), ``timer`` keeps the overall ``time_budget_s``."""
    start = timer()
    entries: dict[tuple[str, str], dict] = {}
    left: list[str] = []
    checked: dict[tuple[str, torch.dtype], tuple[list[str], dict[str, str]]] = {}
    for case in cases:
        if timer() - start > time_budget_s:
            left.append(f"{case.op} {case.label}: over the {time_budget_s:.0f} s budget")
            continue
        key = (case.op, case.dtype)
        if key not in checked:
            checked[key] = check_against_reference(case.op, cands[case.op], case.dtype, device)
        agreed, excluded = checked[key]
        args, kwargs = case.make(device)
        cls, _ = classify(case.op, args, kwargs)
        if (case.op, cls) in entries:
            left.append(f"{case.op} {case.label}: class [{cls}] already measured")
            continue
        variants: dict[str, Callable[[], Any]] = {}
        owner: dict[str, tuple[str, dict | None]] = {}
        skipped = dict(excluded)
        for c in cands[case.op]:
            if c.name == "reference" or c.name in excluded:
                continue
            why = c.unavailable() or c.supports(*args, **kwargs)
            if why is None and c.name not in agreed:
                why = f"not checked: cannot take the small {case.dtype} call"
            if why is not None:
                skipped.setdefault(c.name, why)
                continue
            for i, cfg in enumerate(_configs(c, args, kwargs)):
                name = c.name if cfg is None else f"{c.name}#{i}"
                variants[name] = functools.partial(_call, c, args, kwargs, cfg)
                owner[name] = (c.name, cfg)
        for name, fn in list(variants.items()):  # a failing config must not stop the case
            try:
                fn()
            except Exception as exc:
                skipped.setdefault(owner[name][0], f"failed: {type(exc).__name__}: {exc}"[:300])
                del variants[name]
        if not variants:
            left.append(f"{case.op} {case.label}: no candidate could run it")
            continue
        comp = compare(variants, budget, clock=clock)
        times: dict[str, float] = {}
        configs: dict[str, dict] = {}
        for name in variants:
            cand, cfg = owner[name]
            us = comp.stats(name).median * 1e6
            if cand not in times or us < times[cand]:
                times[cand] = us
                if cfg is not None:
                    configs[cand] = cfg
                else:
                    configs.pop(cand, None)
        pick = min(times, key=lambda n: (times[n], n))
        entry = {"op": case.op, "class": cls, "case": case.label, "times_us": times,
                 "pick": pick, "configs": configs, "excluded": {
                     n: r for n, r in skipped.items() if n in excluded}}  # fmt: skip
        entry["skipped"] = {n: r for n, r in skipped.items() if n not in excluded}
        entries[(case.op, cls)] = entry
        shown = ", ".join(f"{n} {t:.1f}" for n, t in sorted(times.items(), key=lambda x: x[1]))
        log(f"{case.op:<16} {case.label:<40} [{cls}] -> {pick}  ({shown} us)")
        variants.clear()  # the case's tensors go before the next case's are made
    return list(entries.values()), left


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=tables.TABLES_DIR)  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def select_cases(ops: list[str] | None, quick: bool) -> list[Case]:
    return [c for c in CASES if (ops is None or c.op in ops) and (c.quick or not quick)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m torch_topg tune", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", help="where to write the table (default: the user cache for this GPU)")
    p.add_argument("--ops", help=f"comma-separated subset of {','.join(DISPATCHED_ON_CUDA)}")
    p.add_argument("--quick", action="store_true", help="fewer shapes (about a minute)")
    p.add_argument(
        "--budget",
        type=float,
        help=f"seconds after which no new case starts (default {TIME_BUDGET_S:.0f}, "
        f"{QUICK_BUDGET_S:.0f} with --quick)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="list what would be measured; no GPU needed"
    )
    a = p.parse_args(argv)
    ops = None if not a.ops else [o.strip() for o in a.ops.split(",") if o.strip()]
    for op in ops or []:
        if op not in DISPATCHED_ON_CUDA:
            p.error(f"--ops: {op!r} is not one of {', '.join(DISPATCHED_ON_CUDA)}")
    cases = select_cases(ops, a.quick)
    limit = a.budget or (QUICK_BUDGET_S if a.quick else TIME_BUDGET_S)
    if a.dry_run:
        meta = torch.device("meta")
        print(f"tune would measure {len(cases)} cases (time budget {limit:.0f} s):")
        for c in cases:
            args, kwargs = c.make(meta)
            names = ", ".join(x.name for x in candidates(c.op) if x.name != "reference")
            print(f"  {c.op:<16} {c.label:<40} [{classify(c.op, args, kwargs)[0]}]  {names}")
        return 0
    if not torch.cuda.is_available():
        print(f"tune measures on a CUDA GPU, and torch.cuda.is_available() is False here (torch "
              f"{torch.__version__}, CUDA {torch.version.cuda}); `--dry-run` lists the cases.",
              file=sys.stderr)  # fmt: skip
        return 2
    from torch_topg.ops.dispatch.selector import DEFAULT, cuda_device_info

    device = torch.device("cuda", torch.cuda.current_device())
    name, cap = cuda_device_info(device)
    header = {"commit": _commit(), "torch": torch.__version__, "triton": _version("triton"),
              "cuda": torch.version.cuda}  # fmt: skip
    data = tables.new_table(name, cap, **header)
    print(f"tune on {name} (sm_{cap[0]}{cap[1]}), torch {torch.__version__}, {len(cases)} cases")
    t0 = time.monotonic()
    entries, left = measure(cases, {op: candidates(op) for op in DISPATCHED_ON_CUDA},
                            device=device, clock=CudaClock(), time_budget_s=limit)  # fmt: skip
    data["entries"] = entries
    data["seconds"] = round(time.monotonic() - t0, 1)
    for line in left:
        print(f"not measured: {line}")
    if not entries:
        print("nothing measured: no table written", file=sys.stderr)
        return 1
    out = a.out or tables.user_cache_dir() / f"{tables.slug(name)}.json"
    tables.load_table(tables.write_table(data, out), name, cap, DISPATCHED_ON_CUDA)  # re-read
    DEFAULT.reset()
    print(f"wrote {out}: {len(entries)} entries in {data['seconds']} s")
    return 0
