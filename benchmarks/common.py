"""Shared pieces of the GPU benchmarks: model shapes, random checkpoints, the device's measured
ceilings (copy bandwidth, bf16 matmul rate), byte/FLOP counts, reporting and plots.

Every benchmark prints its configuration, the git commit, the device and every figure, and writes
``<name>.json`` (and a plot) into ``--out``. Random bf16 weights are built locally with the
transformers config class and saved as safetensors, so specloop and the Hugging Face peer read the
same checkpoint.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEEPSEEK_V2: dict[str, Any] = dict(
    config_class="DeepseekV2Config", architecture="DeepseekV2ForCausalLM", q_lora_rank=None, first_k_dense_replace=1,
    topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, rms_norm_eps=1e-6,
    tie_word_embeddings=False, max_position_embeddings=163840, mtp_layers=1,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1})

# The shapes the GPU benchmarks measure (random weights).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(config_class="Qwen3Config", architecture="Qwen3ForCausalLM", hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=40960),
    "llama3-8b": dict(config_class="LlamaConfig", architecture="LlamaForCausalLM", hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, vocab_size=128256, tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5,
                      max_position_embeddings=8192),
    # A one-layer draft at the target's width: what an EAGLE-style head costs per draft token.
    "llama3-8b-1layer": dict(config_class="LlamaConfig", architecture="LlamaForCausalLM", hidden_size=4096,
                             intermediate_size=14336, num_hidden_layers=1, num_attention_heads=32,
                             num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                             rope_theta=5e5, rms_norm_eps=1e-5, max_position_embeddings=8192),
    # The separate draft model one would pair with llama3-8b (Llama 3.2 1B's shape).
    "llama3.2-1b": dict(config_class="LlamaConfig", architecture="LlamaForCausalLM", hidden_size=2048,
                        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                        head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=5e5, rms_norm_eps=1e-5,
                        max_position_embeddings=8192),
    "qwen3-0.6b-1layer": dict(config_class="Qwen3Config", architecture="Qwen3ForCausalLM", hidden_size=1024,
                              intermediate_size=3072, num_hidden_layers=1, num_attention_heads=16,
                              num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                              rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960),
    # Run with fewer layers (benchmarks/distributed.py, ``llama3-70b:10``): 80 of them are 141 GB.
    "llama3-70b": dict(config_class="LlamaConfig", architecture="LlamaForCausalLM", hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=128, vocab_size=128256, tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5,
                       max_position_embeddings=8192),
    # A few-layer stand-in with the same per-layer shapes, for trying the scripts on a CPU.
    "tiny": dict(config_class="Qwen3Config", architecture="Qwen3ForCausalLM", hidden_size=128, intermediate_size=256,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=1024,
                 tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096),
    # DeepSeek-V2-Lite: MLA (no q LoRA, latent 512 + rotary 64), a dense first layer, then 64 routed
    # experts (top 6, softmax routing) + 2 shared ones; YaRN x40. Plus one MTP layer, as DeepSeek-V3
    # stores it (V2-Lite ships none), for the MTP proposer's cost.
    "deepseek-v2-lite": dict(DEEPSEEK_V2, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                             num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64,
                             n_shared_experts=2, num_experts_per_tok=6, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128, vocab_size=102400),
    # The same layout in miniature, for trying the DeepSeek benchmarks on a CPU.
    "deepseek-tiny": dict(DEEPSEEK_V2, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                          n_shared_experts=2, num_experts_per_tok=2, kv_lora_rank=64, qk_nope_head_dim=32,
                          qk_rope_head_dim=16, v_head_dim=32, vocab_size=1024),
}


def git_commit() -> str:
    """The checkout's commit; ``SPECLOOP_COMMIT`` where the tree travelled without ``.git`` (the
    GPU machine)."""
    if os.environ.get("SPECLOOP_COMMIT"):
        return os.environ["SPECLOOP_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment(device: torch.device) -> dict[str, Any]:
    import triton
    import transformers

    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": git_commit(),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__, "transformers": transformers.__version__,
                           "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, sms=props.multi_processor_count, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    else:
        env.update(cpu=platform.processor() or platform.machine(), cores=os.cpu_count())
    return env


def report(title: str, fields: dict[str, Any]) -> None:
    print(f"\n== {title}")
    for k, v in fields.items():
        print(f"  {k:<34} {v:.4g}" if isinstance(v, float) else f"  {k:<34} {v}")
    sys.stdout.flush()


def begin_shapes(benchmark: str, title: str, args: Any) -> tuple[float, dict[str, Any]]:
    """A per-shape benchmark's start: its configuration reported, the copy bandwidth measured now;
    (bandwidth in bytes/s, the results dict its shapes go into)."""
    env = environment(torch.device(args.device))
    report(f"{title}: configuration", {**env, **vars(args)})
    bandwidth = measure_bandwidth(torch.device(args.device))
    report("device ceilings (measured now)", {"copy bandwidth TB/s": bandwidth / 1e12})
    return bandwidth, {"benchmark": benchmark, "env": env, "config": vars(args), "bandwidth_Bps": bandwidth, "shapes": {}}


def save(out_dir: str, name: str, data: dict[str, Any]) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def plot(out_dir: str, name: str, series: dict[str, tuple[list[float], list[float]]], xlabel: str, ylabel: str,
         title: str, logx: bool = True) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- checkpoints ----------------------------------------------------------------------------------

def build_checkpoint(shape: str, root: str, device: torch.device, seed: int = 0) -> str:
    """A random bf16 checkpoint of ``shape`` under ``root`` (reused when already there): the
    transformers config class's ``config.json`` plus safetensors shards, weights drawn on ``device``
    (std 0.02, norms 1)."""
    import transformers
    from safetensors.torch import save_file

    path = os.path.join(root, shape)
    if os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        return path
    spec = dict(SHAPES[shape])
    config_class, architecture = spec.pop("config_class"), spec.pop("architecture")
    mtp_layers = spec.pop("mtp_layers", 0)
    config = getattr(transformers, config_class)(**spec, bos_token_id=1, eos_token_id=2)
    config.architectures = [architecture]
    with torch.device("meta"):
        model = getattr(transformers, architecture)(config)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    gen = torch.Generator(device=device).manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    size = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            fname = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file({k: v.cpu() for k, v in shard.items()}, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
            shard, size = {}, 0

    for name, shape_ in checkpoint_shapes(model, mtp_layers):  # tied weights appear once
        if name.endswith("norm.weight"):
            t = torch.ones(shape_, dtype=torch.bfloat16, device=device)
        else:
            t = torch.empty(shape_, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
        shard[name] = t
        size += t.numel() * 2
        if size >= 2 << 30:
            flush()
    flush()
    if mtp_layers:  # transformers' config classes do not know the field; DeepSeek-V3's config.json has it
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**saved, "num_nextn_predict_layers": mtp_layers}, f, indent=2)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def build_eagle3_head(shape: str, root: str, device: torch.device, draft_vocab: int = 32000, seed: int = 1) -> str:
    """A random bf16 EAGLE-3 head for the Llama/Qwen ``shape`` under ``root/<shape>-eagle3`` (reused
    when there), in the public layout (``proposers/heads.py``): ``fc`` over three target layers'
    states, one ``midlayer`` reading [embedding ; hidden], ``norm``, ``lm_head`` over the first
    ``draft_vocab`` target ids (``d2t`` zero)."""
    from safetensors.torch import save_file

    path = os.path.join(root, f"{shape}-eagle3")
    if os.path.isfile(os.path.join(path, "model.safetensors")):
        return path
    s = SHAPES[shape]
    h, inter, heads, kv_heads, dim = (s["hidden_size"], s["intermediate_size"], s["num_attention_heads"],
                                      s["num_key_value_heads"], s["head_dim"])
    layers, draft_vocab = s["num_hidden_layers"], min(draft_vocab, s["vocab_size"])
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
              "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": dim, "hidden_act": "silu",
              "rms_norm_eps": s["rms_norm_eps"], "rope_theta": s["rope_theta"],
              "max_position_embeddings": s["max_position_embeddings"], "vocab_size": s["vocab_size"],
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "draft_vocab_size": draft_vocab,
              "target_hidden_size": h,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": [min(2, layers), layers // 2, max(layers - 3, 0)]}}
    shapes = {"fc.weight": (h, 3 * h), "midlayer.self_attn.q_proj.weight": (heads * dim, 2 * h),
              "midlayer.self_attn.k_proj.weight": (kv_heads * dim, 2 * h),
              "midlayer.self_attn.v_proj.weight": (kv_heads * dim, 2 * h),
              "midlayer.self_attn.o_proj.weight": (h, heads * dim), "midlayer.mlp.gate_proj.weight": (inter, h),
              "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter),
              "lm_head.weight": (draft_vocab, h)}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: torch.empty(shape_, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
               for name, shape_ in shapes.items()}
    for norm in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[norm + ".weight"] = torch.ones(h, dtype=torch.bfloat16, device=device)
    tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64, device=device)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.cpu() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def checkpoint_shapes(model: Any, mtp_layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor a checkpoint of ``model`` holds, plus ``mtp_layers`` DeepSeek MTP layers after
    the last decoder layer (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` and a copy of the
    last layer's block; the embedding and head stay shared, as the MTP proposer reads them)."""
    out = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    layers = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    block = [(name.split(".", 3)[3], shape) for name, shape in out if name.startswith(f"model.layers.{layers - 1}.")]
    for j in range(mtp_layers):
        prefix = f"model.layers.{layers + j}."
        out += [(prefix + "enorm.weight", (hidden,)), (prefix + "hnorm.weight", (hidden,)),
                (prefix + "eh_proj.weight", (hidden, 2 * hidden)), (prefix + "shared_head.norm.weight", (hidden,))]
        out += [(prefix + name, shape) for name, shape in block]
    return out


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of one model shape (bf16 weights and KV)."""

    weight_bytes: int  # weights one token's forward reads (embedding rows excluded, LM head included)
    matmul_params: int  # weights multiplied per token by the layers (excludes the LM head)
    lm_head_params: int
    kv_bytes_per_token: int  # K and V (or MLA's latent) of one position over all layers
    attn_flops_per_pair: int  # FLOPs of one (query, key) pair over all layers: QK^T and PV
    # Mixture of experts: bytes of one routed expert over all MoE layers, experts per layer, picks per token.
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0

    def weight_bytes_at(self, batch: int) -> float:
        """Weights one decode step of ``batch`` tokens reads: the dense ones once, and every routed
        expert some token picked (expected count under uniform, independent routing)."""
        if not self.num_experts:
            return float(self.weight_bytes)
        touched = self.num_experts * (1 - (1 - self.top_k / self.num_experts) ** batch)
        return self.weight_bytes + self.expert_bytes * (touched - self.top_k)

    @classmethod
    def of(cls, shape: str) -> ModelCost:
        s = SHAPES[shape]
        if "kv_lora_rank" in s:
            return cls._deepseek(s)
        h, i, n = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
        q, kv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        layer = h * (q + 2 * kv) * d + q * d * h + 3 * h * i
        lm_head = s["vocab_size"] * h
        return cls(weight_bytes=2 * (n * layer + lm_head), matmul_params=n * layer, lm_head_params=lm_head,
                   kv_bytes_per_token=2 * n * kv * d * 2, attn_flops_per_pair=4 * n * q * d)

    @classmethod
    def _deepseek(cls, s: dict[str, Any]) -> ModelCost:
        """MLA in its absorbed form (per pair: ``[q_nope W_UK | q_rope]`` . 576-wide latent, then the
        512-wide average) and MoE with ``top_k`` routed experts per token."""
        h, n, heads = s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"]
        rank, rope, nope, v = s["kv_lora_rank"], s["qk_rope_head_dim"], s["qk_nope_head_dim"], s["v_head_dim"]
        q_lora = s.get("q_lora_rank")
        q = h * heads * (nope + rope) if not q_lora else h * q_lora + q_lora * heads * (nope + rope)
        attn = q + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h
        dense, moe_layers = s["first_k_dense_replace"], n - s["first_k_dense_replace"]
        expert = 3 * h * s["moe_intermediate_size"]
        experts, top_k = s["n_routed_experts"], s["num_experts_per_tok"]
        layers = n * attn + dense * 3 * h * s["intermediate_size"] + moe_layers * (
            s["n_shared_experts"] * expert + experts * h + top_k * expert)
        lm_head = s["vocab_size"] * h
        return cls(weight_bytes=2 * (layers + lm_head), matmul_params=layers, lm_head_params=lm_head,
                   kv_bytes_per_token=2 * n * (rank + rope), attn_flops_per_pair=2 * n * heads * (2 * rank + rope),
                   expert_bytes=2 * moe_layers * expert, num_experts=experts, top_k=top_k)


# --- ceilings ---------------------------------------------------------------------------------------

def host_loop_ms(n: int = 200_000) -> float:
    """Wall milliseconds of a fixed pure-Python loop (best of three): the host CPU's speed as the
    interpreter sees it. On a shared machine it can move by 1.5-1.8x for tens of seconds (the
    H200's host: 7.3-8.7 ms most of the time, 10.4-14.9 ms in some windows), and so does every
    host-bound engine step; benchmarks report it beside figures compared across runs."""
    items, best = list(range(16)), float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for i in range(n):
            len(items) + items[i & 15]
        best = min(best, time.perf_counter() - t0)
    return round(1e3 * best, 2)


def cuda_time(fn: Callable[[], Any], repeat: int = 10, warmup: int = 3) -> float:
    """Median seconds of ``fn`` by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def gpu_kernels(work: Callable[[], Any], steps: int, top: int = 25) -> list[dict[str, Any]]:
    """The GPU kernels ``work`` launches (CUDA-graph replays included), per step of ``steps``,
    by total device time: ``{kernel, us_per_step, calls_per_step}``, the ``top`` first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "us_per_step": us / steps, "calls_per_step": e.count / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def measure_bandwidth(device: torch.device, gib: float = 4.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if device.type != "cuda":
        return float("nan")
    n = int(gib * 2**30) // 2
    src = torch.randn(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src))
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * n * 2 / t


def measure_matmul(device: torch.device, n: int = 8192) -> float:
    """bf16 matmul rate in FLOP/s on random data."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    t = cuda_time(lambda: a @ b)
    a = b = None
    torch.cuda.empty_cache()
    return 2 * n**3 / t


def base_args(parser: Any) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.join(ROOT, "out", "benchmarks"))
    parser.add_argument("--ckpt-root", default=os.path.join(ROOT, "out", "checkpoints"))
