"""Options of the ``topg`` backend: ``torch.compile(m, backend="topg", options={...})``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Options:
    """
    Attributes:
        strict: raise when a pass fails (instead of leaving that pass's graph unchanged
            and warning once). Default False.
        inductor: hand the rewritten graph to Inductor (``compile_fx``) instead of
            running it as is. The topg ops stay extern calls; Inductor fuses and
            generates code for the rest. Default False: compiling the rest costs minutes
            on a small CPU and the topg graph is already mostly native calls.
        disable: pass names to skip (see ``torch_topg.compile.PASS_NAMES``).
        experts: substitute transformers' experts implementations with
            ``topg::fused_moe`` while tracing (process-wide; see ``experts.py``).
        verbose: print each pass's sites as the backend runs.
        decode_plan: run a transformers static-cache decode graph as one
            ``topg.DecodePlan`` call (``static_plan.py``; CPU). Default True.
    """

    strict: bool = False
    inductor: bool = False
    disable: tuple[str, ...] = field(default_factory=tuple)
    experts: bool = True
    verbose: bool = False
    decode_plan: bool = True

    @classmethod
    def parse(cls, options: dict[str, Any] | None) -> Options:
        from torch_topg.compile.passes import PASS_NAMES

        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"topg backend: unknown option(s) {unknown}; known: {sorted(known)}")
        disable = options.get("disable", ())
        if isinstance(disable, str):
            disable = (disable,)
        bad = sorted(set(disable) - set(PASS_NAMES))
        if bad:
            raise ValueError(
                f"topg backend: option 'disable' names unknown passes {bad}; passes: {PASS_NAMES}"
            )
        options["disable"] = tuple(disable)
        for name in ("strict", "inductor", "experts", "verbose", "decode_plan"):
            if name in options and not isinstance(options[name], bool):
                raise ValueError(
                    f"topg backend: option '{name}' expected a bool, got {options[name]!r}"
                )
        return cls(**options)
