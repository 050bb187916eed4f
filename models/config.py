"""What specloop reads from a Hugging Face model directory's JSON files (torch-free).

The frontend uses :func:`read_model_config` for EOS ids and lengths without loading weights; the
loader and the model classes use it to size layers, the KV cache and the rotary embedding.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    # yarn only: the ramp between interpolated and extrapolated frequencies, and the magnitude
    # correction of cos/sin (``attention_factor``, else derived from ``mscale`` / ``mscale_all_dim``).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @property
    def cos_sin_scale(self) -> float:
        """What YaRN multiplies the rotary tables by (1 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True, slots=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention. Per token and layer the cache keeps the normalised
    latent ``c_kv`` (``kv_lora_rank``) and the rotary key shared by all heads (``qk_rope_head_dim``)."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the checkpoint's rotary dims are (x0, x1), (x2, x3), ... pairs

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self, rope: RopeConfig) -> float:
        """``1/sqrt(qk head dim)``, times YaRN's ``mscale(factor, mscale_all_dim)**2`` (a scaled
        rotary table changes the logits' magnitude; DeepSeek corrects it in the softmax)."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if rope.rope_type != "default" and rope.mscale_all_dim:
            m = yarn_mscale(rope.factor, rope.mscale_all_dim)
            scale *= m * m
        return scale


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """DeepSeek's mixture of experts: routed experts plus always-on shared ones."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    num_shared_experts: int  # one dense MLP of num_shared_experts * intermediate_size
    first_dense_layers: int  # layers before this index have a dense MLP instead
    layer_freq: int  # and after it, every layer_freq-th layer is MoE
    scoring: str  # "sigmoid" (V3) or "softmax" (V2)
    # "noaux_tc" (V3: bias-corrected choice, groups ranked by their top-2 sum), "group_limited_greedy"
    # (V2: groups ranked by their best expert) or "greedy" (no groups).
    topk_method: str
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_dense_layers and layer_idx % self.layer_freq == 0


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
    mla: MLAConfig | None = None  # set for DeepSeek-V2/V3: the cache holds latents, not K/V
    moe: MoEConfig | None = None
    num_mtp_layers: int = 0  # DeepSeek's multi-token-prediction layers after the last decoder layer
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

    def kv_cache_shape(self, backend: Any, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache tensor, laid out by the attention ``backend``."""
        if self.mla is not None:
            return backend.latent_cache_shape(num_blocks, block_size, self.mla.latent_dim)
        return backend.kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_block(self, block_size: int, dtype_size: int) -> int:
        """Bytes one paged-KV block takes across all layers (K and V, or MLA's latent)."""
        per_token = self.mla.latent_dim if self.mla is not None else 2 * self.num_kv_heads * self.head_dim
        return self.num_layers * block_size * per_token * dtype_size


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
        factor=_number(params, "factor", float, None, where) or _yarn_default_factor(hf, params, rope_type),
        low_freq_factor=_number(params, "low_freq_factor", float, 1.0, where),
        high_freq_factor=_number(params, "high_freq_factor", float, 4.0, where),
        original_max_position_embeddings=_number(params, "original_max_position_embeddings", int, None, where)
        or _number(hf, "max_position_embeddings", int, None, source),
        beta_fast=_number(params, "beta_fast", float, None, where) or 32.0,
        beta_slow=_number(params, "beta_slow", float, None, where) or 1.0,
        mscale=_number(params, "mscale", float, None, where),
        mscale_all_dim=_number(params, "mscale_all_dim", float, None, where),
        attention_factor=_number(params, "attention_factor", float, None, where),
        truncate=bool(params.get("truncate", True)),
    )


def _yarn_default_factor(hf: dict[str, Any], params: dict[str, Any], rope_type: str) -> float:
    """YaRN without ``factor`` stretches ``original_max_position_embeddings`` to the model's length."""
    original = params.get("original_max_position_embeddings")
    if rope_type == "yarn" and original and hf.get("max_position_embeddings"):
        return hf["max_position_embeddings"] / original
    return 1.0


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
    try:
        mla = parse_mla(hf) if "kv_lora_rank" in hf else None
        moe = parse_moe(hf, archs[0]) if hf.get("n_routed_experts") else None
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: {e}") from None
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
        mla=mla,
        moe=moe,
        num_mtp_layers=_number(hf, "num_nextn_predict_layers", int, 0, source) or 0,
        hf=hf,
    )
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported hidden_act {hf['hidden_act']!r}; supported: silu")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ModelLoadError(f"num_attention_heads ({cfg.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({cfg.num_kv_heads})")
    return cfg


def parse_mla(hf: dict[str, Any]) -> MLAConfig:
    q_lora = hf.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(hf["kv_lora_rank"]),
        qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
        qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
        v_head_dim=int(hf["v_head_dim"]),
        # DeepSeek-V2 always stores interleaved pairs; V3 says so (transformers' default: true).
        rope_interleave=bool(hf.get("rope_interleave", True)),
    )


def parse_moe(hf: dict[str, Any], architecture: str) -> MoEConfig:
    """Routing defaults follow the architecture when ``config.json`` leaves them out, as
    transformers does: V3 scores with a sigmoid and picks with the correction bias (``noaux_tc``),
    V2 with a softmax (``greedy`` unless it names ``group_limited_greedy``)."""
    v3 = architecture != "DeepseekV2ForCausalLM"
    scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    if scoring not in ("sigmoid", "softmax"):
        raise ModelLoadError(f"unsupported MoE scoring_func {scoring!r}; supported: sigmoid, softmax")
    if method not in ("noaux_tc", "group_limited_greedy", "greedy"):
        raise ModelLoadError(f"unsupported MoE topk_method {method!r}; supported: noaux_tc, "
                             "group_limited_greedy, greedy")
    num_experts = int(hf["n_routed_experts"])
    groups = int(hf.get("n_group") or 1)
    if num_experts % groups:
        raise ModelLoadError(f"n_routed_experts ({num_experts}) must be a multiple of n_group ({groups})")
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(hf["num_experts_per_tok"]),
        intermediate_size=int(hf["moe_intermediate_size"]),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        first_dense_layers=int(hf.get("first_k_dense_replace") or 0),
        layer_freq=int(hf.get("moe_layer_freq") or 1),
        scoring=scoring,
        topk_method=method,
        num_groups=groups,
        topk_groups=int(hf.get("topk_group") or groups),
        norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
    )


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
