"""Every hook specloop calls, grouped by phase.

Two kinds of hooks:

* **register hooks** (``specloop_register_*``) fire once per engine, while its ``PluginManager`` is
  built. Each receives ``register(name, factory)`` for one component kind; the engine later picks
  one factory by name from its config and calls the component directly, not through pluggy.
* **event hooks** fire once per engine, per step or per request batch, never per token. Every
  implementation is called (none is ``firstresult``) and return values are ignored unless stated.

Implementations may accept any subset of the documented arguments (pluggy passes by keyword), so
new arguments can be added without breaking plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    from .config import EngineConfig
    from .outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
    from .request import Request

hookspec = pluggy.HookspecMarker("specloop")
hookimpl = pluggy.HookimplMarker("specloop")

Register = Callable[..., None]


# --- registration: once per plugin manager ---------------------------------------------------

@hookspec
def specloop_register_schedulers(register: Register) -> None:
    """Contribute schedulers. Fires once while the engine's plugin manager is built.

    :param register: ``register(name, factory)``; ``factory(config: EngineConfig, kv_cache)`` returns
        an object implementing :class:`specloop.kernel.protocols.Scheduler`. Selected by
        ``EngineConfig.scheduler``."""


@hookspec
def specloop_register_kv_cache_policies(register: Register) -> None:
    """Contribute KV-cache policies (block pool, prefix cache, eviction). Fires once while the engine's plugin
    manager is built.

    :param register: ``register(name, factory)``; ``factory(config: EngineConfig, num_blocks: int)``
        returns a :class:`specloop.kernel.protocols.KVCacheManager`. Selected by
        ``EngineConfig.kv_cache_policy``."""


@hookspec
def specloop_register_attention_backends(register: Register) -> None:
    """Contribute attention backends. Fires once while the engine's plugin manager is built.

    :param register: ``register(name, factory)``; ``factory(config: EngineConfig)`` returns an
        attention backend, an object the model runner that selects it knows how to call.
        Selected by ``EngineConfig.attention_backend``."""


@hookspec
def specloop_register_model_runners(register: Register) -> None:
    """Contribute model runners (executors). Fires once while the engine's plugin manager is built.

    :param register: ``register(name, factory)``; ``factory(config: EngineConfig, plugins:
        PluginManager)`` returns a :class:`specloop.kernel.protocols.ModelRunner`. Selected by
        ``EngineConfig.model_runner``."""


@hookspec
def specloop_register_models(register: Register) -> None:
    """Contribute model architectures. Fires once while the engine's plugin manager is built.

    :param register: ``register(name, factory)``; ``name`` is a Hugging Face ``architectures`` entry
        (e.g. ``"Qwen3ForCausalLM"``) and ``factory(hf_config: dict, ...)`` builds the ``nn.Module``."""


@hookspec
def specloop_register_proposers(register: Register) -> None:
    """Contribute speculative-decoding proposers. Fires once while the engine's plugin manager is built.

    :param register: ``register(name, factory)``; ``name`` is a ``speculative_config["method"]``
        and ``factory(config: EngineConfig, context: ProposerContext)`` returns a proposer. The
        context (``specloop.proposers.base.ProposerContext``) is a typed view of what the target
        model offers a proposer (device, dtype, model config, embedding and head, hidden-state
        taps), never the runner itself."""


@hookspec
def specloop_register_speculation_policies(register: Register) -> None:
    """Contribute speculation policies: how many drafts each request gets per step. Fires once while the
    engine's plugin manager is built.

    :param register: ``register(name, factory)``; ``name`` is a ``speculative_config["policy"]``
        (built-in: ``"fixed"``, the default, and ``"adaptive"``) and ``factory(config: EngineConfig)``
        returns a ``specloop.proposers.policy.SpeculationPolicy``, which the model runner asks
        every step for each request's draft count (0 turns speculation off for it) and tells what
        the step cost and what was accepted."""


@hookspec
def specloop_register_structured_output_backends(register: Register) -> None:
    """Contribute structured-output backends. Fires once while the plugin manager is built.

    :param register: ``register(name, factory)``; ``factory(config, vocab_size)`` returns a
        ``StructuredOutputManager``. Selected by ``EngineConfig.structured_outputs_backend``."""


@hookspec
def specloop_register_tool_parsers(register: Register) -> None:
    """Contribute tool-call parsers. Fires once while the plugin manager is built.

    :param register: ``register(name, factory)``; ``factory()`` returns a ``ToolParser``
        (``frontend/tool_parsers.py``). Selected by ``EngineConfig.tool_call_parser``."""


@hookspec
def specloop_register_routes(register: Register) -> None:
    """Contribute HTTP routes to ``specloop serve``. Fires once while the engine's plugin manager is built;
    the server calls every factory when it builds its app (the built-in endpoints are registered this way
    too).

    :param register: ``register(name, factory)``; ``factory(state)`` returns a
        ``starlette.routing.BaseRoute``; ``state`` is the server's state object (the engine, the
        served model names, the limits and the metrics)."""


# --- lifecycle: once per engine ---------------------------------------------------------------

@hookspec
def specloop_configure(config: EngineConfig) -> None:
    """Adjust the configuration before any component is built. Fires once per engine, after the plugin manager
    is built and before the model runner, KV-cache policy and scheduler are created. Implementations may
    mutate ``config``.

    :param config: the engine's configuration."""


@hookspec
def specloop_startup(engine: Any) -> None:
    """The engine is built and about to serve its first request. Fires once per engine, after every component
    exists.

    :param engine: the :class:`specloop.kernel.engine_core.EngineCore`."""


@hookspec
def specloop_shutdown(engine: Any) -> None:
    """The engine is shutting down. Fires once per engine, before the model runner is released.

    :param engine: the :class:`specloop.kernel.engine_core.EngineCore`."""


# --- requests: once per batch of requests ----------------------------------------------------

@hookspec
def specloop_request_added(requests: list[Request]) -> None:
    """Requests entered the scheduler's waiting queue. Fires once per drained input batch, with every request
    added in it.

    :param requests: the new requests."""


@hookspec
def specloop_request_preempted(requests: list[Request], step_id: int) -> None:
    """Requests lost their KV blocks and went back to waiting (they will be recomputed). Fires at most once
    per step, with every request preempted while scheduling it.

    :param requests: the preempted requests.
    :param step_id: the step whose scheduling preempted them."""


@hookspec
def specloop_request_finished(requests: list[Request]) -> None:
    """Requests finished (stopped, reached a length limit, were aborted or failed). Fires at most once per
    step and once per drained abort batch, with every request finished in it; ``request.status`` says how
    each ended.

    :param requests: the finished requests."""


# --- steps: once per engine step -------------------------------------------------------------

@hookspec
def specloop_step_scheduled(plan: SchedulerOutput) -> None:
    """The scheduler produced a plan; the model runner has not run it yet. Fires once per non-empty step.

    :param plan: the immutable :class:`SchedulerOutput`."""


@hookspec
def specloop_step_finished(plan: SchedulerOutput, result: ModelRunnerOutput, outputs: EngineCoreOutputs,
                           timings: dict[str, float]) -> None:
    """A step was executed and committed. Fires once per non-empty step, after ``update_from_output``.

    :param plan: the step's plan.
    :param result: the model runner's result for that plan.
    :param outputs: what the step emitted, with ``outputs.scheduler_stats``.
    :param timings: seconds spent in ``schedule``, ``execute`` (forward + sampling + proposing),
        ``update`` and ``total``."""


@hookspec
def specloop_drafts_verified(step_id: int, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                             accepted_per_position: list[int]) -> None:
    """Draft tokens were verified by the target model in this step. Fires once per step that verified at least
    one draft.

    :param step_id: the step.
    :param num_drafts: requests whose drafts were verified.
    :param num_draft_tokens: draft tokens verified.
    :param num_accepted_tokens: of which accepted.
    :param accepted_per_position: ``accepted_per_position[i]`` counts requests whose draft ``i`` was
        accepted."""
