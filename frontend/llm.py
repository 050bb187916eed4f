"""``LLM``: the offline batch API, shaped like vLLM's so scripts can swap it in.

It drives ``EngineCore.step()`` synchronously (no event loop): enqueue every prompt, step until all
are finished, return the outputs in input order.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Sequence

from tqdm.auto import tqdm

from specloop.kernel.engine_core import EngineCore
from specloop.kernel.outputs import EngineCoreOutput
from specloop.kernel.plugins import PluginManager
from specloop.kernel.sampling_params import SamplingParams

from .input_processor import PromptType
from .engine_builder import build_engine, make_config
from .hf_tokenizer import HFTokenizer
from .output_processor import EngineStats, RequestTracker
from .request_output import RequestOutput
from .tokenizer import Tokenizer

Conversation = list[dict[str, Any]]


class LLM:
    """``LLM(model=PATH, **engine_args)``; engine args use vLLM's names (``dtype``, ``max_model_len``,
    ``num_kv_blocks``, ``enable_prefix_caching``, ``speculative_config``, ...). ``model=None``
    loads the embedded default model."""

    def __init__(self, model: str | None = None, *, plugins: PluginManager | None = None,
                 **engine_args: Any) -> None:
        built = build_engine(make_config(model, engine_args), plugins)
        self.config = built.config
        self.core: EngineCore = built.core
        self.tokenizer: Tokenizer | None = built.tokenizer
        self.processor = built.processor
        self.generation_defaults = built.generation_defaults
        self.model_name = built.model_name
        self.stats = EngineStats()
        self._ids = itertools.count()

    def get_tokenizer(self) -> HFTokenizer:
        """The tokenizer with the Hugging Face methods scripts call (``encode``, ``decode``,
        ``batch_decode``, ``apply_chat_template(tokenize=...)``, ``len()``, ...)."""
        if self.tokenizer is None:
            raise ValueError("this engine runs without a tokenizer (skip_tokenizer_init)")
        return HFTokenizer(self.tokenizer)

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's ``generation_config.json`` defaults (what
        ``generate`` uses when given none)."""
        return SamplingParams(**self.generation_defaults)

    def get_metrics(self) -> dict[str, Any]:
        return self.stats.as_dict()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for one prompt or a list of them; ``sampling_params`` is one for all or one per
        prompt. Every prompt is checked before any is enqueued (``ValueError``)."""
        return self._run(self._as_prompt_list(prompts), sampling_params, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this engine runs without one (skip_tokenizer_init)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message,
                                                      chat_template=chat_template, **(chat_template_kwargs or {}))
            # The template writes the special tokens itself (BOS included).
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self._run(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
            raise ValueError(f"prompts must be text, token ids, a prompt dict or a list of them, got "
                             f"{type(prompts).__name__}")
        prompts = list(prompts)
        if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [prompts]  # one prompt given as token ids
        return prompts

    def _run(self, prompts: list[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params) if isinstance(sampling_params, Iterable) and not isinstance(
                sampling_params, (str, bytes, dict)) else [sampling_params]
            if not all(isinstance(p, SamplingParams) for p in params_list):
                raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got "
                                 f"{type(sampling_params).__name__}")
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling params for {len(prompts)} prompts")
        parsed = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                text, ids = self.processor.parse(prompt)
                ids = self.processor.truncate(ids, params)
                self.processor.validate(ids, params)
                grammar = self.processor.compile_grammar(params)
                if grammar is not None:
                    grammar.result()
                salt = self.processor.cache_salt(prompt)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
            parsed.append((text, ids, params, salt))
        states: list[RequestTracker] = []
        owner: dict[str, RequestTracker] = {}
        for text, ids, params, salt in parsed:
            request_id = str(next(self._ids))
            requests = self.processor.make_requests(request_id, ids, params, cache_salt=salt)
            state = RequestTracker(request_id, text, requests, self.tokenizer)
            states.append(state)
            owner.update((r.request_id, state) for r in requests)
            self.core.add_requests(requests)
            self.stats.num_requests_added += len(requests)
        self._step_until_done(owner, len(states), use_tqdm)
        return [state.output() for state in states]

    def _step_until_done(self, owner: dict[str, RequestTracker], total: int, use_tqdm: bool) -> None:
        core = self.core
        bar = tqdm(total=total, desc="Processed prompts", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        generated = 0
        try:
            while core.has_unfinished_requests():
                outputs = core.step()
                core.post_step()
                self.stats.record_step(outputs.scheduler_stats)
                by_state: dict[int, tuple[RequestTracker, list[EngineCoreOutput]]] = {}
                for out in outputs.outputs:
                    state = owner.get(out.req_id)
                    if state is not None:
                        by_state.setdefault(id(state), (state, []))[1].append(out)
                        generated += len(out.new_token_ids)
                for state, outs in by_state.values():
                    to_abort = state.process(outs)
                    if to_abort:
                        core.abort_requests(to_abort)
                    if state.finished:
                        for rid in state.child_ids:
                            owner.pop(rid, None)
                        self.stats.record_finished(state)
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / max(bar.format_dict['elapsed'], 1e-9):.1f} tok/s",
                                            refresh=False)
        except BaseException:
            # Interrupted (e.g. Ctrl-C): leave the engine clean for the next call.
            core.abort_requests(list(owner))
            raise
        finally:
            bar.close()
