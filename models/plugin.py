"""Built-in model architectures.

Registered by their Hugging Face ``architectures`` names as "module:attr" strings, so listing
plugins does not import torch; the loader imports a class only when a checkpoint needs it.
"""

from __future__ import annotations

from specloop.kernel.hookspecs import Register, hookimpl

ARCHITECTURES = {
    "LlamaForCausalLM": "specloop.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "specloop.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "specloop.models.qwen3:Qwen3ForCausalLM",
    "DeepseekV2ForCausalLM": "specloop.models.deepseek_v3:DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "specloop.models.deepseek_v3:DeepseekV3ForCausalLM",
}


@hookimpl
def specloop_register_models(register: Register) -> None:
    for name, factory in ARCHITECTURES.items():
        register(name, factory)
