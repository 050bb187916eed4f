"""Engine configuration: one flat dataclass with vLLM's engine-arg names, plus the speculative config."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class SpeculativeConfig:
    """``speculative_config`` as vLLM spells it. Set by the user; read by the runner's proposer."""

    method: str
    num_speculative_tokens: int
    model: str | None = None  # draft model / head checkpoint directory (mtp: default the target's)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    draft_dtype: str | None = None
    token_map: str | None = None  # a file of the token ids mtp / eagle may draft (proposers.draft_vocab)
    policy: str = "fixed"  # how many drafts each request gets per step (a registered speculation policy)
    # Resolved by the model runner from its proposer: it builds a cache from the target's hidden state at
    # every position, so a prefix-cache hit must leave its last block to be recomputed (the proposer's entry
    # for the hit's last position needs the state of that position and the token after it, this request's).
    reads_target_hidden_states: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.num_speculative_tokens, int) or not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, 16], "
                             f"got {self.num_speculative_tokens!r}")
        if self.method == "ngram":
            lo = self.prompt_lookup_min if self.prompt_lookup_min is not None else 1
            hi = self.prompt_lookup_max if self.prompt_lookup_max is not None else max(lo, 4)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                 f"got {lo!r}, {hi!r}")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi

    @classmethod
    def from_any(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """Accept a config, a dict, or a JSON string (the CLI form)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        value = dict(value)
        if "method" not in value:
            raise ValueError("speculative_config needs 'method', a registered proposer (e.g. ngram, draft_model)")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {', '.join(sorted(known))} "
                             "(options for a third-party proposer go in 'extra')")
        return cls(**value)


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes one engine. Set by the user (LLM(...), CLI flags); after
    ``specloop_configure`` the engine treats it as read-only, except the fields marked 'resolved'."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available, else cpu
    seed: int = 0
    max_model_len: int | None = None  # resolved from the model's config when None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # resolved: 8192, at least max_model_len without chunking
    long_prefill_token_threshold: int = 0  # 0: no per-request cap beyond the budget
    block_size: int = 16
    num_kv_blocks: int | None = None  # resolved by the runner from the memory budget when None
    kv_cache_memory: int | None = None  # bytes for the KV cache
    gpu_memory_utilization: float | None = None  # None: 0.9 on CUDA, a fixed KV budget on CPU
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduler: str = "fcfs"
    kv_cache_policy: str = "lru"
    attention_backend: str | None = None  # None: the runner's default for the device
    model_runner: str | None = None  # None: "auto", whichever runner the device calls for
    # Plan step n+1 while step n runs (with drafts: steps without); None: on for CUDA. Resolved.
    async_scheduling: bool | None = None
    skip_tokenizer_init: bool = False
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    enforce_eager: bool = False
    batch_invariant: bool = False  # a token's logits independent of its step's batch (GPU runner)
    # Ranks that split each layer's weights (one process each; spawned, or started by torchrun).
    tensor_parallel_size: int = 1
    # Engine replicas behind one endpoint (the frontend's router; each replica tensor_parallel_size ranks).
    data_parallel_size: int = 1
    structured_outputs_backend: str = "llguidance"
    tool_call_parser: str = "hermes"  # finds tool calls in text for tool_choice "auto" (serve)
    generation_config: str = "auto"  # auto: the model's generation_config.json sampling defaults; vllm: none
    disable_plugins: tuple[str, ...] = ()
    # Free-form options for third-party components, read by name.
    plugin_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        optional = ("max_model_len", "max_num_batched_tokens", "num_kv_blocks", "kv_cache_memory")
        for name in ("max_num_seqs", "block_size", "tensor_parallel_size", "data_parallel_size", *optional):
            v = getattr(self, name)
            if (v is not None or name not in optional) and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        off = self.disable_plugins
        self.disable_plugins = tuple(p for p in off.split(",") if p) if isinstance(off, str) else tuple(off)

    @property
    def num_lookahead_tokens(self) -> int:
        spec = self.speculative_config
        return spec.num_speculative_tokens if isinstance(spec, SpeculativeConfig) else 0

    def resolve(self, model_max_len: int | None) -> None:
        """Fill the lengths that depend on the model. Called once, by the engine, after loading."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len or 2048
        elif model_max_len is not None and self.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={self.max_model_len} is larger than the model's "
                             f"max_position_embeddings={model_max_len}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 8192 if self.enable_chunked_prefill else max(8192, self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len})")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
