"""The shipped default models (``default_models/``): files, tokenizer, loading by transformers, the
DeepSeek-V3 MTP layer, greedy generation identical to transformers (the DeepSeek-V3 one too), and
the draft model's acceptance (the MTP layer's: ``test_mtp.py``)."""

from __future__ import annotations

import fnmatch
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from specloop import LLM, SamplingParams
from specloop.cli import main as cli_main
from specloop.frontend.model_path import resolve_model
from specloop.frontend.tokenizer import Tokenizer as SpecloopTokenizer

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "default_models"
TARGET, DRAFT, MTP = "specloop-tiny", "specloop-tiny-draft", "specloop-tiny-mtp"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
# Beginnings of functions from standard-library modules held out of training (wsgiref/util.py,
# ast.py, locale.py, plistlib.py), and two of our own.
PROMPTS = [
    "def guess_scheme(environ):\n"
    "    \"\"\"Return a guess for whether 'wsgi.url_scheme' should be 'http' or 'https'\n    \"\"\"",
    "def literal_eval(node_or_string):",
    "def format_string(f, val, grouping=False, monetary=False):",
    "def dumps(value, *, fmt=FMT_XML, skipkeys=False, sort_keys=True):",
    "def fibonacci(n):",
    "class Stack:",
]
# Written for this test, so in no training module.
SNIPPET = '''import os


def count_lines(path):
    """Return the number of lines in the file at path."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f)


class Counter:
    """Count how often each key was added."""

    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
        return self.counts[key]

    def most_common(self, n=None):
        items = sorted(self.counts.items(), key=lambda item: item[1], reverse=True)
        if n is not None:
            items = items[:n]
        return items
'''


def hf_model(name: str) -> Any:
    return AutoModelForCausalLM.from_pretrained(SHIPPED / name, dtype=torch.float32).eval()


def snippet_ids() -> torch.Tensor:
    return torch.tensor([Tokenizer.from_file(str(SHIPPED / TARGET / "tokenizer.json")).encode(SNIPPET).ids])


def test_shipped_files_are_package_data_and_within_budget() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["specloop.default_models"]
    shipped = [p.relative_to(SHIPPED).as_posix() for p in SHIPPED.rglob("*") if p.is_file()
               and "__pycache__" not in p.parts and p.suffix != ".py"]
    assert {f"{m}/{f}" for m in (TARGET, DRAFT, MTP) for f in FILES} <= set(shipped)
    assert [p for p in shipped if not any(fnmatch.fnmatch(p, g) for g in globs)] == []
    assert sum((SHIPPED / m / "model.safetensors").stat().st_size for m in (TARGET, DRAFT, MTP)) <= 40e6
    for m in (TARGET, DRAFT, MTP):
        with safe_open(str(SHIPPED / m / "model.safetensors"), "pt") as f:
            for key in f.keys():
                want = "F32" if key.endswith("e_score_correction_bias") else "BF16"  # as DeepSeek-V3 ships it
                assert f.get_slice(key).get_dtype() == want, key
    tokenizers = {(SHIPPED / m / "tokenizer.json").read_bytes() for m in (TARGET, DRAFT, MTP)}
    assert len(tokenizers) == 1  # one tokenizer for the family: the draft proposes target token ids


def test_tokenizer_special_tokens_chat_template_and_eos() -> None:
    tok = SpecloopTokenizer(str(SHIPPED / TARGET))
    assert [tok.encode(t, add_special_tokens=False) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] \
        == [[0], [1], [2]]
    assert tok.eos_token_ids == (0, 2)
    assert tok.bos_token_id is None
    text = tok.apply_chat_template([{"role": "user", "content": "Write a loop."}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nWrite a loop.<|im_end|>\n<|im_start|>assistant\n"
    hf = AutoTokenizer.from_pretrained(SHIPPED / TARGET)
    assert len(hf) == 8192
    ids = hf(SNIPPET)["input_ids"]
    assert ids == tok.encode(SNIPPET, add_special_tokens=False)
    assert hf.decode(ids) == SNIPPET
    assert len(SNIPPET) / len(ids) > 3  # BPE learned Python: well over 3 characters a token


@pytest.mark.parametrize("name, low, high", [(TARGET, 8e6, 15e6), (DRAFT, 1e6, 3e6)])
def test_transformers_loads_qwen3_models(name: str, low: float, high: float) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(SHIPPED / name, dtype=torch.float32, output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.tie_word_embeddings and model.config.vocab_size == 8192
    assert low <= sum(p.numel() for p in model.parameters()) <= high


def test_transformers_loads_deepseek_v3_and_the_mtp_layer_is_stored_as_deepseek_does() -> None:
    model, info = AutoModelForCausalLM.from_pretrained(SHIPPED / MTP, dtype=torch.float32, output_loading_info=True)
    cfg = model.config
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert json.loads((SHIPPED / MTP / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert cfg.q_lora_rank and cfg.kv_lora_rank and cfg.n_shared_experts == 1 and cfg.n_routed_experts > 1
    n = cfg.num_hidden_layers
    layer = f"model.layers.{n}."
    assert not info["missing_keys"]
    assert info["unexpected_keys"] and all(k.startswith(layer) for k in info["unexpected_keys"])
    with safe_open(str(SHIPPED / MTP / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                     "post_attention_layernorm.weight", "self_attn.kv_a_proj_with_mqa.weight",
                     "self_attn.q_a_proj.weight", "self_attn.o_proj.weight", "mlp.gate.weight",
                     "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
                     *(f"mlp.experts.{e}.{p}_proj.weight" for e in range(cfg.n_routed_experts)
                       for p in ("gate", "up", "down"))):
            assert layer + name in keys, name
        assert f.get_slice(layer + "eh_proj.weight").get_shape() == [cfg.hidden_size, 2 * cfg.hidden_size]
        # The head and embedding are the main model's, written again under the MTP layer.
        assert torch.equal(f.get_tensor(layer + "shared_head.head.weight"), f.get_tensor("lm_head.weight"))
        assert torch.equal(f.get_tensor(layer + "embed_tokens.weight"), f.get_tensor("model.embed_tokens.weight"))
        assert not any(k.startswith(f"model.layers.{n + 1}.") for k in keys)


def test_trained_models_predict_unseen_python() -> None:
    ids = snippet_ids()
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        for name, floor in ((TARGET, 0.45), (DRAFT, 0.4), (MTP, 0.35)):
            logits = hf_model(name)(input_ids=x).logits
            assert (logits.argmax(-1) == y).float().mean() > floor, name  # chance: 1 in 8192


def test_mtp_layer_predicts_the_token_after_next() -> None:
    """Seed 000's MTP forward over the shipped layer: token t+1's embedding (zero at position 0) and
    the main model's final hidden state at t predict token t+2."""
    sys.path.insert(0, str(ROOT / "tools"))
    from train_default_models import load_mtp_layer, mtp_logits

    lm = hf_model(MTP)
    mtp = load_mtp_layer(SHIPPED / MTP, lm)
    ids = snippet_ids()
    x, y = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        hidden = lm.model(input_ids=x).last_hidden_state
        logits = mtp_logits(lm, mtp, y[:, :-1], hidden[:, :-1])
    accuracy = float((logits.argmax(-1) == y[:, 1:]).float().mean())
    assert accuracy > 0.35  # 0.53 measured; a mis-assembled layer scores ~0


def hf_greedy(model: Any, prompt_ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=[0, 2],
                         pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("name", [TARGET, DRAFT, MTP])
def test_greedy_continuations_match_transformers(name: str) -> None:
    tok = SpecloopTokenizer(str(SHIPPED / name))
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    llm = LLM(str(SHIPPED / name), dtype="float32", max_model_len=256, max_num_seqs=len(PROMPTS))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(temperature=0.0, max_tokens=32),
                        use_tqdm=False)
    model = hf_model(name)
    for p, out in zip(prompt_ids, outs):
        assert list(out.outputs[0].token_ids) == hf_greedy(model, p, 32)


def test_draft_model_keeps_greedy_output_and_is_accepted() -> None:
    spec = {"method": "draft_model", "model": str(SHIPPED / DRAFT), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [{"prompt": p} for p in PROMPTS]
    plain = LLM(str(SHIPPED / TARGET), max_model_len=256).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(SHIPPED / TARGET), max_model_len=256, speculative_config=spec)
    spec_outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec_outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["spec_acceptance_rate"] > 0.3


def test_generate_with_no_model_uses_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert os.path.samefile(resolve_model(None), SHIPPED / TARGET)
    assert cli_main(["generate", "def fibonacci(n):", "--max-tokens", "24"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def fibonacci(n):\n    ")  # the prompt, then an indented function body
