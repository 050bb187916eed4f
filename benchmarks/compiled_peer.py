"""The plain-PyTorch peer of batch-1 decode: a static-cache decoder compiled with ``torch.compile``.

What specloop's batch-1 decode is compared with besides the roofline: the same random checkpoint
(``common.build_checkpoint``; the Llama and Qwen3 shapes) decoded by a hundred lines of PyTorch in
the manner of gpt-fast. Every layer's K and V live in one preallocated cache of the run's length;
a decode step embeds one token, writes its K and V at its position and attends over the whole
cache under a mask (``scaled_dot_product_attention`` with grouped KV heads), and the step,
greedy argmax included, is compiled with ``torch.compile(mode="reduce-overhead", fullgraph=True)``:
Inductor's fused kernels replayed from a CUDA graph. The prompt runs eagerly.

Batch 1, a ``--prompt-len`` random prompt then ``--output-len`` greedy tokens, as
``decode_latency.py`` decodes them; tok/s counts the decode steps alone (the prompt's forward is
not timed), against that script's roofline at the same copy bandwidth, measured in the same run.
The first run compiles and is not timed; the median of ``--repeat`` runs is reported.
``--check`` decodes the prompt with specloop's torch runner too and fails unless the tokens are the
same and the peer's log-probabilities of specloop's top 5 at every step are within
``--check-tolerance`` (float32 on a small shape: a check that the peer computes the model).

    python benchmarks/compiled_peer.py --shapes qwen3-0.6b,llama3-8b
    python benchmarks/compiled_peer.py --device cpu --shapes tiny --dtype float32 --no-compile --check
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import ModelCost, base_args, begin_shapes, build_checkpoint, report, save  # noqa: E402


def load_weights(path: str, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update({k.removeprefix("model."): v.to(device=device, dtype=dtype)
                        for k, v in load_file(os.path.join(path, name)).items()})
    return weights


class StaticDecoder:
    """A Llama / Qwen3 decoder over a static KV cache of ``max_len`` positions (batch 1)."""

    def __init__(self, path: str, max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        self.w = load_weights(path, device, dtype)
        self.layers = cfg["num_hidden_layers"]
        self.heads, self.kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.head_dim = cfg.get("head_dim") or cfg["hidden_size"] // self.heads
        self.eps = cfg["rms_norm_eps"]
        self.qk_norm = cfg["architectures"][0] == "Qwen3ForCausalLM"
        self.lm_head = self.w.get("lm_head.weight", self.w["embed_tokens.weight"])
        theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
        inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim)
        angles = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv_freq)
        self.cos = torch.cat([angles.cos()] * 2, dim=-1).to(dtype)  # [max_len, head_dim]
        self.sin = torch.cat([angles.sin()] * 2, dim=-1).to(dtype)
        shape = (self.layers, 1, self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.slots = torch.arange(max_len, device=device)
        if device.type == "cuda":  # fixed addresses: the CUDA graphs read them in place and may write the caches
            for t in (*self.w.values(), self.cos, self.sin, self.k_cache, self.v_cache, self.slots):
                torch._dynamo.mark_static_address(t)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:  # x [T, heads, D]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Logits ``[T, V]`` of ``tokens`` ``[T]`` at positions ``pos`` ``[T]``, their K and V written
        into the cache."""
        w, n, d = self.w, tokens.shape[0], self.head_dim
        x = w["embed_tokens.weight"][tokens]
        mask = self.slots[None, :] <= pos[:, None]  # [T, max_len]: keys up to each query's position
        for i in range(self.layers):
            p = f"layers.{i}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, self.heads, d)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, self.kv_heads, d)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, self.kv_heads, d)
            if self.qk_norm:
                q, k = self._norm(q, w[p + "self_attn.q_norm.weight"]), self._norm(k, w[p + "self_attn.k_norm.weight"])
            q, k = self._rope(q, pos), self._rope(k, pos)
            self.k_cache[i, 0].index_copy_(1, pos, k.transpose(0, 1))
            self.v_cache[i, 0].index_copy_(1, pos, v.transpose(0, 1))
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.k_cache[i], self.v_cache[i],
                                                 attn_mask=mask[None, None], enable_gqa=True)
            x = x + out[0].transpose(0, 1).reshape(n, self.heads * d) @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gated = F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + gated @ w[p + "mlp.down_proj.weight"].T
        return self._norm(x, w["norm.weight"]) @ self.lm_head.T

    def step(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decode step, greedy: the next token ``[1]``."""
        return self.forward(token, pos).argmax(-1)


def decode(model: StaticDecoder, step: Any, prompt: list[int], output_len: int, device: torch.device
           ) -> tuple[list[int], float]:
    """Greedy tokens after ``prompt`` and the seconds of the decode steps (the first token comes
    from the prompt's forward, not timed)."""
    with torch.inference_mode():
        tokens = torch.tensor(prompt, device=device)
        first = model.forward(tokens, torch.arange(len(prompt), device=device))[-1].argmax(-1, keepdim=True)
        out = torch.empty(output_len, dtype=torch.int64, device=device)
        out[:1] = first
        positions = torch.arange(len(prompt), len(prompt) + output_len, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        token = first
        for i in range(1, output_len):
            token = step(token, positions[i - 1:i]).clone()  # a graph's output is overwritten by its next replay
            out[i:i + 1] = token
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out.tolist(), time.perf_counter() - t


def check_against_specloop(model: StaticDecoder, path: str, prompt: list[int], tokens: list[int],
                           args: argparse.Namespace) -> float:
    """specloop's torch runner decodes ``prompt`` greedily with its top-5 logprobs: its tokens must be
    ``tokens``, and the peer's log-probabilities of those top 5 at every step (one forward over the
    whole sequence) must match them. Returns the largest difference."""
    from specloop import LLM, SamplingParams

    llm = LLM(path, skip_tokenizer_init=True, device=args.device, dtype=args.dtype, model_runner="torch",
              max_model_len=len(prompt) + len(tokens) + 16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=len(tokens), ignore_eos=True, logprobs=5)
        theirs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    finally:
        llm.core.shutdown()
    if list(theirs.token_ids) != tokens:
        first = next(i for i, (a, b) in enumerate(zip(tokens, theirs.token_ids)) if a != b)
        raise SystemExit(f"the peer's greedy tokens part from specloop's at token {first}")
    seq = prompt + tokens[:-1]
    with torch.inference_mode():
        device = model.cos.device
        logprobs = torch.log_softmax(model.forward(torch.tensor(seq, device=device),
                                                   torch.arange(len(seq), device=device)).float(), -1)
    worst = 0.0
    for j, top in enumerate(theirs.logprobs):
        row = logprobs[len(prompt) - 1 + j]
        worst = max(worst, *(abs(float(row[t]) - lp.logprob) for t, lp in top.items()))
    return worst


def run_shape(shape: str, args: argparse.Namespace, bandwidth: float) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    path = build_checkpoint(shape, args.ckpt_root, device)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_len).tolist()
    model = StaticDecoder(path, args.prompt_len + args.output_len, device, dtype)
    t0 = time.perf_counter()
    step = torch.compile(model.step, mode="reduce-overhead", fullgraph=True) if args.compile else model.step
    tokens, _ = decode(model, step, prompt, args.output_len, device)  # compiles
    compile_s = time.perf_counter() - t0
    times = [decode(model, step, prompt, args.output_len, device)[1] for _ in range(args.repeat)]
    elapsed = float(np.median(times))
    cost = ModelCost.of(shape)
    mean_ctx = args.prompt_len + (args.output_len - 1) / 2
    tok_s = (args.output_len - 1) / elapsed
    roof = bandwidth / (cost.weight_bytes_at(1) + mean_ctx * cost.kv_bytes_per_token)
    from torch._dynamo.utils import counters

    row = {"batch": 1, "tok_s": tok_s, "ms_per_step": 1e3 * elapsed / (args.output_len - 1), "roofline_tok_s": roof,
           "pct_of_roofline": 100 * tok_s / roof, "runs_s": times, "first_run_s": compile_s,
           "compiled": args.compile, "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}
    if args.check:
        row["logprob_difference_to_specloop"] = worst = check_against_specloop(model, path, prompt, tokens, args)
        if worst > args.check_tolerance:
            raise SystemExit(f"{shape}: the peer's logprobs differ from specloop's by {worst:.3g}")
    report(f"{shape} batch 1 (compiled peer)", row)
    return {"shape": shape, "rows": [row]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base_args(parser)
    parser.add_argument("--shapes", default="qwen3-0.6b,llama3-8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile the decode step (mode reduce-overhead); --no-compile runs it eagerly")
    parser.add_argument("--check", action="store_true",
                        help="fail unless specloop's torch runner decodes the same tokens with the same top-5 "
                        "logprobs (within --check-tolerance)")
    parser.add_argument("--check-tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    bandwidth, results = begin_shapes("compiled_peer", "compiled peer", args)
    for shape in args.shapes.split(","):
        results["shapes"][shape] = run_shape(shape, args, bandwidth)
        save(args.out, "compiled_peer", results)


if __name__ == "__main__":
    main()
