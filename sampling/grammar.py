"""The structured-output manager: each constrained request's grammar, from compilation to commit.

Where it sits in a step (``specloop.kernel.engine_core.EngineCore.step``)::

    take_ready()            requests whose grammar compiled join the scheduler
    schedule()              the plan
    execute_model(plan)     the forward is launched
    grammar_bitmask(plan)   the plan's masks, filled while the forward runs: one row per structured
                            request that samples, plus one per draft it verifies (the mask after
                            each draft, which the matcher consumes and rolls back)
    sample_tokens(bitmask)  the runner masks those rows before sampling and verification
    update_from_output()    the scheduler commits tokens
    commit(outputs)         each matcher consumes exactly the committed tokens

A matcher only ever holds committed tokens: drafts are consumed and rolled back while the masks are
filled, rejected drafts never reach it, and a preempted request keeps its committed tokens (and so
its matcher) when it is recomputed. The order above is the synchronous step's; with asynchronous
scheduling the previous plan's ``commit`` must still come before the next plan's
``grammar_bitmask`` (``docs/structured_outputs.md`` says how).

Grammars compile on a small thread pool, never on the step thread; a request waits in
``WAITING_FOR_GRAMMAR`` outside the scheduler until its grammar is ready. Compiled grammars are
cached by :attr:`StructuredOutputsParams.key` (least recently used out), and the frontend compiles
through the same cache to refuse an invalid schema before the request is enqueued.

The manager is generic over a :class:`GrammarBackend` (a grammar engine); the built-in one is
``specloop.sampling.llguidance_backend``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable, Protocol, Sequence

import numpy as np

from specloop.kernel.outputs import EngineCoreOutput, EngineCoreOutputs, SchedulerOutput
from specloop.kernel.request import FinishReason, Request, RequestStatus

from .structured_outputs import GrammarBitmask

if TYPE_CHECKING:
    from .structured_outputs import StructuredOutputsParams

logger = logging.getLogger("specloop")


class GrammarBackend(Protocol):
    """A grammar engine, as the manager calls it."""

    def compile(self, params: StructuredOutputsParams, eos_token_ids: tuple[int, ...]) -> Any:
        """A compiled grammar (called on a compile thread); ``ValueError`` naming what is wrong."""

    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the grammar's start."""

    def fill_bitmask(self, bitmask: np.ndarray, items: Sequence[tuple[Any, int, list[int]]]) -> None:
        """For each ``(matcher, row, drafts)``: row ``row`` gets the matcher's next-token mask and
        row ``row + 1 + j`` the mask after ``drafts[:j + 1]``, up to the first draft the grammar
        refuses; the matcher is left as it was."""

    def accept(self, matcher: Any, token_ids: list[int]) -> bool:
        """Advance by committed tokens; False when the grammar refuses one."""

    # Optional: ``accept_many(items) -> refused`` advances many ``(matcher, tokens)`` at once and
    # returns, per item, whether the grammar refused a token (the built-in backend consumes single
    # tokens on its own threads, without the GIL); the manager uses it when present.


class StructuredOutputs:
    """Implements :class:`specloop.kernel.protocols.StructuredOutputManager` over a grammar backend.

    :param vocab_size: the model's vocabulary (the bitmask's width).
    """

    WAIT_S = 0.05  # how long an idle step waits for a compilation to finish

    def __init__(self, backend: GrammarBackend, vocab_size: int, *, compile_threads: int = 2,
                 cache_size: int = 512) -> None:
        self.backend = backend
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(compile_threads, "specloop-grammar")
        self._cache: OrderedDict[tuple[Any, ...], concurrent.futures.Future[Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._pending: dict[str, tuple[Request, concurrent.futures.Future[Any]]] = {}
        self._requests: dict[str, Request] = {}  # admitted to the scheduler, with a matcher
        self.matchers: dict[str, Any] = {}

    # --- compilation (any thread) ---------------------------------------------------------

    def compile(self, params: StructuredOutputsParams, eos_token_ids: Sequence[int]) -> concurrent.futures.Future[Any]:
        """The compiled grammar for ``params``, from the cache or a compile thread. Its
        ``result()`` raises ``ValueError`` for a schema, regex or grammar the backend refuses."""
        eos = tuple(eos_token_ids)
        key = (*params.key, eos)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self.backend.compile, params, eos)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return future

    def allows_first(self, compiled: Any, token_ids: Sequence[int]) -> bool:
        """Whether the grammar lets its first token be one of ``token_ids``."""
        bitmask = np.full((1, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        self.backend.fill_bitmask(bitmask, [(self.backend.matcher(compiled), 0, [])])
        ids = np.asarray([t for t in token_ids if 0 <= t < self.vocab_size], dtype=np.int64)
        return bool(((bitmask[0].view(np.uint32)[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1).any())

    # --- the engine's calls (the step thread) ---------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        future = self.compile(request.sampling_params.structured_outputs, request.eos_token_ids)
        self._pending[request.request_id] = (request, future)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def has_active(self) -> bool:
        """Whether a constrained request is in the scheduler (its next mask needs every token before)."""
        return bool(self.matchers)

    def take_ready(self, wait: bool) -> tuple[list[Request], list[EngineCoreOutput]]:
        """Requests whose grammar compiled (now ``WAITING``, for the scheduler), and the outputs
        finishing those whose grammar failed; with ``wait``, blocks up to :attr:`WAIT_S` for a
        compilation to finish (an idle engine would otherwise spin)."""
        if not self._pending:
            return [], []
        if wait:
            concurrent.futures.wait([f for _, f in self._pending.values()], timeout=self.WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = [], []
        for rid, (request, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[rid]
            error = future.exception()
            if error is not None:
                request.status = RequestStatus.FINISHED_ABORTED  # the request's error, not the engine's
                failed.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ABORT,
                                               error=f"structured_outputs: {error}"))
                continue
            self.matchers[rid] = self.backend.matcher(future.result())
            self._requests[rid] = request
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready, failed

    def grammar_bitmask(self, plan: SchedulerOutput) -> GrammarBitmask | None:
        if not self.matchers:
            return None
        req_ids, num_rows, items, row = [], [], [], 0
        for rid in plan.num_scheduled_tokens:
            matcher = self.matchers.get(rid)
            if matcher is None:
                continue
            request = self._requests[rid]
            drafts = list(plan.scheduled_spec_decode_tokens.get(rid, ()))
            # The plan counts every scheduled position as computed: it samples when that reaches
            # the end of its tokens and drafts (a partial prefill chunk samples nothing).
            if request.num_computed_tokens != request.num_tokens + len(drafts):
                continue
            req_ids.append(rid)
            num_rows.append(len(drafts) + 1)
            items.append((matcher, row, drafts))
            row += len(drafts) + 1
        if not items:
            return None
        bitmask = np.full((row, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        self.backend.fill_bitmask(bitmask, items)
        return GrammarBitmask(req_ids, num_rows, bitmask)

    def commit(self, outputs: EngineCoreOutputs) -> dict[str, str]:
        """Advance the matchers by the step's committed tokens. Returns, per request whose grammar
        refused one, why: the kernel finishes it with that error, without the step's tokens."""
        advance = []
        for out in outputs.outputs:
            matcher = self.matchers.get(out.req_id)
            if matcher is not None and out.new_token_ids:
                advance.append((out.req_id, matcher, list(out.new_token_ids)))
        accept_many = getattr(self.backend, "accept_many", None)
        if accept_many is not None:
            refused = accept_many([(m, tokens) for _, m, tokens in advance])
        else:
            refused = [not self.backend.accept(m, tokens) for _, m, tokens in advance]
        errors = {}
        for (rid, _, tokens), bad in zip(advance, refused):
            if bad:
                # The mask allows only what the grammar does, so every token was masked: the
                # request's allowed_token_ids, logit_bias, bad_words or min_tokens left none the
                # grammar allows (the sampler then takes token 0), or the backend disagrees with its
                # own mask.
                generated = self._requests[rid].num_output_tokens - len(tokens)
                errors[rid] = (f"structured_outputs: after {generated} generated tokens the request's other "
                               "constraints (allowed_token_ids, logit_bias, bad_words, min_tokens) left no token "
                               "the grammar allows")
                logger.info("request %s: %s (sampled %s)", rid, errors[rid], tokens)
        for out in outputs.outputs:
            if out.finished or out.req_id in errors:
                self._forget(out.req_id)
        return errors

    def remove(self, request_ids: Iterable[str]) -> list[Request]:
        """Forget aborted requests; those still waiting for their grammar are returned, aborted."""
        waiting = []
        for rid in request_ids:
            pending = self._pending.pop(rid, None)
            if pending is not None:
                pending[0].status = RequestStatus.FINISHED_ABORTED
                waiting.append(pending[0])
            self._forget(rid)
        return waiting

    def _forget(self, rid: str) -> None:
        self.matchers.pop(rid, None)
        self._requests.pop(rid, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
