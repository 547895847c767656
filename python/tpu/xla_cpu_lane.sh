#!/usr/bin/env bash
# Optional lane (not in CI): torch 2.9 + torch_xla 2.9 on the CPU (PJRT_DEVICE=CPU), to
# exercise the XLA-key registration of torch_topg end to end on `xla` tensors.
#
#   python/tpu/xla_cpu_lane.sh            # make the venv (once), then run the check
#   XLA_VENV=/somewhere python/tpu/xla_cpu_lane.sh
#
# torch_xla 2.9.0 pins torch 2.9.0. The CPU wheel of torch comes from the PyTorch CPU
# index (a few hundred MB); PyPI's x86-64 torch 2.9.0 is a CUDA build of several GB.
# The native extension is built for the main venv's torch, so it is disabled here
# (TOPG_DISABLE_NATIVE=1): CPU ops run their reference, XLA ops the topg XLA kernel.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${XLA_VENV:-/work/venv-xla}"
PY_SYS="${PY_SYS:-python3}"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.deps" ]; then
  "$PY_SYS" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q torch==2.9.0 --index-url https://download.pytorch.org/whl/cpu \
    || "$VENV/bin/python" -m pip install -q torch==2.9.0
  "$VENV/bin/python" -m pip install -q torch_xla==2.9.0 numpy
  # torch_xla[pallas] pins jax/jaxlib 0.7.1: the kernels are checked against that JAX too.
  "$VENV/bin/python" -m pip install -q jax==0.7.1 jaxlib==0.7.1 ml_dtypes hypothesis pytest
  touch "$VENV/.deps"
fi
cd "$ROOT"
# Twice: torch_xla's default (eager functionalization: the in-place fused_add_rms_norm is
# refused, reported as a known limitation), then with functionalization off (all ops).
for func_off in 0 1; do
  echo "=== XLA_DISABLE_FUNCTIONALIZATION=$func_off"
  XLA_DISABLE_FUNCTIONALIZATION=$func_off PJRT_DEVICE=CPU TOPG_DISABLE_NATIVE=1 \
    PYTHONPATH="$ROOT" "$VENV/bin/python" python/tpu/xla_cpu_check.py
done
# The interpret-mode kernel tests and the registration tests under torch 2.9 / jax 0.7.1.
TOPG_DISABLE_NATIVE=1 PYTHONPATH="$ROOT" "$VENV/bin/python" -m pytest -q -p no:warnings \
  tests/test_tpu_kernels.py tests/test_tpu_registration.py
