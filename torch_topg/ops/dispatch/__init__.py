"""Measured dispatch on CUDA: each call of ``attention``, ``paged_attention``, ``fused_moe``
and ``linear`` on a CUDA tensor runs the fastest implementation that can take it, among
topg's own kernel (``topg::_cuda_<op>``), torch's built-in ones and the Triton kernels.

* ``candidates.py``: the implementations and what each can take;
* ``classes.py``: the shape class and features of a call (the decision's cache key);
* ``table.py``: the tuning table per GPU model, and the fixed order without one;
* ``selector.py``: the decision, its cache, the report, the kernels at the CUDA keys;
* ``tune.py``: ``python -m torch_topg tune``, which measures a table on the current GPU.

CPU calls never come here: the CPU keys run topg's CPU kernels as before. docs/gpu.md
("Dispatch") describes the candidates, the table and the report.
"""

from torch_topg.ops.dispatch.candidates import Candidate
from torch_topg.ops.dispatch.classes import bucket, classify
from torch_topg.ops.dispatch.selector import (
    DEFAULT,
    INSTALLED,
    Decision,
    Dispatcher,
    DispatchReport,
    dispatch_report,
    force,
    forced,
    install,
)
from torch_topg.ops.dispatch.table import (
    DETERMINISTIC,
    Table,
    TableError,
    fixed_order,
    load_table,
    slug,
)

__all__ = [
    "DEFAULT",
    "DETERMINISTIC",
    "INSTALLED",
    "Candidate",
    "Decision",
    "DispatchReport",
    "Dispatcher",
    "Table",
    "TableError",
    "bucket",
    "classify",
    "dispatch_report",
    "fixed_order",
    "force",
    "forced",
    "install",
    "load_table",
    "slug",
]
