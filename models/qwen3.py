"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on q and k before the rotary embedding."""

from __future__ import annotations

from typing import Any

from .config import ModelLoadError
from .llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def flags(cls, hf: dict[str, Any]) -> dict[str, bool]:
        if hf.get("use_sliding_window"):
            raise ModelLoadError("Qwen3 sliding-window attention (use_sliding_window=true) is not supported")
        bias = bool(hf.get("attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "mlp_bias": False}
