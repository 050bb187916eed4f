"""Loading Hugging Face checkpoints: config styles, sharding, tied heads, EOS ids, dtype, errors,
hidden-state collection; and greedy generation through the engine, token-identical to transformers."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import torch
from hf_models import VARIANTS, build, prompts, tiny

from specloop.models.context import ForwardContext
from specloop.models.attention import AttentionMetadata, TorchAttentionBackend
from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineCore
from specloop.kernel.plugins import PluginManager
from specloop.kernel.request import Request
from specloop.kernel.sampling_params import SamplingParams
from specloop.models.config import ModelLoadError, read_model_config
from specloop.models.loader import load_model

MODELS = PluginManager(load_entrypoints=False).models


def forward_logits(model: Any, token_ids: list[int]) -> torch.Tensor:
    """Our model's logits for one prompt, through a scratch paged cache."""
    n = len(token_ids)
    cfg = model.config
    blocks = -(-n // 4)
    backend = TorchAttentionBackend()
    caches = [torch.zeros(cfg.kv_cache_shape(backend, blocks, 4), dtype=model.lm_head.weight.dtype)
              for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.tensor([0, n]), torch.tensor([n]), torch.arange(n),
                             torch.arange(blocks, dtype=torch.int32)[None], n, n, [0, n], [n])
    with torch.inference_mode():
        hidden, _ = model(torch.tensor(token_ids), torch.arange(n), ForwardContext(backend, meta, caches))
        return model.compute_logits(hidden).float()


def copy_model(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    return dst


def test_config_fields_and_generation_config_eos() -> None:
    cfg = read_model_config(tiny("llama").path)
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.max_position_embeddings == 512 and cfg.vocab_size == 512
    assert cfg.eos_token_ids == (2, 3)  # generation_config.json's list wins over config.json's int
    assert cfg.rope.rope_type == "llama3" and cfg.rope.factor == 8.0
    assert read_model_config(tiny("qwen3_tied").path).tie_word_embeddings
    assert read_model_config(tiny("qwen3").path).head_dim == 32


def test_eos_from_config_json_when_no_generation_config(tmp_path: Any) -> None:
    path = copy_model(tiny("qwen2").path, str(tmp_path / "m"))
    os.remove(os.path.join(path, "generation_config.json"))
    assert read_model_config(path).eos_token_ids == (2,)


def test_older_config_style_loads_the_same_model(tmp_path: Any) -> None:
    """``rope_theta`` + ``rope_scaling`` (older transformers) instead of ``rope_parameters``."""
    model = tiny("llama")
    path = copy_model(model.path, str(tmp_path / "old"))
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    params = hf.pop("rope_parameters")
    hf["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    hf["rope_scaling"] = params
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    cfg = read_model_config(path)
    assert cfg.rope == read_model_config(model.path).rope
    ours, _ = load_model(path, MODELS, "cpu", "auto")
    tokens = prompts(1, seed=11, min_len=90, max_len=90)[0]  # past original_max_position_embeddings
    torch.testing.assert_close(forward_logits(ours, tokens), model.logits(tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
                                  {"rope_type": "default", "rope_theta": 100.0}])
def test_rope_variants(tmp_path: Any, rope: dict[str, Any]) -> None:
    model = build("llama", str(tmp_path), seed=4, overrides={"rope_parameters": rope, "attention_bias": True,
                                                             "mlp_bias": True})
    ours, cfg = load_model(model.path, MODELS, "cpu", "auto")
    assert cfg.rope.rope_type == rope["rope_type"]
    tokens = prompts(1, seed=16, min_len=60, max_len=60)[0]
    torch.testing.assert_close(forward_logits(ours, tokens), model.logits(tokens), atol=1e-4, rtol=0)


def test_sharded_checkpoint(tmp_path: Any) -> None:
    model = build("qwen3_tied", str(tmp_path), seed=3, max_shard_size="100KB")
    files = os.listdir(model.path)
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 2
    ours, cfg = load_model(model.path, MODELS, "cpu", "auto")
    assert ours.lm_head.weight is ours.embed_tokens.weight
    tokens = prompts(1, seed=12)[0]
    torch.testing.assert_close(forward_logits(ours, tokens), model.logits(tokens), atol=1e-4, rtol=0)
    shard = sorted(f for f in files if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(model.path, shard))
    with pytest.raises(ModelLoadError, match=shard):
        load_model(model.path, MODELS, "cpu", "auto")


def test_dtype_auto_and_explicit() -> None:
    path = tiny("qwen2").path
    ours, _ = load_model(path, MODELS, "cpu", "auto")
    assert ours.lm_head.weight.dtype == torch.float32
    ours, _ = load_model(path, MODELS, "cpu", "bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert ours.layers[0].self_attn.rotary.cos.dtype == ours.rotary.sin.dtype == torch.float32
    tokens = prompts(1, seed=13)[0]
    # bfloat16 keeps the same argmax on these peaked logits almost everywhere.
    agree = (forward_logits(ours, tokens).argmax(-1) == tiny("qwen2").logits(tokens).argmax(-1)).float().mean()
    assert agree > 0.8
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        load_model(path, MODELS, "cpu", "int8")


def test_errors_name_what_is_missing_or_unsupported(tmp_path: Any) -> None:
    with pytest.raises(ModelLoadError, match="not a directory"):
        read_model_config(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_model_config(str(tmp_path / "empty"))
    path = copy_model(tiny("qwen2").path, str(tmp_path / "m"))
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        hf = json.load(f)

    def write(**changes: Any) -> None:
        with open(cfg_path, "w") as f:
            json.dump({**hf, **changes}, f)

    write(architectures=["MistralForCausalLM"])
    with pytest.raises(ModelLoadError, match="'MistralForCausalLM'.*supported: DeepseekV2ForCausalLM, "
                                             "DeepseekV3ForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        load_model(path, MODELS, "cpu", "auto")
    write(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0})
    with pytest.raises(ModelLoadError, match="'longrope'.*supported: default, linear, llama3, yarn"):
        read_model_config(path)
    write(hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act"):
        read_model_config(path)
    hf.pop("intermediate_size")
    write()
    with pytest.raises(ModelLoadError, match="intermediate_size"):
        read_model_config(path)

    path = copy_model(tiny("qwen2").path, str(tmp_path / "w"))
    os.remove(os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        load_model(path, MODELS, "cpu", "auto")


def test_missing_and_unexpected_tensors(tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    path = copy_model(tiny("qwen3").path, str(tmp_path / "m"))
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    save_file({k: v for k, v in weights.items() if "layers.1.self_attn.k_proj" not in k}, file)
    with pytest.raises(ModelLoadError, match="lacks 1 tensor.*layers.1.self_attn.qkv_proj.weight"):
        load_model(path, MODELS, "cpu", "auto")
    save_file({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, file)
    with pytest.raises(ModelLoadError, match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        load_model(path, MODELS, "cpu", "auto")


def test_qwen2_biases_are_loaded() -> None:
    """The test models have non-zero q/k/v biases; dropping them must change the logits."""
    model = tiny("qwen2")
    ours, _ = load_model(model.path, MODELS, "cpu", "auto")
    tokens = prompts(1, seed=14)[0]
    torch.testing.assert_close(forward_logits(ours, tokens), model.logits(tokens), atol=1e-4, rtol=0)
    ours.layers[0].self_attn.qkv_proj.bias.zero_()
    assert (forward_logits(ours, tokens) - model.logits(tokens)).abs().max() > 1e-2


def test_collect_hidden_states_of_chosen_layers() -> None:
    model = tiny("llama")
    ours, cfg = load_model(model.path, MODELS, "cpu", "auto")
    tokens = prompts(1, seed=15)[0]
    n = len(tokens)
    backend = TorchAttentionBackend()
    caches = [torch.zeros(backend.kv_cache_shape(n, 1, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    meta = AttentionMetadata(torch.tensor([0, n]), torch.tensor([n]), torch.arange(n),
                             torch.arange(n, dtype=torch.int32)[None], n, n, [0, n], [n])
    with torch.inference_mode():
        final, aux = ours(torch.tensor(tokens), torch.arange(n), ForwardContext(backend, meta, caches),
                          aux_layers=(0, 1, 2))
        ref = model.hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    # HF: [embeddings, after layer 0, ..., final norm]; ours: streams entering layers 0, 1 and
    # (index num_layers) the stream before the final norm.
    torch.testing.assert_close(aux[0], ref[0][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(aux[1], ref[1][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(ours.norm(aux[2]), final, atol=1e-5, rtol=0)
    torch.testing.assert_close(final, ref[-1][0], atol=1e-4, rtol=0)


# --- greedy generation through the engine ---------------------------------------------------

NUM_PROMPTS, MAX_TOKENS = 8, 10


def generate(path: str, token_prompts: list[list[int]], **config: Any) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy outputs through EngineCore with the real scheduler, plus counts of what happened."""
    core = EngineCore(EngineConfig(model=path, **{"max_model_len": 64, **config}))
    seen = {"preemptions": 0, "prefix_hits": 0, "partial_prefills": 0}
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        core.add_requests([Request(str(i), p, params) for i, p in enumerate(token_prompts)])
        outs: dict[str, list[int]] = {str(i): [] for i in range(len(token_prompts))}
        while core.has_unfinished_requests():
            step = core.step()
            for o in step.outputs:
                outs[o.req_id].extend(o.new_token_ids)
            stats = step.scheduler_stats
            seen["preemptions"] += stats.num_preemptions
            seen["prefix_hits"] += stats.prefix_cache_hits
            core.post_step()
    finally:
        core.shutdown()
    return [outs[str(i)] for i in range(len(token_prompts))], seen


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_matches_hf_under_every_schedule(name: str) -> None:
    model = tiny(name)
    shared = prompts(1, seed=20, min_len=12, max_len=12)[0]
    # Half the prompts share a 12-token prefix, so prefix caching has something to hit.
    token_prompts = [shared + p if i % 2 else p for i, p in enumerate(prompts(NUM_PROMPTS, seed=21, max_len=20))]
    expected = [model.greedy(p, MAX_TOKENS) for p in token_prompts]
    assert len({tuple(e) for e in expected}) == NUM_PROMPTS  # distinct outputs: a real comparison
    out, _ = generate(model.path, token_prompts, block_size=4)
    assert out == expected
    out, seen = generate(model.path, token_prompts, block_size=4, enable_prefix_caching=False,
                         max_num_batched_tokens=7)
    assert out == expected and seen["prefix_hits"] == 0
    out, seen = generate(model.path, token_prompts, block_size=4, max_num_batched_tokens=16)
    assert out == expected and seen["prefix_hits"] > 0
    # 11 usable blocks of 4 tokens cannot hold every running request at once: requests get preempted.
    out, seen = generate(model.path, token_prompts, block_size=4, num_kv_blocks=12, max_model_len=44)
    assert out == expected and seen["preemptions"] > 0


def test_comparison_catches_a_broken_kv_cache() -> None:
    """The same comparison fails when cached context is lost between steps: a runner that wipes
    its KV cache after each step still gets every prefill right but no decode."""
    model = tiny("qwen3")
    token_prompts = prompts(2, seed=22)
    expected = [model.greedy(p, MAX_TOKENS) for p in token_prompts]
    core = EngineCore(EngineConfig(model=model.path, block_size=4))
    execute = core.runner.execute_model

    def wipe_then_execute(plan: Any) -> None:
        for cache in core.runner.kv_caches:
            cache.zero_()
        execute(plan)

    core.runner.execute_model = wipe_then_execute
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    core.add_requests([Request(str(i), p, params) for i, p in enumerate(token_prompts)])
    outs: dict[str, list[int]] = {"0": [], "1": []}
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            outs[o.req_id].extend(o.new_token_ids)
    assert [outs["0"][0], outs["1"][0]] == [expected[0][0], expected[1][0]]
    assert [outs["0"], outs["1"]] != expected
