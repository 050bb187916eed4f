"""Building an engine for the frontends: config, model path, tokenizer, the engine's EOS ids, core
and input processor. Everything resolved here is resolved once, for the engine's lifetime."""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from specloop.kernel.config import EngineConfig
from specloop.kernel.engine_core import EngineCore
from specloop.kernel.plugins import PluginManager
from specloop.plugins.options import check_namespaces

from .input_processor import InputProcessor
from .model_path import resolve_model
from .tokenizer import Tokenizer, read_generation_defaults, read_generation_eos_ids


def make_config(model: str | None, engine_args: dict[str, Any]) -> EngineConfig:
    """``EngineConfig`` from vLLM-style keyword arguments, with a clear error for unknown ones."""
    known = set(EngineConfig.field_names())
    unknown = sorted(set(engine_args) - known)
    if unknown:
        raise TypeError(f"unknown engine argument(s) {unknown}; known: {', '.join(sorted(known))}")
    if "model" in engine_args:
        raise TypeError("pass the model once, as the first argument")
    return EngineConfig(model=model, **engine_args)


def _runner_requires_model(config: EngineConfig, plugins: PluginManager) -> bool:
    name = config.model_runner
    if name and name in plugins.model_runners:
        return bool(getattr(plugins.model_runners.get(name), "requires_model", True))
    return True


def resolve_eos_token_ids(tokenizer: Tokenizer | None, model_dir: str | None) -> tuple[int, ...]:
    """The engine's EOS ids: the tokenizer's (its ``eos_token`` first), then the model directory's
    ``generation_config.json`` ids (``config.json``'s when it has none), without duplicates.

    Every request carries them (``Request.eos_token_ids``): the scheduler stops on them and the
    runner masks them while ``min_tokens`` is not reached.
    """
    ids = list(tokenizer.eos_token_ids) if tokenizer is not None else []
    for tid in read_generation_eos_ids(model_dir):
        if tid not in ids:
            ids.append(tid)
    return tuple(ids)


@dataclass(slots=True)
class BuiltEngine:
    """What both frontends need. Set by :func:`build_engine`."""

    config: EngineConfig  # resolved (max_model_len and the KV cache size filled in)
    core: EngineCore | None  # None when the core runs in its own process
    tokenizer: Tokenizer | None  # None when the engine runs without one
    processor: InputProcessor  # holds the engine's EOS ids and puts them on every request
    model_name: str
    vocab_size: int
    # This process's plugins (the core's when it runs here): the server's routes and tool parsers.
    plugins: PluginManager
    # The model's generation_config.json sampling defaults (SamplingParams fields), unless turned off.
    generation_defaults: dict[str, Any] = field(default_factory=dict)


def build_engine(config: EngineConfig, plugins: PluginManager | None = None,
                 start_core: Callable[[EngineConfig], tuple[EngineConfig, int]] | None = None) -> BuiltEngine:
    """Resolve the model and tokenizer directories, load the tokenizer, resolve the EOS ids, then
    build the core (which loads the model) and the input processor. ``start_core(config)``, when
    given, starts the core elsewhere instead and returns the resolved config and vocabulary size."""
    if config.data_parallel_size > 1:
        raise ValueError("data_parallel_size > 1 runs several engines behind a router: use `specloop serve "
                         "--data-parallel-size N` or frontend.data_parallel.DataParallelEngine")
    if config.gpu_memory_utilization is not None and (config.num_kv_blocks or config.kv_cache_memory):
        given = "num_kv_blocks" if config.num_kv_blocks else "kv_cache_memory"
        raise ValueError(f"gpu_memory_utilization has no effect when {given} sizes the KV cache; give one of them")
    plugins = plugins or PluginManager(disable=config.disable_plugins)
    check_namespaces(config, plugins)
    if config.model is not None or _runner_requires_model(config, plugins):
        config.model = resolve_model(config.model)
    tokenizer: Tokenizer | None = None
    tokenizer_dir = config.tokenizer or config.model
    if not config.skip_tokenizer_init and tokenizer_dir is not None:
        tokenizer = Tokenizer(resolve_tokenizer(tokenizer_dir))
    eos_token_ids = resolve_eos_token_ids(tokenizer, config.model)
    core: EngineCore | None = None
    if start_core is None:
        core = EngineCore(config, plugins)
        vocab_size, structured = core.runner.vocab_size, core.structured_output
    else:
        config, vocab_size = start_core(config)
        # The core compiles grammars in its own process; this one checks them before sending.
        structured = plugins.structured_output_backends.create(config.structured_outputs_backend, config=config,
                                                               vocab_size=vocab_size)
    processor = InputProcessor(config, tokenizer, vocab_size, eos_token_ids, structured)
    if config.tool_call_parser not in plugins.tool_parsers:
        raise ValueError(f"unknown tool_call_parser {config.tool_call_parser!r}; registered: "
                         f"{', '.join(plugins.tool_parsers.names()) or 'none'}")
    if config.generation_config not in ("auto", "vllm"):
        raise ValueError(f"generation_config must be 'auto' or 'vllm', got {config.generation_config!r}")
    defaults = read_generation_defaults(config.model) if config.generation_config == "auto" else {}
    return BuiltEngine(config, core, tokenizer, processor, model_name(config), vocab_size, plugins, defaults)


def freeze_heap() -> None:
    """Collect, then move every live object to the garbage collector's permanent generation, so that
    a full collection never traverses the engine's long-lived objects again: after start-up a
    process holds some 300,000 of them (modules, torch's operator tables, the model), and a full
    collection over them is a pause of 0.1-0.2 s in the middle of a step. For a process that keeps
    its engine to the end (the engine process, a benchmark): frozen objects that form reference
    cycles are never freed, until ``gc.unfreeze()``."""
    gc.collect()
    gc.freeze()


def resolve_tokenizer(path: str) -> str:
    expanded = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(expanded):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    return expanded


def model_name(config: EngineConfig) -> str:
    """The model directory's basename (what the API reports), or the runner's name without a model."""
    if config.model:
        return os.path.basename(os.path.normpath(config.model))
    return config.model_runner or "specloop"
