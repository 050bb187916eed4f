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

    for name, p in model.named_parameters():  # tied weights appear once
        if name.endswith("norm.weight"):
            t = torch.ones(p.shape, dtype=torch.bfloat16, device=device)
        else:
            t = torch.empty(p.shape, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen)
        shard[name] = t
        size += t.numel() * 2
        if size >= 2 << 30:
            flush()
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of one model shape (bf16 weights and KV)."""

    weight_bytes: int  # every weight read once per forward (embedding rows excluded, LM head included)
    matmul_params: int  # weights multiplied per token by the layers (excludes the LM head)
    lm_head_params: int
    kv_bytes_per_token: int  # K and V of one position over all layers
    attn_flops_per_pair: int  # FLOPs of one (query, key) pair over all layers: QK^T and PV

    @classmethod
    def of(cls, shape: str) -> ModelCost:
        s = SHAPES[shape]
        h, i, n = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
        q, kv, d = s["num_attention_heads"], s["num_key_value_heads"], s["head_dim"]
        layer = h * (q + 2 * kv) * d + q * d * h + 3 * h * i
        lm_head = s["vocab_size"] * h
        return cls(weight_bytes=2 * (n * layer + lm_head), matmul_params=n * layer, lm_head_params=lm_head,
                   kv_bytes_per_token=2 * n * kv * d * 2, attn_flops_per_pair=4 * n * q * d)


# --- ceilings ---------------------------------------------------------------------------------------

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
