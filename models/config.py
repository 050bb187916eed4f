"""What specloop reads from a Hugging Face model directory's JSON files (torch-free).

The frontend uses :func:`read_model_config` for EOS ids and lengths without loading weights; the
loader and the model classes use it to size layers, the KV cache and the rotary embedding.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3")


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded: missing file, bad JSON, unsupported feature."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters, normalised from either config style."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3 only: the frequency band that is smoothly rescaled.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One decoder-only model's shape. Set by :func:`parse_hf_config` from ``config.json`` (and
    ``generation_config.json`` for the EOS ids); read by the model classes, loader and runner."""

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the raw config.json

    def per_rank(self, tensor_parallel_size: int) -> ModelConfig:
        """The shape one of ``tensor_parallel_size`` ranks holds: its share of the query heads, of
        the KV heads (one, replicated, when there are fewer KV heads than ranks) and of the MLP;
        hidden size and vocabulary stay whole (the logits are gathered). Raises
        :class:`ModelLoadError` when the model does not split that way."""
        tp = tensor_parallel_size
        if tp == 1:
            return self
        problems = []
        if self.num_heads % tp:
            problems.append(f"num_attention_heads ({self.num_heads}) is not a multiple of it")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"num_key_value_heads ({self.num_kv_heads}) is neither a multiple nor a divisor of it")
        if self.intermediate_size % tp:
            problems.append(f"intermediate_size ({self.intermediate_size}) is not a multiple of it")
        if problems:
            raise ModelLoadError(f"{self.architecture} cannot be split over tensor_parallel_size={tp}: "
                                 f"{'; '.join(problems)}")
        return replace(self, num_heads=self.num_heads // tp, num_kv_heads=max(1, self.num_kv_heads // tp),
                       intermediate_size=self.intermediate_size // tp)

    def kv_bytes_per_block(self, block_size: int, dtype_size: int) -> int:
        """Bytes one paged-KV block takes across all layers (K and V)."""
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * dtype_size


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return data


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def parse_rope(hf: dict[str, Any]) -> RopeConfig:
    """Normalise ``rope_parameters`` (current transformers) or ``rope_theta`` + ``rope_scaling``
    (older checkpoints) into a :class:`RopeConfig`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    return RopeConfig(
        theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get("original_max_position_embeddings")
        or hf.get("max_position_embeddings"),
    )


def parse_hf_config(hf: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
    """Build a :class:`ModelConfig` from a ``config.json`` dict."""
    archs = hf.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry")
    try:
        hidden = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        cfg = ModelConfig(
            architecture=archs[0],
            hidden_size=hidden,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            intermediate_size=int(hf["intermediate_size"]),
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(hf),
            max_position_embeddings=hf.get("max_position_embeddings"),
            # Llama's and Qwen's config classes default to untied heads.
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=_eos_ids((generation_config or {}).get("eos_token_id", hf.get("eos_token_id"))),
            bos_token_id=hf.get("bos_token_id"),
            hf=hf,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r}; supported: silu")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"num_attention_heads ({cfg.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({cfg.num_kv_heads})")
    return cfg


def read_model_config(path: str) -> ModelConfig:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional, for EOS ids)."""
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path {path!r} is not a directory (specloop loads local "
                             "Hugging Face-format directories only)")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"model directory {path!r} has no config.json")
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) if os.path.isfile(gen_path) else None
    return parse_hf_config(_read_json(config_path), gen)
