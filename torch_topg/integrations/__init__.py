"""Integrations with inference engines that load torch_topg on their own.

:mod:`torch_topg.integrations.vllm_plugin` is vLLM's ``vllm.general_plugins`` entry point
(``pyproject.toml``): installed next to vLLM, it swaps topg kernels into vLLM's layers
with no code change (``docs/integrations.md``). Nothing here is imported by
``import torch_topg``, and importing this package imports no engine.
"""
