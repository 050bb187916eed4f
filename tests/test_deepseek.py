"""DeepSeek-V2/V3 against transformers on tiny random checkpoints: logits within 1e-4 in float32
(q LoRA on and off, grouped routing, a dense first layer, YaRN, interleaved or half-split rotary,
both RoPE config styles), the latent cache's shape and size, and the checkpoint names the loader
fuses. Greedy identity through chunked prefill, prefix hits and preemption is
``test_models_hf.test_greedy_matches_hf_under_every_schedule`` (its variants include both)."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import hf_models
import pytest
import torch
from hf_models import build, prompts, tiny
from test_models_hf import copy_model, forward_logits

from specloop.kernel.plugins import PluginManager
from specloop.models.attention import TorchAttentionBackend
from specloop.models.config import ModelLoadError, read_model_config
from specloop.models.loader import load_model

MODELS = PluginManager(load_entrypoints=False).models


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_logits_match_transformers(name: str) -> None:
    model = tiny(name)
    ours, _ = load_model(model.path, MODELS, "cpu", "float32")
    tokens = prompts(1, seed=31, min_len=70, max_len=70)[0]
    torch.testing.assert_close(forward_logits(ours, tokens), model.logits(tokens), atol=1e-4, rtol=0)


def test_v3_without_q_lora_half_split_rotary_and_older_rope_style(tmp_path: Any) -> None:
    """q projected directly, ``rope_interleave`` off, a single routing group, and YaRN written the
    older way (``rope_theta`` + ``rope_scaling`` with ``type``)."""
    model = build("deepseek_v3", str(tmp_path), seed=5, overrides={
        "q_lora_rank": None, "rope_interleave": False, "n_group": 1, "topk_group": 1})
    path = os.path.join(str(tmp_path), "deepseek_v3")
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    hf["rope_scaling"] = params
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    cfg = read_model_config(path)
    assert cfg.rope.rope_type == "yarn" and cfg.mla.q_lora_rank is None and not cfg.mla.rope_interleave
    ours, _ = load_model(path, MODELS, "cpu", "float32")
    tokens = prompts(1, seed=32, min_len=60, max_len=60)[0]
    torch.testing.assert_close(forward_logits(ours, tokens), model.logits(tokens), atol=1e-4, rtol=0)


def test_yarn_softmax_scale_and_config() -> None:
    cfg = read_model_config(tiny("deepseek_v3").path)
    mla, moe = cfg.mla, cfg.moe
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank, mla.latent_dim) == (32, 8, 48, 40)
    m = 0.1 * 0.8 * math.log(4.0) + 1.0  # mscale(factor 4, mscale_all_dim 0.8)
    assert mla.softmax_scale(cfg.rope) == pytest.approx((16 + 8) ** -0.5 * m * m)
    assert cfg.rope.cos_sin_scale == pytest.approx((0.1 * math.log(4.0) + 1.0) / m)
    assert (moe.scoring, moe.topk_method, moe.num_groups, moe.topk_groups) == ("sigmoid", "noaux_tc", 4, 2)
    assert not moe.is_moe_layer(0) and moe.is_moe_layer(1)
    v2 = read_model_config(tiny("deepseek_v2").path).moe
    assert (v2.scoring, v2.topk_method, v2.num_shared_experts, v2.norm_topk_prob) == ("softmax", "greedy", 2, False)


def test_latent_cache_shape_and_size() -> None:
    model = tiny("deepseek_v3")
    runner = hf_models.make_runner(model, num_kv_blocks=10)
    cfg = runner.model_config
    assert [tuple(c.shape) for c in runner.kv_caches] == [(10, 4, 32 + 8)] * cfg.num_layers
    per_block = cfg.num_layers * 4 * (32 + 8) * 4  # float32
    assert runner.kv_bytes_per_block() == cfg.kv_bytes_per_block(4, 4) == per_block
    assert cfg.kv_cache_shape(TorchAttentionBackend(), 7, 16) == (7, 16, 40)


def test_expert_names_fused_and_missing_ones_named(tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    path = copy_model(tiny("deepseek_v2").path, str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in weights  # transformers writes one name per expert
    ours, _ = load_model(path, MODELS, "cpu", "float32")
    experts = ours.layers[1].mlp.experts
    inter = experts.intermediate_size
    torch.testing.assert_close(experts.w13[3, inter:], weights["model.layers.1.mlp.experts.3.up_proj.weight"])
    # The two shared experts are the last two experts, each half of the shared MLP.
    shared_down = weights["model.layers.1.mlp.shared_experts.down_proj.weight"]
    torch.testing.assert_close(experts.w2[-1], shared_down[:, inter:])
    save_file({k: v for k, v in weights.items() if k != "model.layers.1.mlp.experts.5.gate_proj.weight"}, file)
    with pytest.raises(ModelLoadError, match="lacks 1 tensor.*layers.1.mlp.experts.w13"):
        load_model(path, MODELS, "cpu", "float32")
    save_file({**weights, "model.layers.1.mlp.experts.9.gate_proj.weight": torch.zeros(2)}, file)
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.1.mlp.experts.9.gate_proj.weight'"):
        load_model(path, MODELS, "cpu", "float32")


def test_mtp_layers_are_not_the_target_s() -> None:
    """The shipped DeepSeek-V3 holds its MTP layer at model.layers.3: the target loads without it."""
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "default_models" / "specloop-tiny-mtp"
    ours, cfg = load_model(str(path), MODELS, "cpu", "float32")
    assert (cfg.num_layers, cfg.num_mtp_layers, len(ours.layers)) == (3, 1, 3)
