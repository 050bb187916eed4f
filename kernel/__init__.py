"""specloop's microkernel: the busy loop, request state machine, hookspecs, plugin manager and the typed contracts
between components.

Not to be confused with ``specloop.kernels`` (plural), which holds the Triton GPU kernels. This package imports no
torch and no model code, so it can be read in one sitting and tested without a model."""

from .config import EngineConfig, SpeculativeConfig
from .engine_core import AsyncEngineCore, EngineCore, EngineDeadError
from .hookspecs import hookimpl, hookspec
from .outputs import (CachedRequestData, DraftTokenIds, EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput,
                      NewRequestData, SchedulerOutput, SchedulerStats, SpecDecodingStats, TokenLogprobs)
from .plugins import PluginManager, Registry, UnknownComponentError, builtin_plugin_names
from .protocols import KVCacheManager, ModelRunner, Scheduler
from .request import FinishReason, Request, RequestStatus
from .sampling_params import SamplingParams

__all__ = [
    "AsyncEngineCore", "CachedRequestData", "DraftTokenIds", "EngineConfig", "EngineCore", "EngineCoreOutput",
    "EngineCoreOutputs", "EngineDeadError", "FinishReason", "KVCacheManager", "ModelRunner", "ModelRunnerOutput",
    "NewRequestData", "PluginManager", "Registry", "Request", "RequestStatus", "SamplingParams", "Scheduler",
    "SchedulerOutput", "SchedulerStats", "SpecDecodingStats", "SpeculativeConfig", "TokenLogprobs",
    "UnknownComponentError", "builtin_plugin_names", "hookimpl", "hookspec",
]
