"""What specloop reads from a Hugging Face model directory's JSON files (torch-free).

The frontend uses :func:`read_model_config` for EOS ids and lengths without loading weights; the
loader and the model classes use it to size layers, the KV cache and the rotary embedding.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
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


_REQUIRED = object()


def _number(hf: dict[str, Any], name: str, kind: type, default: Any, source: str) -> Any:
    """``hf[name]`` checked to be a ``kind`` (an int also passes as a float; a bool as neither)."""
    value = hf.get(name, default) if default is not _REQUIRED else hf.get(name, _REQUIRED)
    if value is _REQUIRED:
        raise ModelLoadError(f"{source} lacks required field {name!r}")
    if value is None and default is None:
        return None
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok or isinstance(value, bool):
        raise ModelLoadError(f"{source}: field {name!r} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}")
    return kind(value)


def _size(hf: dict[str, Any], name: str, source: str, default: Any = _REQUIRED) -> int:
    value = _number(hf, name, int, default, source)
    if value is not None and value < 1:
        raise ModelLoadError(f"{source}: field {name!r} must be >= 1, got {value}")
    return value


def _eos_ids(value: Any, source: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = [value] if not isinstance(value, list) else value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        raise ModelLoadError(f"{source}: field 'eos_token_id' must be an integer or a list of integers, got {value!r}")
    return tuple(ids)


def parse_rope(hf: dict[str, Any], source: str = "config.json") -> RopeConfig:
    """Normalise ``rope_parameters`` (current transformers) or ``rope_theta`` + ``rope_scaling``
    (older checkpoints) into a :class:`RopeConfig`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params is None:
        params = dict(hf.get("rope_scaling") or {})
        params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if not isinstance(params, dict):
        raise ModelLoadError(f"{source}: field 'rope_parameters' / 'rope_scaling' must be an object, got {params!r}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported RoPE scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    where = f"{source} (rope parameters)"
    return RopeConfig(
        theta=_number(params, "rope_theta", float, _number(hf, "rope_theta", float, 10000.0, source), where),
        rope_type=rope_type,
        factor=_number(params, "factor", float, 1.0, where),
        low_freq_factor=_number(params, "low_freq_factor", float, 1.0, where),
        high_freq_factor=_number(params, "high_freq_factor", float, 4.0, where),
        original_max_position_embeddings=_number(params, "original_max_position_embeddings", int, None, where)
        or _number(hf, "max_position_embeddings", int, None, source),
    )


def parse_hf_config(hf: dict[str, Any], generation_config: dict[str, Any] | None = None, *,
                    source: str = "config.json", generation_source: str = "generation_config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a ``config.json`` dict; every problem is a
    :class:`ModelLoadError` naming the file (``source``) and the field."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise ModelLoadError(f"{source} has no 'architectures' entry (a list of class names)")
    hidden = _size(hf, "hidden_size", source)
    num_heads = _size(hf, "num_attention_heads", source)
    tie = hf.get("tie_word_embeddings", False)  # Llama's and Qwen's config classes default to untied heads
    if not isinstance(tie, bool):
        raise ModelLoadError(f"{source}: field 'tie_word_embeddings' must be true or false, got {tie!r}")
    eos = (generation_config or {}).get("eos_token_id")
    cfg = ModelConfig(
        architecture=archs[0],
        hidden_size=hidden,
        num_layers=_size(hf, "num_hidden_layers", source),
        num_heads=num_heads,
        num_kv_heads=_size(hf, "num_key_value_heads", source, None) or num_heads,
        head_dim=_size(hf, "head_dim", source, None) or hidden // num_heads,
        intermediate_size=_size(hf, "intermediate_size", source),
        vocab_size=_size(hf, "vocab_size", source),
        rms_norm_eps=_number(hf, "rms_norm_eps", float, 1e-6, source),
        rope=parse_rope(hf, source),
        max_position_embeddings=_size(hf, "max_position_embeddings", source, None),
        tie_word_embeddings=tie,
        eos_token_ids=_eos_ids(eos, generation_source) if eos is not None else _eos_ids(hf.get("eos_token_id"), source),
        bos_token_id=hf.get("bos_token_id"),
        hf=hf,
    )
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
    return parse_hf_config(_read_json(config_path), gen, source=config_path, generation_source=gen_path)
