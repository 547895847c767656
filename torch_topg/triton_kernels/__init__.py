"""Triton kernels for CUDA devices: one module per ``topg`` op they implement.

Each kernel has the semantics of the op's reference (``torch_topg.reference``) and runs
under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how CI tests
them. Which implementation an op runs on CUDA is chosen by ``torch_topg.ops.dispatch``.
Importing this package never imports ``triton``: each module does, and says so when it
is missing.
"""
