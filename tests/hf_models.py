"""Tiny random Hugging Face checkpoints for tests, built with transformers and saved to temp dirs.

Weights are drawn with a large ``initializer_range`` so logits are peaked: greedy comparisons then
do not hinge on float rounding. The models are the oracle's (transformers') own classes, so a test
compares specloop against transformers' implementation of the same weights.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 512
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25, bos_token_id=1, eos_token_id=2,
)

DEEPSEEK: dict[str, Any] = dict(
    num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
    routed_scaling_factor=2.5, norm_topk_prob=True)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}

# name -> (transformers config class, model class, extra config)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_parameters={"rope_type": "default",
                                                                       "rope_theta": 1000000.0})),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
    "qwen3_tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    # MLA with q LoRA, interleaved YaRN rotary, a dense first layer, then MoE with group-limited
    # routing (2 of 4 groups) and a shared expert.
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(DEEPSEEK, q_lora_rank=48, n_group=4, topk_group=2,
                                                                      rope_parameters=YARN)),
    # No q LoRA, softmax routing over all experts, plain rotary.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(DEEPSEEK, q_lora_rank=None, topk_method="greedy",
                                                                      norm_topk_prob=False,
                                                                      n_shared_experts=2)),
}


@dataclass
class TinyModel:
    name: str
    path: str
    hf: Any  # the transformers model, float32, eval mode

    def logits(self, token_ids: list[int]) -> torch.Tensor:
        """HF's float32 logits at every position of ``token_ids``: [len, vocab]."""
        with torch.no_grad():
            return self.hf(torch.tensor([token_ids])).logits[0].float()

    def greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """HF's own greedy generation (no EOS stop), the token-level oracle."""
        with torch.no_grad():
            out = self.hf.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()


def build(name: str, root: str, seed: int = 0, overrides: dict[str, Any] | None = None,
          **save_kwargs: Any) -> TinyModel:
    import transformers

    config_cls, model_cls, extra = VARIANTS[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **(overrides or {})})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        # Biases default to zero; make them matter so a dropped bias fails the comparison.
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
        # DeepSeek-V3's router bias picks experts but does not weigh them: make it matter too.
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    path = os.path.join(root, name)
    model.save_pretrained(path, **save_kwargs)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2, 3], "bos_token_id": 1}, f)
    return TinyModel(name, path, model)


def prompts(n: int, seed: int = 0, min_len: int = 3, max_len: int = 40) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        out.append(torch.randint(4, VOCAB, (length,), generator=g).tolist())
    return out


_ROOT: str | None = None


@functools.cache
def tiny(name: str) -> TinyModel:
    """The variant ``name``, built once per test session."""
    global _ROOT
    if _ROOT is None:
        _ROOT = tempfile.mkdtemp(prefix="specloop-hf-")
        atexit.register(shutil.rmtree, _ROOT, True)
    return build(name, _ROOT)


def make_runner(model: TinyModel, **config: Any) -> Any:
    """A torch model runner on ``model`` with an initialised KV cache (block size 4 by default)."""
    from specloop.kernel.config import EngineConfig
    from specloop.kernel.plugins import PluginManager

    config.setdefault("block_size", 4)
    config.setdefault("num_kv_blocks", 64)
    cfg = EngineConfig(model=model.path, **config)
    plugins = PluginManager(load_entrypoints=False)
    runner = plugins.model_runners.create("torch", config=cfg, plugins=plugins)
    cfg.resolve(runner.model_max_len)
    runner.initialize()
    return runner
