"""EAGLE-1, EAGLE-3 and Medusa heads on tiny random checkpoints built from the documented layouts.

Oracles: greedy output with each method equals greedy output without speculation (Qwen3 and Llama
targets, under chunked prefill, prefix caching and preemption); every EAGLE proposal equals the
drafts of the training code's head (``tools/train_heads.py``, dense attention, training-time-test
form) recomputed from the whole verified sequence, so the paged head cache never serves a stale
entry; the loaders take each public spelling and name the tensor a malformed checkpoint gets wrong.
"""

from __future__ import annotations

import json
import os
import sys

import hf_models
import pytest
import torch
from safetensors.torch import save_file

from specloop import LLM, SamplingParams
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager
from specloop.models.config import ModelLoadError, read_model_config
from specloop.models.ops import TORCH_OPS
from specloop.proposers.base import DraftProposal, ProposerContext, ProposerInputs
from specloop.proposers.eagle import Eagle3Proposer, EagleProposer
from specloop.proposers.heads import load_head
from specloop.proposers.medusa import load_medusa

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
import train_heads  # noqa: E402

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
STRESSED = dict(max_model_len=96, block_size=4, num_kv_blocks=30, max_num_batched_tokens=16,
                enable_prefix_caching=True, enable_chunked_prefill=True)
V, H = hf_models.VOCAB, 64
HEAD = dict(architectures=["LlamaForCausalLM"], hidden_size=H, intermediate_size=96, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=512, vocab_size=V, hidden_act="silu")
DRAFT_VOCAB = 384


def _randn(g: torch.Generator, *shape: int, std: float = 0.15) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * std


def _layer(g: torch.Generator, prefix: str, d_in: int, input_norms: bool) -> dict[str, torch.Tensor]:
    t = {prefix + "self_attn.q_proj.weight": _randn(g, 64, d_in),
         prefix + "self_attn.k_proj.weight": _randn(g, 32, d_in),
         prefix + "self_attn.v_proj.weight": _randn(g, 32, d_in),
         prefix + "self_attn.o_proj.weight": _randn(g, H, 64),
         prefix + "mlp.gate_proj.weight": _randn(g, 96, H), prefix + "mlp.up_proj.weight": _randn(g, 96, H),
         prefix + "mlp.down_proj.weight": _randn(g, H, 96),
         prefix + "post_attention_layernorm.weight": 1 + _randn(g, H)}
    if input_norms:
        t[prefix + "input_layernorm.weight"] = 1 + _randn(g, H)
        t[prefix + "hidden_norm.weight"] = 1 + _randn(g, H)
    return t


def eagle_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": _randn(g, H, 2 * H), **_layer(g, "layers.0.", H, False)}


def eagle3_tensors(seed: int = 0, layers: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    vocab = torch.sort(torch.randperm(V, generator=g)[:DRAFT_VOCAB]).values
    return {"fc.weight": _randn(g, H, layers * H), "norm.weight": 1 + _randn(g, H),
            "lm_head.weight": _randn(g, DRAFT_VOCAB, H, std=0.5), "d2t": vocab - torch.arange(DRAFT_VOCAB),
            "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, vocab, True), **_layer(g, "midlayer.", 2 * H, True)}


def eagle3_config(**extra: object) -> dict:
    return {**HEAD, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 0, 2]}, **extra}


def medusa_tensors(seed: int = 0, heads: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {}
    for h in range(heads):
        t[f"blocks.{h}.layers.0.weight"] = _randn(g, H, H)
        t[f"blocks.{h}.layers.0.bias"] = _randn(g, H)
        t[f"lm_heads.{h}.weight"] = _randn(g, V, H, std=0.5)
    return t


MEDUSA = {"architectures": ["MedusaModel"], "hidden_size": H, "vocab_size": V, "num_heads": 3, "num_hidden_layers": 1,
          "medusa_fc_bias": True}


def write_head(path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


@pytest.fixture(scope="module")
def heads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("heads")
    return {"eagle": write_head(root / "eagle", {**HEAD, "architectures": ["EagleLlamaForCausalLM"]}, eagle_tensors()),
            "eagle3": write_head(root / "eagle3", eagle3_config(), eagle3_tensors()),
            "medusa": write_head(root / "medusa", MEDUSA, medusa_tensors())}


def prompt_set() -> list[list[int]]:
    """Random prompts, and three sharing a 10-token prefix (two and a half blocks of 4)."""
    base = hf_models.prompts(8, seed=11, min_len=3, max_len=30)
    shared = base[2][:3] + base[3][:7]
    return base + [shared + [100, 101, 102] * 3, shared + [7] * 6, shared[:9] + [5]]


def generate(model: str, prompts: list[list[int]], params: SamplingParams, spec: dict | None = None,
             plugins: PluginManager | None = None, **engine: object) -> tuple[list[list[int]], LLM]:
    llm = LLM(model, skip_tokenizer_init=True, speculative_config=spec, plugins=plugins,
              **{"max_model_len": 256, "block_size": 8, "num_kv_blocks": 256, **engine})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    return {name: generate(hf_models.tiny(name).path, prompt_set(), GREEDY)[0] for name in ("qwen3", "llama")}


@pytest.mark.parametrize("target", ["qwen3", "llama"])
@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa"])
def test_greedy_is_identical(heads, reference, method: str, target: str) -> None:
    spec = {"method": method, "model": heads[method], "num_speculative_tokens": 3}
    tokens, llm = generate(hf_models.tiny(target).path, prompt_set(), GREEDY, spec, **STRESSED)
    assert tokens == reference[target]
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0 and m["spec_num_draft_tokens"] > 0


# --- the head's cache against the training code's dense drafting ------------------------------

def reference_drafts(hf_target, tensors: dict[str, torch.Tensor], config: dict, version: int, tokens: list[int],
                     k: int) -> list[int]:
    """Greedy drafts for ``tokens`` from scratch: the target's hidden states over all but the newest
    token, then ``k`` training-time-test steps of the training code's layer; only the last position's
    inputs change between steps (it is the only one the drafts read)."""
    eagle3 = version == 3
    h = config["hidden_size"]
    layer = train_heads.Layer(h, config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
                              eagle3, intermediate=config["intermediate_size"], eps=config["rms_norm_eps"],
                              theta=config["rope_theta"])
    layers = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    prefix = "midlayer." if eagle3 else "layers.0."
    layer.load_state_dict({n[len(prefix):]: t for n, t in tensors.items() if n.startswith(prefix)})
    fc = torch.nn.Linear(*tensors["fc.weight"].shape[::-1], bias=False)
    fc.weight.data.copy_(tensors["fc.weight"])
    last: list[torch.Tensor] = []  # the stream after the last layer, before the final norm
    hook = hf_target.model.layers[-1].register_forward_hook(
        lambda module, args, out: last.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = hf_target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        hook.remove()
        streams = list(out.hidden_states[:-1]) + last
        ids = torch.tensor([tokens[1:]])
        embed = hf_target.model.embed_tokens
        hidden = fc(torch.cat([streams[i] for i in layers], -1)) if eagle3 else out.hidden_states[-1]
        positions = torch.arange(len(tokens) - 1)
        cache: list = []
        drafts: list[int] = []
        for j in range(k):
            emb = embed(ids)
            if eagle3:
                hidden = layer(hidden, positions + j, cache, emb)
                norm = train_heads.RMSNorm(h, config["rms_norm_eps"])
                norm.weight.data.copy_(tensors["norm.weight"])
                draft = int(tensors["lm_head.weight"].matmul(norm(hidden[0, -1])).argmax())
                token = draft + int(tensors["d2t"][draft])
            else:
                hidden = layer(fc(torch.cat([emb, hidden], -1)), positions + j, cache)
                token = int(hf_target.lm_head(hidden[0, -1]).argmax())
            drafts.append(token)
            ids = ids.clone()
            ids[0, -1] = token
    return drafts


@pytest.mark.parametrize("method,skipping", [("eagle", False), ("eagle3", False), ("eagle3", True)])
def test_proposals_equal_dense_drafting(heads, reference, method: str, skipping: bool) -> None:
    """Rejections, preemption, chunked prefill and prefix-cache hits (one ending exactly at a block
    boundary, where the next token differs from the block owner's) never leave a stale entry; nor
    do runs of steps the proposer skips (``skipping``: a policy drafting in runs, the catch-up fed
    in forwards of at most 8 rows)."""
    from scripted_policy import Alternating

    target = hf_models.tiny("qwen3")
    version = 3 if method == "eagle3" else 1
    tensors = (eagle3_tensors if version == 3 else eagle_tensors)()
    config = eagle3_config() if version == 3 else HEAD
    checked = []
    base = Eagle3Proposer if version == 3 else EagleProposer

    class Checked(base):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if skipping:
                self.recorded.max_rows = 8

        def propose(self, inputs: ProposerInputs) -> DraftProposal:
            proposal = super().propose(inputs)
            for tokens, drafts in zip(inputs.token_ids, proposal.draft_token_ids):
                if drafts:
                    assert drafts == reference_drafts(target.hf, tensors, config, version, tokens.tolist(), len(drafts))
                    checked.append(len(drafts))
            return proposal

    class Plugin:
        @hookimpl
        def specloop_register_proposers(self, register) -> None:
            register("checked", Checked)

        @hookimpl
        def specloop_register_speculation_policies(self, register) -> None:
            register("runs", lambda config: Alternating(on=2, off=5))

    spec = {"method": "checked", "model": heads[method], "num_speculative_tokens": 3,
            "policy": "runs" if skipping else "fixed"}
    prompts = prompt_set()
    prompts += [prompts[-3][:8] + [9, 9, 9]]  # a hit of two whole blocks, then another token
    tokens, llm = generate(target.path, prompts, GREEDY, spec,
                           plugins=PluginManager([Plugin()], load_entrypoints=False), **STRESSED)
    assert tokens[:len(reference["qwen3"])] == reference["qwen3"]
    m = llm.get_metrics()
    assert len(checked) > (20 if skipping else 50) and m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    assert not skipping or llm.core.runner.drafter.proposer.recorded.skips > 10


# --- checkpoint layouts -----------------------------------------------------------------------

def context(target_name: str = "qwen3") -> ProposerContext:
    target = hf_models.tiny(target_name)
    cfg = read_model_config(target.path)
    return ProposerContext(device=torch.device("cpu"), dtype=torch.float32, model_config=cfg, vocab_size=cfg.vocab_size,
                           block_size=4, models=None, attention_backend=lambda: None, ops=TORCH_OPS,
                           embed_tokens=target.hf.model.embed_tokens, lm_head=target.hf.lm_head)


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_eagle_spellings_load_the_same_weights(tmp_path) -> None:
    ctx, t = context(), eagle_tensors()
    plain, cfg, _ = load_head(write_head(tmp_path / "a", HEAD, t), 1, ctx, torch.float32)
    assert cfg.num_layers == 1 and plain.fc.bias is None and plain.embedding_layernorm is None
    # A "model." prefix, and the copies of the target's embedding and head EAGLE checkpoints carry.
    extra = {"model." + k: v for k, v in t.items()}
    extra.update({"embed_tokens.weight": torch.zeros(V, H), "lm_head.weight": torch.zeros(V, H)})
    same, _, _ = load_head(write_head(tmp_path / "b", HEAD, extra), 1, ctx, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(params(plain).values(), params(same).values()))
    q = plain.layers[0].self_attn.qkv_proj.weight
    assert torch.equal(q[:64], t["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(q[96:], t["layers.0.self_attn.v_proj.weight"])
    # fc.bias (the EAGLE repository's default) and HASS's two input norms.
    hass = {**t, "fc.bias": torch.ones(H), "embedding_layernorm.weight": torch.ones(H),
            "hidden_states_layernorm.weight": torch.ones(H)}
    head, _, _ = load_head(write_head(tmp_path / "c", {**HEAD, "add_para_norm": True}, hass), 1, ctx, torch.float32)
    assert torch.equal(head.fc.bias, torch.ones(H)) and head.hidden_states_layernorm is not None


def test_eagle3_spellings_and_layer_ids(tmp_path) -> None:
    ctx, t = context(), eagle3_tensors()
    head, _, layers = load_head(write_head(tmp_path / "a", eagle3_config(), t), 3, ctx, torch.float32)
    assert layers == (1, 0, 2) and torch.equal(head.d2t, t["d2t"])
    logits = head.logits(torch.randn(2, H), TORCH_OPS)
    vocab = torch.arange(DRAFT_VOCAB) + t["d2t"]
    assert torch.isinf(logits).sum() == 2 * (V - DRAFT_VOCAB) and torch.isfinite(logits[:, vocab]).all()
    # vLLM's "layers.0." spelling, the layer ids at the top level, duplicated ids.
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in t.items()}
    config = eagle3_config(eagle_config=None, eagle_aux_hidden_state_layer_ids=[2, 0, 2])
    other, _, layers = load_head(write_head(tmp_path / "b", config, renamed), 3, ctx, torch.float32)
    assert layers == (2, 0, 2)
    assert all(torch.equal(a, b) for a, b in zip(params(head).values(), params(other).values()))
    # A full draft vocabulary needs no d2t.
    full = {k: v for k, v in t.items() if k not in ("d2t", "t2d")}
    full["lm_head.weight"] = torch.randn(V, H)
    head, _, _ = load_head(write_head(tmp_path / "c", eagle3_config(draft_vocab_size=V), full), 3, ctx, torch.float32)
    assert torch.equal(head.d2t, torch.zeros(V, dtype=torch.int64))


def test_medusa_spellings_load_the_same_weights(tmp_path) -> None:
    t = medusa_tensors()
    ref = load_medusa(write_head(tmp_path / "a", MEDUSA, t), H, V, torch.device("cpu"), torch.float32)
    prefixed = load_medusa(write_head(tmp_path / "b", MEDUSA, {"medusa_heads." + k: v for k, v in t.items()}), H, V,
                           torch.device("cpu"), torch.float32)
    # The Medusa repository's medusa_lm_head layout: {head}.{layer}.linear.*, {head}.{num_layers}.weight.
    original = {}
    for h in range(3):
        original[f"{h}.0.linear.weight"] = t[f"blocks.{h}.layers.0.weight"]
        original[f"{h}.0.linear.bias"] = t[f"blocks.{h}.layers.0.bias"]
        original[f"{h}.1.weight"] = t[f"lm_heads.{h}.weight"]
    repo = load_medusa(write_head(tmp_path / "c", {"hidden_size": H, "vocab_size": V, "medusa_num_heads": 3,
                                                   "medusa_num_layers": 1}, original), H, V, torch.device("cpu"),
                       torch.float32)
    x = torch.randn(5, H)
    expected = torch.stack([torch.nn.functional.linear(x + torch.nn.functional.silu(
        torch.nn.functional.linear(x, t[f"blocks.{h}.layers.0.weight"], t[f"blocks.{h}.layers.0.bias"])),
        t[f"lm_heads.{h}.weight"]) for h in range(3)])
    for heads in (ref, prefixed, repo):
        torch.testing.assert_close(heads(x), expected)
    # A token map with one shared original head, stored truncated or whole (vLLM slices it).
    token_map = torch.sort(torch.randperm(V)[:100]).values
    shared = {k: v for k, v in t.items() if not k.startswith("lm_heads.")}
    config = {**MEDUSA, "truncated_vocab_size": 100, "original_lm_head": True}
    for i, head in enumerate((t["lm_heads.0.weight"][token_map], t["lm_heads.0.weight"])):
        m = load_medusa(write_head(tmp_path / f"m{i}", config, {**shared, "lm_heads.0.weight": head,
                                                                "token_map": token_map}),
                        H, V, torch.device("cpu"), torch.float32)
        logits = m(x)
        assert torch.isinf(logits).sum() == 3 * 5 * (V - 100)
        torch.testing.assert_close(logits[0][:, token_map], expected[0][:, token_map])


@pytest.mark.parametrize("method, change, message", [
    ("eagle", lambda c, t: t.pop("layers.0.mlp.down_proj.weight"), "lacks 1 tensor.*layers.0.mlp.down_proj.weight"),
    ("eagle", lambda c, t: t.update({"fc.weight": torch.zeros(H, 3 * H)}),
     "'fc.weight' has shape \\(64, 192\\), expected \\(64, 128\\)"),
    ("eagle", lambda c, t: t.update({"layers.0.input_layernorm.weight": torch.ones(H)}), "unexpected.*input_layernorm"),
    ("eagle", lambda c, t: c.update({"hidden_size": 32}), "hidden_size \\(32\\) differs from the target's \\(64\\)"),
    ("eagle", lambda c, t: c.pop("intermediate_size"), "lacks required field 'intermediate_size'"),
    ("eagle3", lambda c, t: t.pop("midlayer.hidden_norm.weight"), "lacks 1 tensor.*midlayer.hidden_norm.weight"),
    ("eagle3", lambda c, t: t.update({"midlayer.self_attn.q_proj.weight": torch.zeros(64, H)}),
     "'midlayer.self_attn.q_proj.weight' has shape \\(64, 64\\), expected \\(64, 128\\)"),
    ("eagle3", lambda c, t: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [0, 1]}),
     "'fc.weight' has shape \\(64, 192\\), expected \\(64, 128\\)"),
    ("eagle3", lambda c, t: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [0, 1, 5]}),
     "outside the target's 0..2"),
    ("eagle3", lambda c, t: t.update({"d2t": t["d2t"] + V}), "d2t maps draft ids outside"),
    ("eagle3", lambda c, t: c.update({"vocab_size": 1000}), "vocabulary \\(1000\\) differs"),
    ("medusa", lambda c, t: t.pop("blocks.1.layers.0.bias"), "lacks 1 tensor.*blocks.1.layers.0.bias"),
    ("medusa", lambda c, t: t.update({"lm_heads.2.weight": torch.zeros(V, 32)}), "'lm_heads.2.weight' has shape"),
    ("medusa", lambda c, t: c.update({"truncated_vocab_size": 100}), "lacks 1 tensor.*token_map"),
])
def test_malformed_checkpoints_name_the_tensor(tmp_path, heads, method: str, change, message: str) -> None:
    config = {"eagle": dict(HEAD), "medusa": dict(MEDUSA),
              "eagle3": eagle3_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 0, 2]})}[method]
    tensors = {"eagle": eagle_tensors, "eagle3": eagle3_tensors, "medusa": medusa_tensors}[method]()
    change(config, tensors)
    path = write_head(tmp_path / method, config, tensors)
    with pytest.raises(ModelLoadError, match=message):
        if method == "medusa":
            load_medusa(path, H, V, torch.device("cpu"), torch.float32)
        else:
            load_head(path, 3 if method == "eagle3" else 1, context(), torch.float32)


def test_default_eagle3_layers_are_low_middle_high(tmp_path) -> None:
    """Without layer ids in the config: 2, L // 2 and L - 3, which a 2-layer target does not have."""
    config = eagle3_config(eagle_config=None)
    with pytest.raises(ModelLoadError, match=r"\[2, 1, -1\] name layers outside the target's 0..2"):
        load_head(write_head(tmp_path / "h", config, eagle3_tensors()), 3, context(), torch.float32)


def test_methods_need_a_head(heads) -> None:
    target = hf_models.tiny("qwen3").path
    for method in ("eagle", "eagle3", "medusa"):
        with pytest.raises(ValueError, match="needs 'model'"):
            LLM(target, skip_tokenizer_init=True, speculative_config={"method": method, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="no config.json"):
        LLM(target, skip_tokenizer_init=True, speculative_config={
            "method": "eagle", "model": os.path.dirname(heads["eagle"]), "num_speculative_tokens": 2})
