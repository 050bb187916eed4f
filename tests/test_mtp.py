"""The MTP proposer on the shipped DeepSeek-V3 model (``specloop-tiny-mtp``, trained with one MTP layer).

Oracles: the MTP layer's logits equal a reference assembled here from transformers' DeepSeek-V3
modules; greedy output with MTP drafts is identical to output without them (K = 1, 2, 3, under
chunked prefill, prefix-cache hits and preemption); with K = 1 every request's draft and acceptance
counts are exactly what that reference predicts from its final sequence (so the layer's own latent
cache is right after every rejection, chunk and prefix hit); sampled output follows the target's
distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from specloop import LLM, SamplingParams
from specloop.kernel.config import EngineConfig
from specloop.kernel.plugins import PluginManager
from specloop.kernel.request import Request
from specloop.models.attention import AttentionMetadata, TorchAttentionBackend
from specloop.models.context import ForwardContext
from specloop.models.deepseek_mtp import DeepSeekMTP
from specloop.models.loader import build_empty, iter_safetensors, safetensors_files
from specloop.plugins.kv_cache import PagedKVCache
from specloop.proposers.mtp import MTPProposer

MTP = str(Path(__file__).resolve().parent.parent / "default_models" / "specloop-tiny-mtp")
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef main():",
           "def literal_eval(node_or_string):", "def format_string(f, val, grouping=False, monetary=False):"]
# Chunked prefill (16 tokens a step), prefix caching over a shared prompt start, and a pool too small
# for every request: preemptions.
STRESSED = dict(max_model_len=96, block_size=4, num_kv_blocks=30, max_num_batched_tokens=16, max_num_seqs=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


class ReferenceMTP(nn.Module):
    """Seed-style MTP layer from transformers' modules: enorm/hnorm/eh_proj, the DeepSeek-V3
    decoder block, shared_head.norm; the main model's embedding and head."""

    def __init__(self, lm: Any) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        cfg = lm.config
        h, eps, n = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_hidden_layers
        self.lm = lm
        self.enorm, self.hnorm, self.norm = (DeepseekV3RMSNorm(h, eps) for _ in range(3))
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(cfg, layer_idx=n)
        prefix = f"model.layers.{n}."
        sd = {k.removeprefix(prefix): v.float() for k, v in load_file(f"{MTP}/model.safetensors").items()
              if k.startswith(prefix)}
        experts = range(cfg.n_routed_experts)
        block = {k: v for k, v in sd.items() if k.startswith(("self_attn.", "mlp.", "input_", "post_"))
                 and ".experts." not in k}
        block["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"mlp.experts.{e}.gate_proj.weight"], sd[f"mlp.experts.{e}.up_proj.weight"]]) for e in experts])
        block["mlp.experts.down_proj"] = torch.stack([sd[f"mlp.experts.{e}.down_proj.weight"] for e in experts])
        self.block.load_state_dict(block, strict=True)
        self.enorm.weight.data, self.hnorm.weight.data = sd["enorm.weight"], sd["hnorm.weight"]
        self.eh_proj.weight.data, self.norm.weight.data = sd["eh_proj.weight"], sd["shared_head.norm.weight"]

    @torch.no_grad()
    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Row p: the MTP layer's logits for token p + 2, from token p + 1 and the main model's final
        hidden state at p (positions 0 .. len - 2)."""
        ids = torch.tensor([tokens])
        hidden = self.lm.model(input_ids=ids[:, :-1]).last_hidden_state
        n = hidden.shape[1]
        positions = torch.arange(n)[None]
        embeds = self.lm.model.embed_tokens(ids[:, 1:]).masked_fill((positions == 0)[..., None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = self.block(x, attention_mask=causal, position_ids=positions,
                       position_embeddings=self.lm.model.rotary_emb(x, positions))
        return self.lm.lm_head(self.norm(x))[0]


@pytest.fixture(scope="module")
def reference() -> ReferenceMTP:
    from transformers import AutoModelForCausalLM

    return ReferenceMTP(AutoModelForCausalLM.from_pretrained(MTP, dtype=torch.float32).eval()).eval()


def token_prompts() -> list[list[int]]:
    from specloop.frontend.tokenizer import Tokenizer

    tok = Tokenizer(MTP)
    shared = tok.encode('"""Helpers for reading and writing files."""\nimport sys\nimport os\n\n\n', add_special_tokens=False)
    shared = shared[:len(shared) // 4 * 4]  # whole blocks: prompts part exactly at a block boundary
    return [(shared if i % 2 else []) + tok.encode(p, add_special_tokens=False) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def plain_outputs() -> list[list[int]]:
    llm = LLM(MTP, skip_tokenizer_init=True, max_model_len=192)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in token_prompts()], GREEDY,
                                                          use_tqdm=False)]


def layer_over(reference: ReferenceMTP, prompt: int, extra: int, seed: int) -> tuple[Any, list[int], torch.Tensor]:
    """Our MTP layer loaded from specloop-tiny-mtp, a prompt with ``extra`` random tokens after it,
    and the main model's final hidden states over it (transformers')."""
    tokens = token_prompts()[prompt] + [int(t) for t in torch.randint(3, 8192, (extra,),
                                                                         generator=torch.Generator().manual_seed(seed))]
    hidden = reference.lm.model(input_ids=torch.tensor([tokens[:-1]])).last_hidden_state[0]
    mtp = build_empty(lambda: DeepSeekMTP(reference.lm.config.to_dict()), torch.device("cpu"), torch.float32)
    mtp.load_weights(iter_safetensors(safetensors_files(MTP), torch.device("cpu")))
    return mtp, tokens, hidden


def one_sequence(mtp: Any, n: int, block: int = 4) -> tuple[TorchAttentionBackend, AttentionMetadata, torch.Tensor]:
    """Attention over one sequence of ``n`` positions in blocks 0, 1, ...: backend, metadata, an empty cache."""
    backend = TorchAttentionBackend()
    meta = AttentionMetadata.build([0, n], [n], range(n), [list(range(-(-n // block)))], torch.device("cpu"))
    return backend, meta, torch.zeros(mtp.config.kv_cache_shape(backend, -(-n // block), block))


def test_mtp_layer_logits_match_the_transformers_reference(reference: ReferenceMTP) -> None:
    mtp, tokens, hf_hidden = layer_over(reference, 1, 30, 0)
    n = len(tokens) - 1
    backend, meta, cache = one_sequence(mtp, n)
    with torch.inference_mode():
        out = mtp(reference.lm.model.embed_tokens(torch.tensor(tokens[1:])), torch.arange(n), hf_hidden,
                  ForwardContext(backend, meta, [cache]))
        ours = reference.lm.lm_head(mtp.logits_input(out, ForwardContext(backend, meta, [cache]).ops))
    torch.testing.assert_close(ours, reference.logits(tokens), atol=1e-4, rtol=0)


def test_a_feed_runs_the_experts_for_the_rows_it_keeps_alone(reference: ReferenceMTP) -> None:
    # A proposal feeds a request's verified rows for their cache entries and reads the output of
    # the newest alone: asked for some rows, the layer writes every row's latent entry as the whole
    # feed does, gives those rows' outputs as the whole feed gives them, and its experts see only them.
    mtp, tokens, hidden = layer_over(reference, 0, 12, 1)
    n = len(tokens) - 1
    seen: list[int] = []
    mtp.layers[0].block.mlp.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    embeds = reference.lm.model.embed_tokens(torch.tensor(tokens[1:]))
    runs = {}
    for rows in (None, torch.tensor([2, n - 1])):
        backend, meta, cache = one_sequence(mtp, n)
        with torch.inference_mode():
            runs[rows is None] = mtp(embeds, torch.arange(n), hidden, ForwardContext(backend, meta, [cache]), rows=rows), cache
    (whole, whole_cache), (kept, kept_cache) = runs[True], runs[False]
    assert seen == [n, 2]
    assert kept.shape == (2, whole.shape[1])
    torch.testing.assert_close(kept, whole[[2, n - 1]], atol=1e-5, rtol=0)
    assert torch.equal(kept_cache, whole_cache)


@pytest.mark.parametrize("method, k", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("deepseek_mtp", 1)])  # the alias once
def test_greedy_is_identical_and_drafts_are_accepted(plain_outputs, k: int, method: str) -> None:
    llm = LLM(MTP, skip_tokenizer_init=True, speculative_config={"method": method, "num_speculative_tokens": k},
              **STRESSED)
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts()], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain_outputs
    m = llm.get_metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    per_position = [a / m["spec_num_drafts"] for a in m["spec_num_accepted_tokens_per_pos"]]
    print(f"K={k}: acceptance {m['spec_acceptance_rate']:.3f}, per position {[round(a, 3) for a in per_position]}")
    assert m["spec_acceptance_rate"] > {1: 0.5, 2: 0.4, 3: 0.3}[k]  # 0.78 / 0.67 / 0.53 measured


def predicted_counts(reference: ReferenceMTP, sequence: list[int], prompt_len: int, max_tokens: int,
                     token_map: torch.Tensor | None = None) -> tuple[int, int]:
    """(drafts, accepted) of a K = 1 greedy run ending in ``sequence``: after every step that leaves
    room, the layer at the newest verified position L - 2 drafts its argmax for token L (over the
    token map's ids, with one)."""
    logits = reference.logits(sequence)
    if token_map is not None:
        logits = torch.full_like(logits, float("-inf")).index_copy_(1, token_map, logits[:, token_map])
    pred = logits.argmax(-1).tolist()  # pred[p] is the draft for token p + 2
    length, drafts, accepted = prompt_len + 1, 0, 0
    while length - prompt_len < max_tokens:
        if max_tokens - (length - prompt_len) - 1 >= 1:
            drafts += 1
            if pred[length - 2] == sequence[length]:
                accepted += 1
                length += 1
        length += 1
    return drafts, accepted


def half_the_vocabulary(tmp_path: Path) -> tuple[str, torch.Tensor]:
    """A token map of a random half of the vocabulary (a saved tensor, unsorted, one id twice)."""
    ids = torch.randperm(8192, generator=torch.Generator().manual_seed(3))[:4096]
    path = str(tmp_path / "half.pt")
    torch.save(torch.cat([ids, ids[:1]]), path)
    return path, ids.sort().values


@pytest.mark.parametrize("mapped", [False, True], ids=["whole vocabulary", "token map"])
def test_k1_counts_and_logits_equal_what_the_reference_predicts(reference: ReferenceMTP, plain_outputs,
                                                                monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                mapped: bool) -> None:
    """Chunked prefill and prefix hits at a block boundary (no preemption: a preempted request's
    pending draft is dropped, which the prediction does not model). Every draft's logits must be
    the reference's at that position of the final sequence, so a stale row anywhere in the layer's
    cache (a rejected draft, a shared prefix block) fails even where it does not flip a draft. With
    a token map, the drafts are the reference's argmax over the map's tokens, and every logit
    outside it is -inf."""
    drafted: list[tuple[list[int], torch.Tensor]] = []  # (verified tokens, draft logits)
    propose = MTPProposer.propose

    def recording_propose(self: MTPProposer, inputs: Any) -> Any:
        logits, argmax, rows = self.head.logits, self.head.argmax, []

        def recorded_argmax(h: torch.Tensor, ops: Any) -> torch.Tensor:  # greedy drafts: the same rows' logits
            rows.append(logits(h))
            return argmax(h, ops)

        self.head.logits = lambda h: rows.append(logits(h)) or rows[-1]
        self.head.argmax = recorded_argmax
        try:
            proposal = propose(self, inputs)
        finally:
            del self.head.logits, self.head.argmax
        live = [i for i, d in enumerate(proposal.draft_token_ids) if d]
        drafted.extend((inputs.token_ids[i].tolist(), rows[0][k]) for k, i in enumerate(live))
        return proposal

    monkeypatch.setattr(MTPProposer, "propose", recording_propose)
    path, token_map = half_the_vocabulary(tmp_path) if mapped else (None, None)
    prompts = token_prompts()
    llm = LLM(MTP, skip_tokenizer_init=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1, "token_map": path},
              max_model_len=192, block_size=4, max_num_batched_tokens=24, max_num_seqs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert llm.get_metrics()["prefix_cache_hits"] > 0
    finals = [p + list(want) for p, want in zip(prompts, plain_outputs)]
    for prompt, out, final in zip(prompts, outs, finals):
        assert prompt + list(out.outputs[0].token_ids) == final
        drafts, accepted = predicted_counts(reference, final, len(prompt), GREEDY.max_tokens, token_map)
        assert (out.metrics.spec_num_draft_tokens, out.metrics.spec_num_accepted_tokens) == (drafts, accepted)
    references = [reference.logits(f) for f in finals]
    outside = torch.zeros(8192, dtype=torch.bool)
    if mapped:
        outside[:] = True
        outside[token_map] = False
    for tokens, logits in drafted:
        k = next(j for j, f in enumerate(finals) if f[:len(tokens)] == tokens)
        torch.testing.assert_close(logits.float()[~outside], references[k][len(tokens) - 2][~outside], atol=1e-3,
                                   rtol=0)
        assert bool(torch.isneginf(logits[outside]).all())
    assert len(drafted) == sum(o.metrics.spec_num_draft_tokens for o in outs)
    if mapped:  # the map's misses cost drafts: fewer accepted than over the whole vocabulary
        whole = sum(predicted_counts(reference, f, len(p), GREEDY.max_tokens)[1] for p, f in zip(prompts, finals))
        assert sum(o.metrics.spec_num_accepted_tokens for o in outs) < whole


@pytest.mark.parametrize("mapped", [False, True], ids=["whole vocabulary", "token map"])
def test_sampled_output_follows_the_target_distribution(reference: ReferenceMTP, tmp_path: Path, mapped: bool) -> None:
    """Token 2 of every request comes out of verifying an MTP draft sampled at temperature 1; among
    the requests whose token 1 is the most frequent one, its distribution must be the target's,
    also when the drafts come from half the vocabulary only (a token map)."""
    prompt = token_prompts()[0]
    n = 1500
    path = half_the_vocabulary(tmp_path)[0] if mapped else None
    llm = LLM(MTP, skip_tokenizer_init=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1, "token_map": path},
              max_model_len=64, max_num_seqs=256)
    outs = llm.generate([{"prompt_token_ids": prompt}] * n,
                        [SamplingParams(temperature=1.0, max_tokens=3, seed=i, ignore_eos=True) for i in range(n)],
                        use_tqdm=False)
    assert llm.get_metrics()["spec_num_draft_tokens"] == n
    firsts = [o.outputs[0].token_ids[0] for o in outs]
    mode = max(set(firsts), key=firsts.count)
    seconds = torch.tensor([o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == mode])
    with torch.no_grad():
        p = reference.lm(torch.tensor([prompt + [mode]])).logits[0, -1].softmax(-1)
    empirical = torch.bincount(seconds, minlength=p.numel()).float() / len(seconds)
    tv = 0.5 * float((empirical - p).abs().sum())
    noise = 0.5 * float((2 * p * (1 - p) / (torch.pi * len(seconds))).sqrt().sum())  # E[TV] of exact sampling
    assert len(seconds) > 300 and tv < 2 * noise + 0.01, (tv, noise, len(seconds))


def test_prefix_hits_leave_the_last_block_to_recompute() -> None:
    """The layer's cache row at a hit's last position depends on the token after it, which is this
    request's, not the block owner's: that block is recomputed, for MTP (which records the target's
    states) as for a proposer fed each chunk's states (``runs_on_prefill_chunks``)."""
    def hit(method: str | None, per_chunk: bool | None = None) -> int:
        spec = {"method": method, "num_speculative_tokens": 1} if method else None
        config = EngineConfig(model=MTP, block_size=4, speculative_config=spec)
        if method:  # resolved by the runner from its proposer, before the cache is built
            proposer = PluginManager(load_entrypoints=False).proposers.get(method)
            config.speculative_config.reads_target_hidden_states = (
                proposer.runs_on_prefill_chunks or proposer.records_hidden_states if per_chunk is None else per_chunk)
        cache = PagedKVCache(config, 16)
        first = Request("a", list(range(20)), SamplingParams())
        cache.allocate_slots(first, 20)
        cache.cache_blocks(first, 20)
        return cache.get_computed_blocks(Request("b", list(range(20)) + [7], SamplingParams()))[1]

    assert (hit(None), hit("ngram"), hit("mtp"), hit("deepseek_mtp")) == (20, 20, 16, 16)
    assert hit("ngram", per_chunk=True) == 16


def test_mtp_needs_a_checkpoint_with_mtp_layers(tmp_path) -> None:
    import hf_models

    with pytest.raises(ValueError, match="no MTP layers specloop can run"):
        LLM(hf_models.tiny("qwen3").path, skip_tokenizer_init=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_several_mtp_layers_draft_in_turn(tmp_path) -> None:
    """A checkpoint with two MTP layers (random ones, after a tiny random DeepSeek-V3): draft k uses
    layer (k - 1) mod 2, each layer keeps its own cache, and greedy output is unchanged."""
    import json
    import shutil

    import hf_models
    from safetensors.torch import save_file

    src = hf_models.tiny("deepseek_v3")
    path = str(tmp_path / "two_mtp")
    shutil.copytree(src.path, path)
    weights = load_file(f"{path}/model.safetensors")
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    for j in range(2):
        layer = f"model.layers.{n + j}."
        weights.update({layer + k.removeprefix(f"model.layers.{n - 1}."): v.clone()
                        for k, v in weights.items() if k.startswith(f"model.layers.{n - 1}.")})
        weights[layer + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * 0.1
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            weights[layer + norm + ".weight"] = torch.ones(hidden)
    save_file(weights, f"{path}/model.safetensors")
    with open(f"{path}/config.json", "w") as f:
        json.dump({**config, "num_nextn_predict_layers": 2}, f)
    token_prompts = hf_models.prompts(4, seed=41, min_len=5, max_len=20)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [src.greedy(p, 12) for p in token_prompts]
    llm = LLM(path, skip_tokenizer_init=True, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
              max_model_len=64, block_size=4)
    assert len(llm.core.runner.drafter.proposer.kv_caches) == 2
    outs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.get_metrics()["spec_num_draft_tokens"] > 0
