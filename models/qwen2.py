"""Qwen2 / Qwen2.5: the Llama decoder with biases on the q/k/v projections (none on o_proj)."""

from __future__ import annotations

from typing import Any

from .config import ModelLoadError
from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flags(cls, hf: dict[str, Any]) -> dict[str, bool]:
        if hf.get("use_sliding_window"):
            raise ModelLoadError("Qwen2 sliding-window attention (use_sliding_window=true) is not supported")
        return {"qkv_bias": True, "o_bias": False, "qk_norm": False, "mlp_bias": False}
