"""vLLM out-of-tree plugin: topg kernels inside vLLM's own layers, with no code change.

``pyproject.toml`` registers :func:`register` as the ``vllm.general_plugins`` entry point
``topg``. vLLM calls it in every process it starts (front end, engine core, workers)
before building the model; it subclasses vLLM's layer classes and registers each
subclass with ``CustomOp.register_oot``, so that ``RMSNorm(...)`` in any vLLM model
builds ``TopgRMSNorm``. Replaced (when vLLM has the class; see ``registered()``):

* ``RMSNorm`` (with and without residual) -> ``topg::rms_norm`` / ``fused_add_rms_norm``
* ``SiluAndMul``, ``GeluAndMul`` -> ``topg::silu_and_mul`` / ``gelu_and_mul``
* ``RotaryEmbedding`` and those of its vLLM subclasses that only change the cos/sin
  table (Llama-3, linear / dynamic-NTK / YaRN scaling, ...) -> ``topg::rotary_embedding``
* ``UnquantizedFusedMoEMethod`` (the experts of an unquantised fused-MoE layer)
  -> ``topg::fused_moe``

Each replaced layer checks every call: arguments topg does not cover (quantised or
biased experts, expert parallelism, other activations, a variance over part of the
hidden size, tensors on other devices, native kernels not built, ...) run vLLM's own
implementation, and the reason is logged once per layer class and reason. A topg layer
runs where vLLM would run its own kernel for that op (``CompilationConfig.custom_ops``:
all ops in eager mode, none by default under Inductor, ``+rms_norm`` etc. to choose);
elsewhere vLLM's ``forward_native`` runs, as vLLM itself would.

Environment: ``TOPG_VLLM_PLUGIN`` = ``1`` (default: as above), ``0`` (the plugin does
nothing), ``all`` (topg also where ``custom_ops`` leaves an op to Inductor).

Importing this module imports neither vLLM nor anything vLLM-specific: the layer
classes live in :mod:`torch_topg.integrations._vllm_layers`, imported by
:func:`register`; the switch and the fallback log they share with this module are in
:mod:`torch_topg.integrations.vllm_mode`. Log lines go to the ``vllm.torch_topg`` logger
(vLLM's handler).
"""

from __future__ import annotations

import threading

from torch_topg.integrations.vllm_mode import ENV_VAR, LOGGER, log_fallback, mode

__all__ = ["ENV_VAR", "LOGGER", "log_fallback", "mode", "register", "registered", "skipped"]

_lock = threading.Lock()
_registered: dict[str, str] = {}  # vLLM class name -> topg class
_skipped: dict[str, str] = {}  # vLLM class or module -> why it is not replaced


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: register the topg layers.

    Safe to call more than once (vLLM may, and so do tests): a layer already replaced by
    this plugin stays as it is; one replaced by another plugin is left to that plugin.
    """
    if mode() == "off":
        LOGGER.info("torch_topg: vLLM plugin disabled by %s=0", ENV_VAR)
        return
    from torch_topg.integrations import _vllm_layers

    with _lock:
        _vllm_layers.register_all(_registered, _skipped)
    LOGGER.info(
        "torch_topg: topg kernels for %s%s",
        ", ".join(sorted(_registered)) or "no layer",
        f" (not replaced: {', '.join(sorted(_skipped))})" if _skipped else "",
    )


def registered() -> dict[str, str]:
    """vLLM class name -> the topg class registered for it (after :func:`register`)."""
    return dict(_registered)


def skipped() -> dict[str, str]:
    """vLLM class (or module) -> why the plugin does not replace it."""
    return dict(_skipped)
