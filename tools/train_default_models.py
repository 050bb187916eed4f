"""Train specloop's default model family on the Python standard library.

Three steps, each reproducible from a seed:

    python tools/train_default_models.py prepare --data .train          # CPU: corpus, tokenizer, token ids
    python tools/train_default_models.py train --data .train --out OUT  # GPU (or CPU with --smoke)
    python tools/train_default_models.py report --data .train           # CPU: held-out metrics, samples

``prepare`` reads the ``*.py`` files of the running interpreter's standard library, splits them into
training and held-out modules by a hash of their path, trains a byte-level BPE tokenizer on the
training modules and writes the token ids as ``.npy``. ``train`` trains every recipe in
:data:`RECIPES` (one subprocess each with ``--parallel``) and writes Hugging Face model directories.
``report`` measures the shipped directories in float32 on the CPU.

A recipe says what to train: how to build the module, its loss, what to do after each optimizer step
and how to write the checkpoint. The speculative heads for the target (``specloop-tiny-eagle``,
``-eagle3``, ``-medusa``; modules in ``train_heads.py``) are recipes that load the shipped
``specloop-tiny`` in ``build`` and freeze it; only the head trains. Everything runs on ``--device``
(default: CUDA when present); the heads as shipped (one H200, 8 minutes):

    python tools/train_default_models.py train --data .train --out out/heads --device cuda --parallel \
        --only specloop-tiny-eagle,specloop-tiny-eagle3,specloop-tiny-medusa --seed 0 \
        --budget-s 400 --max-seconds 445
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import train_heads

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID, IM_END_ID = 0, 2  # <|im_start|> is 1
VOCAB_SIZE = 8192
SEQ_LEN = 1024
HELDOUT_PERCENT = 5
MAX_FILE_BYTES = 512 * 1024
MTP_LOSS_WEIGHT = 0.3  # DeepSeek-V3's lambda for the first 10T tokens
EXPERT_BIAS_RATE = 1e-3  # DeepSeek-V3's gamma for auxiliary-loss-free balancing
# The Hermes / Qwen tool-calling convention: tools listed in a system turn, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in a user turn's <tool_response>.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if tools and loop.first and message['role'] == 'system' %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] %}"
    "{{ '\\n<tool_call>\\n{\\\"name\\\": \\\"' + f['name'] + '\\\", \\\"arguments\\\": ' + "
    "(f['arguments'] if f['arguments'] is string else (f['arguments'] | tojson)) + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Beginnings of functions from held-out modules (source in the comment), and two of our own.
SAMPLE_PROMPTS = (
    "def guess_scheme(environ):\n"  # wsgiref/util.py
    "    \"\"\"Return a guess for whether 'wsgi.url_scheme' should be 'http' or 'https'\n    \"\"\"",
    "def literal_eval(node_or_string):",  # ast.py
    "def format_string(f, val, grouping=False, monetary=False):",  # locale.py
    "def dumps(value, *, fmt=FMT_XML, skipkeys=False, sort_keys=True):",  # plistlib.py
    "def fibonacci(n):",
    "class Stack:",
)
REPO = Path(__file__).resolve().parent.parent
SHIPPED = REPO / "default_models"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def outside_corpus(parts: tuple[str, ...]) -> bool:
    """Paths below the stdlib directory that are not the standard library."""
    return parts[0] == "site-packages" or "__pycache__" in parts


def is_heldout(relpath: str) -> bool:
    """Whether the module at ``relpath`` (relative to the stdlib directory, ``/``-separated) is one of
    the held-out ~5%, chosen by the path alone so the split never depends on file order; a path
    outside the corpus (``site-packages/``) never is."""
    if outside_corpus(tuple(relpath.split("/"))):
        return False
    return int(hashlib.sha256(relpath.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def corpus_files(root: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """(relative path, text) for every ``*.py`` under ``root`` except ``site-packages/`` and
    ``__pycache__/``; files that are not UTF-8 (deliberately mis-encoded test fixtures) or larger
    than ``MAX_FILE_BYTES`` (``pydoc_data/topics.py``, one generated string table) are skipped and
    returned as the second list."""
    kept, skipped = [], []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if outside_corpus(parts):
            continue
        rel = "/".join(parts)
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
            continue
        if len(data) > MAX_FILE_BYTES:
            skipped.append(rel)
            continue
        kept.append((rel, text))
    return kept, skipped


def train_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_files(tok_json: Path, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json (ChatML-style template) and generation_config.json."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tok_json, out / "tokenizer.json")
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[EOS_ID],
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": SEQ_LEN,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"eos_token_id": [EOS_ID, IM_END_ID], "pad_token_id": EOS_ID}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def prepare(data: Path) -> None:
    from tokenizers import Tokenizer

    root = stdlib_dir()
    files, skipped = corpus_files(root)
    train = [(r, t) for r, t in files if not is_heldout(r)]
    held = [(r, t) for r, t in files if is_heldout(r)]
    data.mkdir(parents=True, exist_ok=True)
    train_tokenizer([t for _, t in train]).save(str(data / "tokenizer.json"))
    write_tokenizer_files(data / "tokenizer.json", data / "tokenizer")
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    manifest = {"python": sys.version.split()[0], "stdlib": str(root), "skipped": skipped,
                "vocab_size": tok.get_vocab_size(), "files": []}
    for name, part in (("train", train), ("heldout", held)):
        ids = tok.encode_batch([t for _, t in part], add_special_tokens=False)
        stream: list[int] = []
        for (rel, text), enc in zip(part, ids):
            stream.extend(enc.ids)
            stream.append(EOS_ID)  # one document per module
            manifest["files"].append({"path": rel, "split": name, "bytes": len(text.encode()),
                                      "tokens": len(enc.ids),
                                      "sha256": hashlib.sha256(text.encode()).hexdigest()})
        np.save(data / f"{name}.npy", np.asarray(stream, dtype=np.uint16))
        manifest[f"{name}_tokens"] = len(stream)
    (data / "corpus.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"python {manifest['python']}: {len(train)} train / {len(held)} held-out modules, "
          f"{manifest['train_tokens']} / {manifest['heldout_tokens']} tokens, skipped {skipped}")


def target_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=320, intermediate_size=896, num_hidden_layers=6,
                       num_attention_heads=5, num_key_value_heads=1, head_dim=64,
                       max_position_embeddings=SEQ_LEN, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
                       pad_token_id=None, dtype="bfloat16", architectures=["Qwen3ForCausalLM"])


def draft_config():
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=3, num_key_value_heads=1, head_dim=64,
                       max_position_embeddings=SEQ_LEN, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
                       pad_token_id=None, dtype="bfloat16", architectures=["Qwen3ForCausalLM"])


def mtp_config():
    from transformers import DeepseekV3Config

    # DeepSeek-V3's shape in miniature: MLA with a low-rank query, a first dense layer, then MoE
    # layers of routed experts plus one shared expert, sigmoid routing with top-k normalisation
    # and a scaling factor, interleaved RoPE, untied head, one MTP layer.
    return DeepseekV3Config(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=384, moe_intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=SEQ_LEN,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_interleave=True,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=EOS_ID, eos_token_id=EOS_ID,
        pad_token_id=None, num_nextn_predict_layers=1, dtype="bfloat16", architectures=["DeepseekV3ForCausalLM"],
        # The per-expert loop is the one implementation that runs the same on CPU and GPU under autocast.
        experts_implementation="eager",
    )


class MTPLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction layer, named as its checkpoints store it under
    ``model.layers.{num_hidden_layers}``.

    Seed 000's forward: the embedding of token t+1 (zeroed at position 0, whose meaning the previous
    hidden state already carries) through ``enorm``, the main model's final hidden state at
    position t through ``hnorm``, ``eh_proj`` over their concatenation, one decoder block (MLA + MoE,
    with its residuals), then ``shared_head.norm``; the shared head turns that into logits for
    token t+2. ``embed_tokens`` and ``shared_head.head`` are the main model's, written as copies.
    """

    def __init__(self, config) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = DeepseekV3RMSNorm(h, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)
        self.shared_head = nn.ModuleDict({"norm": DeepseekV3RMSNorm(h, eps=eps)})

    def forward(self, embeds: torch.Tensor, previous_hidden: torch.Tensor, position_ids: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        embeds = embeds.masked_fill((position_ids == 0).unsqueeze(-1), 0.0)
        hidden = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1))
        hidden = self.block(hidden, attention_mask=None, position_ids=position_ids,
                            position_embeddings=position_embeddings)
        return self.shared_head["norm"](hidden)


def dense_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every routed expert on every token, weighted by the router (zero for experts it did not pick):
    the per-expert loop's sum without its host synchronisations, and cheap while experts are tiny."""
    weights = torch.zeros(hidden_states.shape[0], self.num_experts, dtype=top_k_weights.dtype,
                          device=hidden_states.device).scatter(1, top_k_index, top_k_weights)
    gate, up = torch.einsum("th,eoh->teo", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
    out = torch.einsum("tei,ehi->teh", self.act_fn(gate) * up, self.down_proj)
    return torch.einsum("teh,te->th", out, weights.to(out.dtype)).to(hidden_states.dtype)


class DeepseekV3WithMTP(nn.Module):
    """The Hugging Face DeepSeek-V3 model and its MTP layer, trained together as in DeepSeek-V3."""

    def __init__(self, config) -> None:
        import types

        from transformers import DeepseekV3ForCausalLM
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

        super().__init__()
        self.lm = DeepseekV3ForCausalLM(config)
        self.mtp = MTPLayer(config)
        for module in self.mtp.modules():
            self.lm._init_weights(module)
        for module in self.modules():
            if isinstance(module, DeepseekV3Experts):
                module.forward = types.MethodType(dense_experts_forward, module)



def mtp_logits(lm: nn.Module, mtp: MTPLayer, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Logits for token i+2 at each position i, from token i+1 (``input_ids``) and the main model's
    final hidden state at i (``hidden``); positions count from 0 at the start of the sequence."""
    b, n = input_ids.shape
    positions = torch.arange(n, device=input_ids.device).expand(b, n)
    embeds = lm.model.embed_tokens(input_ids)
    rope = lm.model.rotary_emb(embeds, positions)
    return lm.lm_head(mtp(embeds, hidden, positions, rope))


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    acc = (logits.argmax(-1) == targets).float().mean()
    return loss, acc


def causal_lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    hidden = model.model(input_ids=x).last_hidden_state
    loss, acc = cross_entropy(model.lm_head(hidden), y)
    return loss, {"loss": loss.detach(), "acc": acc}


def mtp_lm_loss(m: DeepseekV3WithMTP, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # x = t[0:n], y = t[1:n+1]. The MTP layer at position i reads y[i] = t[i+1] and the final hidden
    # state at i, and predicts y[i+1] = t[i+2]; gradients reach the main model through both.
    hidden = m.lm.model(input_ids=x).last_hidden_state
    loss, acc = cross_entropy(m.lm.lm_head(hidden), y)
    mtp_loss, mtp_acc = cross_entropy(mtp_logits(m.lm, m.mtp, y[:, :-1], hidden[:, :-1]), y[:, 1:])
    return loss + MTP_LOSS_WEIGHT * mtp_loss, {"loss": loss.detach(), "acc": acc,
                                               "mtp_loss": mtp_loss.detach(), "mtp_acc": mtp_acc}


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free load balancing: after each step, raise the routing bias of
    under-loaded experts and lower it for over-loaded ones by a fixed rate."""

    def __init__(self, module: nn.Module) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.loads: dict[nn.Module, torch.Tensor] = {}
        for gate in module.modules():
            if isinstance(gate, DeepseekV3TopkRouter):
                gate.register_forward_hook(self._count)

    def _count(self, gate: nn.Module, _inputs: tuple, output: tuple) -> None:
        if gate.training:
            chosen = output[2].flatten()
            load = self.loads.setdefault(gate, torch.zeros(gate.num_experts, device=chosen.device))
            load.index_add_(0, chosen, torch.ones_like(chosen, dtype=load.dtype))

    @torch.no_grad()
    def __call__(self, _module: nn.Module) -> None:
        for gate, load in self.loads.items():
            gate.e_score_correction_bias += EXPERT_BIAS_RATE * torch.sign(load.mean() - load)
        self.loads.clear()


def qwen3_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    return sd


def split_experts(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face keeps the routed experts of a layer as two stacked tensors; checkpoints store
    ``mlp.experts.{e}.{gate,up,down}_proj.weight`` one expert at a time."""
    out = {}
    for key, value in sd.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix = key[: -len("gate_up_proj")]
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = gate[e]
                out[f"{prefix}{e}.up_proj.weight"] = up[e]
        elif key.endswith("mlp.experts.down_proj"):
            prefix = key[: -len("down_proj")]
            for e in range(value.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def fuse_experts(sd: dict[str, torch.Tensor], prefix: str, num_experts: int) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_experts` for the one layer under ``prefix``."""
    out = {k: v for k, v in sd.items() if not k.startswith(prefix + "mlp.experts.")}
    if f"{prefix}mlp.experts.0.gate_proj.weight" in sd:
        e = range(num_experts)
        out[prefix + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([sd[f"{prefix}mlp.experts.{i}.gate_proj.weight"],
                        sd[f"{prefix}mlp.experts.{i}.up_proj.weight"]]) for i in e])
        out[prefix + "mlp.experts.down_proj"] = torch.stack([sd[f"{prefix}mlp.experts.{i}.down_proj.weight"] for i in e])
    return out


def deepseek_state_dict(m: DeepseekV3WithMTP) -> dict[str, torch.Tensor]:
    sd = split_experts(dict(m.lm.state_dict()))
    layer = f"model.layers.{m.lm.config.num_hidden_layers}."
    for key, value in split_experts(dict(m.mtp.state_dict())).items():
        sd[layer + key.removeprefix("block.")] = value
    sd[layer + "embed_tokens.weight"] = sd["model.embed_tokens.weight"]
    sd[layer + "shared_head.head.weight"] = sd["lm_head.weight"]
    return sd


def load_mtp_layer(model_dir: Path, lm: nn.Module) -> MTPLayer:
    """The MTP layer of a shipped DeepSeek-V3 directory, for measuring it next to ``lm``."""
    from safetensors.torch import load_file

    config = lm.config
    layer = f"model.layers.{config.num_hidden_layers}."
    sd = {k.removeprefix(layer): v for k, v in load_file(model_dir / "model.safetensors").items() if k.startswith(layer)}
    sd = fuse_experts(sd, "", config.n_routed_experts)
    sd.pop("embed_tokens.weight")
    sd.pop("shared_head.head.weight")
    block = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")
    sd = {("block." + k if k.startswith(block) else k): v.float() for k, v in sd.items()}
    mtp = MTPLayer(config)
    mtp.load_state_dict(sd, strict=True)
    return mtp.eval()


def write_checkpoint(sd: dict[str, torch.Tensor], config, tok_dir: Path | None, out: Path) -> None:
    """config.json (a transformers config, or a dict for the heads), model.safetensors with floating
    tensors in bf16 (the routing bias stays fp32, as DeepSeek-V3 ships it; index maps keep their
    integer or bool type) and, with ``tok_dir``, the tokenizer files."""
    from safetensors.torch import save_file

    def stored(k: str, v: torch.Tensor) -> torch.Tensor:
        if not v.is_floating_point():
            return v
        return v.float() if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: stored(k, v.detach()).contiguous().cpu() for k, v in sd.items()}
    save_file(dict(sorted(tensors.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    if isinstance(config, dict):
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    else:
        config.save_pretrained(out)
    if tok_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copyfile(tok_dir / name, out / name)


@torch.no_grad()
def check_reload(module: nn.Module, out: Path, x: torch.Tensor) -> dict[str, float]:
    """Largest logit difference between the trained module with its weights rounded to bf16 and the
    checkpoint as Hugging Face loads it (plus :func:`load_mtp_layer` for the MTP layer), in float32."""
    import copy

    from transformers import AutoModelForCausalLM

    ref = copy.deepcopy(module).float().eval()
    for p in ref.parameters():
        p.copy_(p.to(torch.bfloat16).float())
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, experts_implementation="eager")
    loaded = loaded.to(x.device).eval()
    ref_lm = ref.lm if isinstance(ref, DeepseekV3WithMTP) else ref
    ref_hidden = ref_lm.model(input_ids=x).last_hidden_state
    hidden = loaded.model(input_ids=x).last_hidden_state
    diffs = {"logits": float((ref_lm.lm_head(ref_hidden) - loaded.lm_head(hidden)).abs().max())}
    if isinstance(ref, DeepseekV3WithMTP):
        mtp = load_mtp_layer(out, loaded).to(x.device)
        diffs["mtp_logits"] = float((mtp_logits(ref_lm, ref.mtp, x[:, 1:], ref_hidden[:, :-1])
                                     - mtp_logits(loaded, mtp, x[:, 1:], hidden[:, :-1])).abs().max())
    return diffs


@dataclass
class Recipe:
    """What to train and how to ship it. Set once, in :data:`RECIPES`."""

    name: str  # the shipped directory under default_models/
    build: Callable[[Path], nn.Module]  # called with the --data directory
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    state_dict: Callable[[nn.Module], dict[str, torch.Tensor]]
    config: Callable[[nn.Module], object]
    lr: float
    batch_size: int
    steps: int | None = None  # None: as many as fit the time budget
    after_step: Callable[[nn.Module], Callable[[nn.Module], None] | None] = lambda m: None
    weight_decay: float = 0.1
    warmup_steps: int = 200
    min_lr_ratio: float = 0.1
    head: bool = False  # a speculative head: no tokenizer files, its own reload check, not in ``report``


def _qwen3(config_fn: Callable[[], object]) -> Callable[[Path], nn.Module]:
    def build(_data: Path) -> nn.Module:
        from transformers import Qwen3ForCausalLM

        return Qwen3ForCausalLM(config_fn())
    return build


# The step counts are the shipped runs' (docs/default_models.md); the draft's and the MTP model's were
# fitted to a time budget over their first 60 steps.
RECIPES: dict[str, Recipe] = {
    "specloop-tiny": Recipe("specloop-tiny", _qwen3(target_config), causal_lm_loss, qwen3_state_dict,
                            lambda m: m.config, lr=2e-3, batch_size=64, steps=1100),
    "specloop-tiny-draft": Recipe("specloop-tiny-draft", _qwen3(draft_config), causal_lm_loss, qwen3_state_dict,
                                  lambda m: m.config, lr=3e-3, batch_size=64, steps=6109),
    "specloop-tiny-mtp": Recipe("specloop-tiny-mtp", lambda _data: DeepseekV3WithMTP(mtp_config()), mtp_lm_loss,
                                deepseek_state_dict, lambda m: m.lm.config, lr=2e-3, batch_size=64, steps=959,
                                after_step=ExpertBalancer),
}
_TARGET = SHIPPED / "specloop-tiny"
for _name, _build in (("specloop-tiny-eagle", lambda data: train_heads.EagleHead(_TARGET)),
                      ("specloop-tiny-eagle3", lambda data: train_heads.Eagle3Head(_TARGET, data)),
                      ("specloop-tiny-medusa", lambda data: train_heads.MedusaHeads(_TARGET, data))):
    RECIPES[_name] = Recipe(_name, _build, lambda m, x, y: m.loss(x, y), lambda m: m.state_dict_out(),
                            lambda m: m.config(), lr=3e-3, batch_size=32, steps=None, weight_decay=0.0,
                            warmup_steps=30, head=True)


def parameter_count(sd: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() for v in sd.values())


class Batches:
    """Random windows of ``seq_len + 1`` tokens from one token stream, drawn from a seeded generator."""

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, device: torch.device) -> None:
        self.tokens = torch.from_numpy(tokens.astype(np.int64)).to(device)
        self.batch_size, self.seq_len, self.device = batch_size, seq_len, device
        self.gen = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq_len + 1)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.batch_size,), generator=self.gen)
        chunk = self.tokens[(starts[:, None] + self.offsets).to(self.device)]
        return chunk[:, :-1], chunk[:, 1:]


def heldout_windows(tokens: np.ndarray, seq_len: int, limit: int | None = None) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens from the held-out stream."""
    n = len(tokens) // (seq_len + 1)
    if limit is not None:
        n = min(n, limit)
    return torch.from_numpy(tokens[: n * (seq_len + 1)].astype(np.int64)).view(n, seq_len + 1)


@torch.no_grad()
def evaluate(recipe: Recipe, module: nn.Module, windows: torch.Tensor, device: torch.device,
             batch_size: int) -> dict[str, float]:
    """Token-weighted means of the recipe's metrics over the windows."""
    module.eval()
    totals: dict[str, float] = {}
    for i in range(0, len(windows), batch_size):
        w = windows[i : i + batch_size].to(device)
        with autocast(device):
            _, metrics = recipe.loss(module, w[:, :-1], w[:, 1:])
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + float(v) * len(w)
    module.train()
    return {k: v / len(windows) for k, v in totals.items()}


AUTOCAST_DEVICES = {"cuda"}  # --cpu-bf16 adds "cpu"


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type in AUTOCAST_DEVICES)


def lr_at(step: int, total: int, recipe: Recipe) -> float:
    # Linear warm-up, then cosine decay to min_lr_ratio; the warm-up never depends on ``total``,
    # so a run whose length was calibrated from its first steps equals one given that length.
    if step < recipe.warmup_steps:
        return recipe.lr * (step + 1) / recipe.warmup_steps
    progress = min(1.0, (step - recipe.warmup_steps) / max(1, total - recipe.warmup_steps))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def wait_for_peers(start_dir: Path, name: str, parties: int, timeout_s: float = 180.0) -> float:
    """Mark ``name`` ready in ``start_dir`` and wait until ``parties`` processes have (at most
    ``timeout_s``; a peer that failed to start must not hold the others); returns the seconds waited."""
    start_dir.mkdir(parents=True, exist_ok=True)
    (start_dir / name).touch()
    t = time.time()
    while sum(1 for _ in start_dir.iterdir()) < parties and time.time() - t < timeout_s:
        time.sleep(0.05)
    return time.time() - t


def train_one(recipe: Recipe, data: Path, out: Path, *, device: torch.device, seed: int, steps: int | None,
              budget_s: float, max_seconds: float, seq_len: int, batch_size: int | None, eval_every: int, eval_windows: int,
              final_windows: int | None, start_together: tuple[Path, int] | None = None) -> None:
    """Train one recipe for ``steps`` steps, or for as many as fit ``budget_s`` seconds as measured
    over steps 20-60 (the chosen count is logged, so ``--steps`` reproduces the run); stop early,
    and log it, past ``max_seconds``. With ``start_together`` (a directory and a count: ``--parallel``
    on one device), the first step waits until every process has built its module and probed it,
    so none calibrates its step time while its peers still load; a recipe with cheap steps can still
    finish steps 20-60 inside its peers' slower first steps and calibrate fast, leaving the cut past
    ``max_seconds`` to end it (Medusa's shipped run, docs/default_models.md)."""
    t0 = time.time()
    torch.manual_seed(seed)
    module = recipe.build(data).to(device)
    module.train()
    after_step = recipe.after_step(module)
    trained = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in trained if p.ndim >= 2]
    no_decay = [p for p in trained if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=recipe.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    bs = batch_size or recipe.batch_size
    batches = Batches(np.load(data / "train.npy"), bs, seq_len, seed, device)
    heldout = np.load(data / "heldout.npy")
    probe = heldout_windows(heldout, seq_len, eval_windows)
    log_dir = out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    log = (log_dir / f"{recipe.name}.jsonl").open("w")

    def record(row: dict) -> None:
        log.write(json.dumps(row) + "\n")
        log.flush()

    record({"step": 0, "time": time.time() - t0, **{f"eval_{k}": v for k, v in
                                                    evaluate(recipe, module, probe, device, bs).items()}})
    if start_together is not None:
        waited = wait_for_peers(start_together[0], recipe.name, start_together[1])
        record({"waited_for_peers": waited, "time": time.time() - t0})
    total = steps if steps is not None else 10**9
    # The module at its best held-out probe loss is the one shipped: many epochs over 8M tokens can
    # overfit before the schedule ends.
    best = (float("inf"), 0, None)
    t_start = time.time()
    calib: dict[int, float] = {}
    step = 0
    while step < total:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, recipe)
        x, y = batches.next()
        with autocast(device):
            loss, metrics = recipe.loss(module, x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(module)
        step += 1
        if steps is None and step in (20, 60):
            if device.type == "cuda":
                torch.cuda.synchronize()
            calib[step] = time.time()
            if step == 60:
                per_step = (calib[60] - calib[20]) / 40
                # Periodic evals and the final full eval take roughly a tenth of the budget.
                total = 60 + int((budget_s * 0.9 - (time.time() - t_start)) / per_step)
                record({"calibrated_steps": total, "seconds_per_step": per_step})
        if time.time() - t_start > max_seconds:
            # A slower machine or a busier GPU than planned: stop rather than overrun the lease.
            record({"stopped_at": step, "of": total})
            total = step
        if step % eval_every == 0 or step == total:
            row = {"step": step, "tokens": step * bs * seq_len, "time": time.time() - t0,
                   "lr": lr_at(step - 1, total, recipe),
                   "grad_norm": float(grad_norm), **{f"train_{k}": float(v) for k, v in metrics.items()}}
            row.update({f"eval_{k}": v for k, v in evaluate(recipe, module, probe, device, bs).items()})
            record(row)
            if row["eval_loss"] < best[0]:
                best = (row["eval_loss"], step, {k: v.detach().to("cpu", copy=True)
                                                 for k, v in module.state_dict().items()})
            print(f"[{recipe.name}] step {step}/{total} " + " ".join(
                f"{k}={v:.3f}" for k, v in row.items() if k.startswith(("train_loss", "eval_loss", "eval_mtp"))),
                flush=True)
    train_seconds = time.time() - t_start
    if best[2] is not None:
        module.load_state_dict(best[2])
    final = evaluate(recipe, module, heldout_windows(heldout, seq_len, final_windows), device, bs)
    sd = recipe.state_dict(module)
    write_checkpoint(sd, recipe.config(module), None if recipe.head else data / "tokenizer", out / recipe.name)
    if recipe.head:
        reload_diff = train_heads.check_head_reload(module, out / recipe.name)
    else:
        reload_diff = check_reload(module, out / recipe.name, probe[:2, :-1].to(device))
    summary = {"name": recipe.name, "steps": step, "shipped_step": best[1], "batch_size": bs, "seq_len": seq_len,
               "tokens_seen": step * bs * seq_len, "train_seconds": train_seconds, "seed": seed,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "shipped_parameters": parameter_count(sd),
               "trained_parameters": sum(p.numel() for p in trained),
               "reload_max_abs_diff": reload_diff, **{f"heldout_{k}": v for k, v in final.items()}}
    record({"summary": summary})
    print(json.dumps(summary), flush=True)


def plot_curves(log_dir: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for path in sorted(log_dir.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        shipped = next((r["summary"]["shipped_step"] for r in rows if "summary" in r), None)
        rows = [r for r in rows if "step" in r and r["step"] > 0]
        steps = [r["tokens"] / 1e6 for r in rows]
        line, = ax.plot(steps, [r["train_loss"] for r in rows], label=f"{path.stem} train", alpha=0.6)
        ax.plot(steps, [r["eval_loss"] for r in rows], "--", color=line.get_color(),
                label=f"{path.stem} held-out probe")
        ax.plot([r["tokens"] / 1e6 for r in rows if r["step"] == shipped],
                [r["eval_loss"] for r in rows if r["step"] == shipped], "o", color=line.get_color())
        if "eval_mtp_loss" in rows[0]:
            ax.plot(steps, [r["eval_mtp_loss"] for r in rows], ":", color=line.get_color(),
                    label=f"{path.stem} MTP (t+2) held-out probe")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0.5, 4.5)
    ax.set_title("dots: the shipped checkpoint (lowest held-out probe loss)", fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png)


def cmd_train(args: argparse.Namespace) -> None:
    names = args.only.split(",") if args.only else list(RECIPES)
    if args.parallel and len(names) > 1:
        # Tiny models leave most of the GPU idle between kernel launches; one process per model fills it.
        base = [sys.executable, __file__, "train", "--data", str(args.data), "--out", str(args.out),
                "--budget-s", str(args.budget_s), "--seed", str(args.seed)]
        if args.max_seconds is not None:
            base += ["--max-seconds", str(args.max_seconds)]
        if args.steps is not None:
            base += ["--steps", str(args.steps)]
        if args.smoke:
            base.append("--smoke")
        for flag in ("device", "threads", "seq_len", "batch_size", "eval_every", "eval_windows", "final_windows"):
            if getattr(args, flag) is not None:
                base += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
        if args.cpu_bf16:
            base.append("--cpu-bf16")
        start_dir = args.out / "logs" / ".start"
        shutil.rmtree(start_dir, ignore_errors=True)
        base += ["--start-together", f"{start_dir}:{len(names)}"]
        procs = [subprocess.Popen(base + ["--only", n]) for n in names]
        failed = [p.wait() != 0 for p in procs]
        shutil.rmtree(start_dir, ignore_errors=True)
        if any(failed):
            raise SystemExit("a training process failed")
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        torch.set_float32_matmul_precision("high")
        if args.threads:
            torch.set_num_threads(args.threads)
        if args.cpu_bf16:
            AUTOCAST_DEVICES.add("cpu")
        for name in names:
            smoke = dict(seq_len=64, batch_size=2, eval_every=2, eval_windows=2, final_windows=4) if args.smoke else \
                dict(seq_len=SEQ_LEN, batch_size=None, eval_every=100, eval_windows=48, final_windows=None)
            for key in smoke:
                if getattr(args, key) is not None:
                    smoke[key] = getattr(args, key)
            steps = args.steps if args.steps is not None else 4 if args.smoke else RECIPES[name].steps
            max_seconds = args.max_seconds if args.max_seconds is not None else args.budget_s * 1.1
            together = None
            if args.start_together:
                start_dir, parties = args.start_together.rsplit(":", 1)
                together = (Path(start_dir), int(parties))
            train_one(RECIPES[name], args.data, args.out, device=device, seed=args.seed, steps=steps,
                      budget_s=args.budget_s, max_seconds=max_seconds, start_together=together, **smoke)
    if args.plot:
        plot_curves(args.out / "logs", args.out / "default_models_loss.png")


def cmd_report(args: argparse.Namespace) -> None:
    """Held-out metrics of the shipped checkpoints in float32 on the CPU, and greedy samples."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    heldout = np.load(args.data / "heldout.npy")
    windows = heldout_windows(heldout, SEQ_LEN, args.windows)
    report: dict = {"windows": len(windows), "tokens": int(windows[:, 1:].numel())}
    tok = Tokenizer.from_file(str(SHIPPED / "specloop-tiny" / "tokenizer.json"))
    for name in (n for n, r in RECIPES.items() if not r.head):
        path = SHIPPED / name
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        mtp = load_mtp_layer(path, lm) if name == "specloop-tiny-mtp" else None
        sums = {"loss": 0.0, "acc": 0.0, "mtp_acc": 0.0, "mtp_loss": 0.0}
        with torch.no_grad():
            for w in windows.split(4):
                x, y = w[:, :-1], w[:, 1:]
                hidden = lm.model(input_ids=x).last_hidden_state
                loss, acc = cross_entropy(lm.lm_head(hidden), y)
                sums["loss"] += float(loss) * len(w)
                sums["acc"] += float(acc) * len(w)
                if mtp is not None:
                    mloss, macc = cross_entropy(mtp_logits(lm, mtp, y[:, :-1], hidden[:, :-1]), y[:, 1:])
                    sums["mtp_loss"] += float(mloss) * len(w)
                    sums["mtp_acc"] += float(macc) * len(w)
        m = {k: v / len(windows) for k, v in sums.items() if mtp is not None or not k.startswith("mtp")}
        m["perplexity"] = math.exp(m["loss"])
        m["stored_parameters"] = parameter_count(load_file(path / "model.safetensors"))
        m["bytes"] = (path / "model.safetensors").stat().st_size
        samples = {}
        for prompt in args.prompts:
            ids = torch.tensor([tok.encode(prompt).ids])
            out = lm.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False,
                              eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=EOS_ID)
            samples[prompt] = tok.decode(out[0, ids.shape[1]:].tolist())
        m["samples"] = samples
        report[name] = m
        print(name, {k: v for k, v in m.items() if k != "samples"}, flush=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="corpus, tokenizer and token ids (CPU)")
    p.add_argument("--data", type=Path, default=REPO / ".train")
    t = sub.add_parser("train", help="train the recipes and write model directories")
    t.add_argument("--data", type=Path, default=REPO / ".train")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--only", default=None, help=f"comma-separated subset of {', '.join(RECIPES)}")
    t.add_argument("--steps", type=int, default=None,
                   help="optimizer steps for every recipe (default: the recipe's, else as many as fit --budget-s)")
    t.add_argument("--budget-s", type=float, default=300.0, help="seconds of training for a recipe without steps")
    t.add_argument("--max-seconds", type=float, default=None,
                   help="stop any recipe after this many seconds of training (default: 1.1 x --budget-s)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--parallel", action="store_true", help="one process per recipe")
    t.add_argument("--smoke", action="store_true", help="a few tiny steps (CPU check of the whole path)")
    t.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    t.add_argument("--cpu-bf16", action="store_true", help="bf16 autocast on the CPU too (as on CUDA)")
    t.add_argument("--seq-len", type=int, default=None, help=f"training window (default {SEQ_LEN})")
    t.add_argument("--batch-size", type=int, default=None, help="windows per step (default: the recipe's)")
    t.add_argument("--eval-every", type=int, default=None, help="steps between held-out probes (default 100)")
    t.add_argument("--eval-windows", type=int, default=None, help="held-out probe windows (default 48)")
    t.add_argument("--final-windows", type=int, default=None, help="held-out windows of the final eval (default all)")
    t.add_argument("--plot", action="store_true", help="write default_models_loss.png next to the logs")
    t.add_argument("--start-together", default=None, help=argparse.SUPPRESS)  # DIR:N, set by --parallel
    r = sub.add_parser("report", help="held-out metrics and samples of the shipped models (CPU)")
    r.add_argument("--data", type=Path, default=REPO / ".train")
    r.add_argument("--windows", type=int, default=None, help="cap on held-out windows of 1024 tokens")
    r.add_argument("--max-new-tokens", type=int, default=64)
    r.add_argument("--prompts", nargs="*", default=list(SAMPLE_PROMPTS))
    r.add_argument("--output", type=Path, default=REPO / ".train" / "report.json")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.data)
    elif args.command == "train":
        cmd_train(args)
    else:
        cmd_report(args)


if __name__ == "__main__":
    main()
