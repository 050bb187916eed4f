"""The built-in KV-cache policies: paged block tables over a :class:`BlockPool`, with or without a
prefix cache.

``lru`` (the default) shares full prompt blocks between requests through chained block hashes and
evicts the least recently freed cached block first; ``none`` never caches, so every request
computes its whole prompt. A third-party policy registers under its own name and is chosen with
``EngineConfig(kv_cache_policy=...)``.
"""

from __future__ import annotations

from specloop.kernel.config import EngineConfig, SpeculativeConfig
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.request import Request

from .block_pool import BlockHash, BlockPool, hash_block_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache:
    """Maps each request to a block table. Implements :class:`specloop.kernel.protocols.KVCacheManager`.

    :param enable_caching: publish full blocks under their hashes and look prompts up among them.
    """

    def __init__(self, config: EngineConfig, num_blocks: int, *, enable_caching: bool = True) -> None:
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.max_model_len = config.max_model_len
        self.enable_caching = enable_caching
        spec = config.speculative_config
        self._recompute_last_hit_block = isinstance(spec, SpeculativeConfig) and spec.reads_target_hidden_states
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[int]] = {}  # block ids
        # How many leading blocks of each request are already published in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self._queries = 0
        self._hits = 0

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        # Never the whole sequence: the last token is recomputed for its logits (invariant 7).
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        if hit and self._recompute_last_hit_block:  # see SpeculativeConfig.reads_target_hidden_states
            hit.pop()
        return hit, len(hit) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Grow the request's table to hold ``num_computed_tokens + num_new_computed_tokens +
        num_new_tokens + num_lookahead_tokens`` positions (capped at ``max_model_len``).

        ``new_computed_blocks`` are prefix hits from :meth:`get_computed_blocks` (admission only).
        Returns the block ids appended to the table, or None, changing no state, when they do not
        fit. Nothing is published here: the new slots hold no KV until the step has run.
        """
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError("allocate_slots needs non-negative token counts")
        table = self.req_to_blocks.get(request.request_id)
        num_needed = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            num_needed = min(num_needed, self.max_model_len)
        if table is not None and not new_computed_blocks and num_needed <= len(table) * self.block_size:
            return []  # the common decode step: its slots are in blocks it holds already
        hits = new_computed_blocks or []
        if table is None:
            table = []
        num_new_blocks = max(cdiv(num_needed, self.block_size) - len(table) - len(hits), 0)
        # Hits that sit in the free queue stop being allocatable once touched.
        ref_cnts = self.pool.ref_cnts
        num_revived = sum(1 for b in hits if ref_cnts[b] == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_revived:
            return None

        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = table
            if self.enable_caching:
                self._queries += request.num_tokens
                self._hits += num_new_computed_tokens
        self.pool.touch(hits)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        table.extend(hits)
        table.extend(new_blocks)
        return [*hits, *new_blocks]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks among its first ``num_computed_tokens`` positions.

        Called at the commit point with the verified count, so only KV that was really written
        for committed tokens becomes shareable: never drafts (invariant 5), never slots of a step
        that was taken back, and no request relies on KV another one writes in the same step.
        """
        if not self.enable_caching:
            return
        full = min(num_computed_tokens, len(request.all_token_ids)) // self.block_size
        # Most steps fill no block: nothing new to publish.
        if full > self._num_cached_blocks.get(request.request_id, 0) and request.request_id in self.req_to_blocks:
            self._cache_full_blocks(request, full * self.block_size)

    def free(self, request: Request) -> None:
        table = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        # Tail first: a request's last blocks are the least likely to be shared, so evict them first.
        self.pool.free_blocks(reversed(table))

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self.req_to_blocks.get(request_id, ()))

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def take_prefix_cache_stats(self) -> tuple[int, int]:
        """(tokens looked up, tokens hit) since the last call, counted once per admission."""
        out = (self._queries, self._hits)
        self._queries = self._hits = 0
        return out

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _extra_keys(self, request: Request, block_index: int) -> tuple[object, ...] | None:
        """What besides the tokens changes their KV. The salt only needs to enter the first block:
        the chain carries it into every later hash."""
        if block_index == 0 and request.cache_salt is not None:
            return ("salt", request.cache_salt)
        return None

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` over the full blocks of committed tokens (never drafts)."""
        hashes, bs, tokens = request.block_hashes, self.block_size, request.all_token_ids
        for i in range(len(hashes), request.num_tokens // bs):
            parent: BlockHash | None = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs], self._extra_keys(request, i)))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        table = self.req_to_blocks[rid]
        start = self._num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(table))
        if end <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, end):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_cached_blocks[rid] = end


def make_lru(config: EngineConfig, num_blocks: int) -> PagedKVCache:
    return PagedKVCache(config, num_blocks, enable_caching=config.enable_prefix_caching)


def make_uncached(config: EngineConfig, num_blocks: int) -> PagedKVCache:
    return PagedKVCache(config, num_blocks, enable_caching=False)


@hookimpl
def specloop_register_kv_cache_policies(register) -> None:
    register("lru", make_lru)
    register("none", make_uncached)
