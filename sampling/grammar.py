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

Ahead of the commit (asynchronous scheduling). Once a plan's sampling is launched, ``prefetch``
hands a helper thread a way to read that plan's sampled tokens; the thread waits for them,
advances the matchers by them and fills every matcher's next mask, while the step thread plans and
launches the next step. ``commit`` then only checks the scheduler's committed tokens against what
the thread consumed: a request whose output the scheduler dropped (preempted while the step ran)
gets its matcher rebuilt from its committed tokens, and its mask is filled again when needed.
``grammar_bitmask`` takes the ready rows. Plans with drafts (synchronous) fill their masks as
before.

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
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol, Sequence

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

    # Optional: ``accept_many(items)`` advances many ``(matcher, tokens)`` at once (the built-in
    # backend does single tokens on its own threads, without the GIL); the manager uses it when present.


# tokens() -> (request ids, each one's sampled tokens) of a launched plan, waiting for them.
SampledTokens = Callable[[], tuple[Sequence[str], Sequence[Sequence[int]]]]


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
        self._compiled: dict[str, Any] = {}  # each admitted request's compiled grammar (for a rebuild)
        self.matchers: dict[str, Any] = {}
        # Work ahead of the commit (see the module docstring): one helper thread, at most one job.
        self._ahead_pool = concurrent.futures.ThreadPoolExecutor(1, "specloop-grammar-ahead")
        self._ahead: concurrent.futures.Future[tuple[dict[str, list[int]], dict[str, int], np.ndarray]] | None = None
        self._ready: tuple[dict[str, int], np.ndarray] | None = None  # masks after the last commit, by request
        self.num_prefetched_rows = 0  # rows grammar_bitmask took from the helper thread's masks
        self.num_rebuilt = 0  # matchers rebuilt because the scheduler dropped tokens the thread consumed

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
                request.status = RequestStatus.FINISHED_ERROR
                failed.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR,
                                               error=f"structured_outputs: {error}"))
                continue
            self.matchers[rid] = self.backend.matcher(future.result())
            self._compiled[rid] = future.result()
            self._requests[rid] = request
            request.status = RequestStatus.WAITING
            ready.append(request)
        return ready, failed

    def grammar_bitmask(self, plan: SchedulerOutput) -> GrammarBitmask | None:
        if not self.matchers:
            return None
        ready, self._ready = self._ready, None
        req_ids, num_rows, items, copies, row = [], [], [], [], 0
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
            source = ready[0].get(rid) if ready is not None and not drafts else None
            if source is not None:
                copies.append((row, source))
            else:
                items.append((matcher, row, drafts))
            row += len(drafts) + 1
        if not req_ids:
            return None
        if copies:
            rows, sources = zip(*copies)
            if not items and list(rows) == list(range(row)):
                bitmask = ready[1][list(sources)]  # every row ready, in order: one gather
            else:
                bitmask = np.full((row, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
                bitmask[list(rows)] = ready[1][list(sources)]
            self.num_prefetched_rows += len(copies)
        else:
            bitmask = np.full((row, (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        if items:
            self.backend.fill_bitmask(bitmask, items)
        return GrammarBitmask(req_ids, num_rows, bitmask)

    def prefetch(self, tokens: SampledTokens) -> None:
        """Advance the matchers by a launched plan's tokens and fill their next masks on the helper
        thread, before that plan is committed (see the module docstring)."""
        if self._ahead is not None:
            return  # the oldest launched plan's job is still to be committed; this plan commits as usual
        self._ready = None
        self._ahead = self._ahead_pool.submit(self._advance, tokens, dict(self.matchers))

    def _advance(self, tokens: SampledTokens, matchers: dict[str, Any]
                 ) -> tuple[dict[str, list[int]], dict[str, int], np.ndarray]:
        req_ids, sampled = tokens()
        consumed: dict[str, list[int]] = {}
        for rid, new in zip(req_ids, sampled):
            if new and rid in matchers:
                consumed[rid] = list(new)
        accept_many = getattr(self.backend, "accept_many", None)
        if accept_many is not None:
            accept_many([(matchers[rid], new) for rid, new in consumed.items()])
        else:
            for rid, new in consumed.items():
                self.backend.accept(matchers[rid], new)
        order = {rid: i for i, rid in enumerate(matchers)}
        masks = np.full((len(order), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        self.backend.fill_bitmask(masks, [(m, i, []) for i, m in enumerate(matchers.values())])
        return consumed, order, masks

    def _settle(self) -> dict[str, list[int]] | None:
        """Wait for the helper thread's job, if any: the tokens it consumed, by request."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        consumed, order, masks = ahead.result()
        self._ready = (order, masks)
        return consumed

    def commit(self, outputs: EngineCoreOutputs) -> None:
        consumed = self._settle()
        stale: set[str] = set()  # rebuilt from the committed tokens
        moved: set[str] = set()  # advanced here, after the helper thread filled their masks
        for out in outputs.outputs:
            matcher = self.matchers.get(out.req_id)
            if matcher is None:
                continue
            new = list(out.new_token_ids)
            if consumed is not None and out.req_id in consumed:
                if consumed.pop(out.req_id) != new:  # cut by a stop string: the request finishes
                    stale.add(out.req_id)
            elif new:
                moved.add(out.req_id)
                if not self.backend.accept(matcher, new):
                    # Only a token the mask allowed is sampled: a backend bug, not bad input.
                    logger.error("request %s: the grammar refused committed tokens %s", out.req_id, new)
            if out.finished:
                self._forget(out.req_id)
        # Consumed ahead but not committed (the scheduler dropped the output of a request preempted
        # while its step ran): rebuild those matchers from what was committed.
        stale.update(consumed or ())
        for rid in stale:
            if rid in self.matchers:
                self._rebuild(rid)
        if (stale or moved) and self._ready is not None:
            order = {rid: i for rid, i in self._ready[0].items() if rid not in stale and rid not in moved}
            self._ready = (order, self._ready[1])

    def _rebuild(self, rid: str) -> None:
        matcher = self.backend.matcher(self._compiled[rid])
        output = list(self._requests[rid].output_token_ids)
        if output and not self.backend.accept(matcher, output):
            logger.error("request %s: the grammar refused its committed output on a rebuild", rid)
        self.matchers[rid] = matcher
        self.num_rebuilt += 1

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
        self._compiled.pop(rid, None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ahead_pool.shutdown(wait=False, cancel_futures=True)
