"""Drop-in entry points for inference engines: :mod:`torch_topg.compat.vllm` (vLLM's
custom-op names and signatures) and :mod:`torch_topg.compat.sglang` (sgl-kernel's).
Import the submodule you need; nothing here imports vLLM or SGLang."""
