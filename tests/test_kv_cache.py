"""The paged KV cache: block pool ledger, free-queue order, LRU eviction, hash chain, prefix hits."""

from __future__ import annotations

import pytest

from specloop.kernel import EngineConfig, PluginManager, Request, SamplingParams
from specloop.plugins.block_pool import BlockPool, FreeBlockQueue, hash_block_tokens
from specloop.plugins.kv_cache import PagedKVCache, make_lru, make_uncached

BS = 4


def make_cache(num_blocks: int = 11, caching: bool = True, max_model_len: int = 64) -> PagedKVCache:
    config = EngineConfig(block_size=BS, max_model_len=max_model_len)
    config.resolve(None)
    return PagedKVCache(config, num_blocks, enable_caching=caching)


def req(rid: str, tokens: list[int], **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(**kw.pop("params", {})), **kw)


def admit(kv: PagedKVCache, request: Request, lookahead: int = 0) -> list[int] | None:
    """Admit like the scheduler does: look up the prefix, allocate the rest, and once the step ran,
    commit the computed positions."""
    hits, num_hit = kv.get_computed_blocks(request)
    new = kv.allocate_slots(request, request.num_tokens - num_hit, num_hit, hits, lookahead)
    if new is not None:
        request.num_computed_tokens = request.num_tokens
        kv.cache_blocks(request, request.num_computed_tokens)
    return new


def refcounts(kv: PagedKVCache) -> list[int]:
    return list(kv.pool.ref_cnts)


def test_null_block_is_reserved_and_never_handed_out():
    kv = make_cache(num_blocks=5)
    assert kv.pool.free_queue.block_ids() == [1, 2, 3, 4]
    a = req("a", range(16))
    assert admit(kv, a) == [1, 2, 3, 4]
    assert 0 not in kv.get_block_ids("a") and kv.pool.ref_cnts[kv.pool.null_block] == 0
    assert kv.usage == 1.0 and kv.num_free_blocks == 0
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1)


def test_free_queue_order_after_frees_is_tail_first():
    kv = make_cache(num_blocks=9, caching=False)
    a, b = req("a", range(10)), req("b", range(100, 106))
    assert admit(kv, a) == [1, 2, 3]
    assert admit(kv, b) == [4, 5]
    kv.free(a)
    assert kv.pool.free_queue.block_ids() == [6, 7, 8, 3, 2, 1]
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == [6, 7, 8, 3, 2, 1, 5, 4]
    # The next allocations take from the head: never-used blocks, then a's tail before its head.
    c = req("c", range(200, 220))
    assert admit(kv, c) == [6, 7, 8, 3, 2]
    assert kv.pool.free_queue.block_ids() == [1, 5, 4]


def test_free_queue_remove_from_the_middle():
    queue = FreeBlockQueue(5, first=0)
    queue.remove(2)
    assert queue.block_ids() == [0, 1, 3, 4] and queue.num_free_blocks == 4 and 2 not in queue
    assert queue.popleft() == 0
    queue.append(2)
    assert queue.block_ids() == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(0)
    for block in (1, 3, 4, 2):
        assert queue.popleft() == block
    assert queue.num_free_blocks == 0 and queue.block_ids() == []
    with pytest.raises(ValueError, match="no free blocks"):
        queue.popleft()
    queue.append(4)
    assert queue.block_ids() == [4] and 4 in queue and 0 not in queue


def test_lru_eviction_order_and_revival():
    kv = make_cache(num_blocks=7)  # 6 usable blocks
    a = req("a", list(range(1, 9)) + [99])  # two full blocks + a partial one
    b = req("b", list(range(11, 19)) + [99])
    admit(kv, a)
    admit(kv, b)
    a_blocks, b_blocks = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert len(kv.pool.cached) == 4  # full blocks only
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_queue.block_ids() == a_blocks[::-1] + b_blocks[::-1]

    # Reviving b's prefix takes its blocks out of the middle of the queue.
    b2 = req("b2", list(range(11, 19)) + [7, 7])
    hits, num_hit = kv.get_computed_blocks(b2)
    assert hits == b_blocks[:2] and num_hit == 8
    admit(kv, b2)
    assert kv.get_block_ids("b2") == [*b_blocks[:2], a_blocks[2]]  # and the head of the queue
    kv.free(b2)
    # b2's blocks were used last, so they sit at the tail.
    assert kv.pool.free_queue.block_ids() == [a_blocks[1], a_blocks[0], b_blocks[2], a_blocks[2], *b_blocks[1::-1]]
    c = req("c", range(50, 58))
    admit(kv, c)
    assert kv.get_block_ids("c") == [a_blocks[1], a_blocks[0]]  # least recently used first
    assert kv.get_computed_blocks(req("a2", list(range(1, 9)) + [5]))[1] == 0  # a's prefix is gone
    assert kv.get_computed_blocks(req("b3", list(range(11, 19)) + [5]))[1] == 8


def test_hash_chain_depends_on_the_whole_prefix_and_the_salt():
    kv = make_cache()
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 9]
    a = req("a", tokens)
    admit(kv, a)
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [1, 2, 3, 4])
    assert a.block_hashes == [h0, h1]  # the trailing partial block has no hash
    assert h0 != h1  # same tokens, different parent
    assert hash_block_tokens(h0, [1, 2, 3, 5]) != h1
    salted = req("s", tokens, cache_salt="tenant-1")
    kv.get_computed_blocks(salted)
    assert salted.block_hashes[0] != h0 and salted.block_hashes[1] != h1  # the salt rides the chain
    assert kv.get_computed_blocks(salted) == ([], 0)
    other_salt = req("t", tokens, cache_salt="tenant-2")
    kv.get_computed_blocks(other_salt)
    assert other_salt.block_hashes[0] != salted.block_hashes[0]


def test_failed_allocation_changes_nothing():
    kv = make_cache(num_blocks=6)  # 5 usable
    a = req("a", list(range(1, 9)) + [0])
    admit(kv, a)  # 3 blocks, 2 of them cached
    kv.free(a)
    b = req("b", range(100, 104))
    admit(kv, b)  # takes a never-used block
    before = (refcounts(kv), kv.pool.free_queue.block_ids(), dict(kv.pool.cached), dict(kv.req_to_blocks))
    big = req("big", list(range(1, 9)) + list(range(200, 220)))
    hits, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 8  # a's two cached blocks are free but revivable
    assert kv.allocate_slots(big, big.num_tokens - num_hit, num_hit, hits) is None
    assert kv.allocate_slots(b, 40) is None
    after = (refcounts(kv), kv.pool.free_queue.block_ids(), dict(kv.pool.cached), dict(kv.req_to_blocks))
    assert after == before
    assert "big" not in kv.req_to_blocks and kv.take_prefix_cache_stats() == (9 + 4, 0)  # big was not admitted


def test_revived_hits_count_against_the_free_blocks():
    """Touching a free cached block removes it from the free queue, so it cannot also be a new block."""
    kv = make_cache(num_blocks=4)  # 3 usable
    a = req("a", list(range(1, 9)) + [0])
    admit(kv, a)
    kv.free(a)
    again = req("again", list(range(1, 9)) + [5, 6, 7, 8, 9])  # 2 hits + 2 new blocks > 3 usable
    hits, num_hit = kv.get_computed_blocks(again)
    assert len(hits) == 2
    assert kv.allocate_slots(again, again.num_tokens - num_hit, num_hit, hits) is None
    fits = req("fits", list(range(1, 9)) + [5, 6])  # 2 hits + 1 new block
    assert admit(kv, fits) is not None and kv.num_free_blocks == 0


def test_prefix_hit_shares_full_blocks_and_never_a_partial_one():
    kv = make_cache()
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    a = req("a", prompt)
    admit(kv, a)
    b = req("b", prompt + [42])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and hits == kv.get_block_ids("a")[:2]
    admit(kv, b)
    shared = kv.get_block_ids("a")[:2]
    assert [kv.pool.ref_cnts[i] for i in shared] == [2, 2]
    assert kv.get_block_ids("b")[:2] == shared
    assert kv.get_block_ids("b")[2] != kv.get_block_ids("a")[2]  # the partial block is private
    assert kv.pool.block_hash(kv.get_block_ids("a")[2]) is None


def test_full_prompt_hit_still_recomputes_the_last_token():
    kv = make_cache()
    prompt = list(range(1, 9))  # exactly two blocks
    admit(kv, req("a", prompt))
    hits, num_hit = kv.get_computed_blocks(req("b", prompt))
    assert num_hit == 4 and len(hits) == 1  # the block holding the last token is recomputed
    hits, num_hit = kv.get_computed_blocks(req("c", prompt + [1]))
    assert num_hit == 8


def test_drafts_are_never_hashed():
    kv = make_cache()
    a = req("a", [1, 2, 3, 4, 5, 6])
    admit(kv, a)
    a.spec_token_ids = [7, 8]  # would complete the second block
    assert kv.allocate_slots(a, 3, num_lookahead_tokens=2) is not None
    a.num_computed_tokens += 3
    kv.cache_blocks(a, a.num_computed_tokens)  # even if asked to, only committed tokens are published
    assert len(a.block_hashes) == 1 and len(kv.pool.cached) == 1
    a.spec_token_ids = []
    a.append_output_token_ids([7, 8])  # the drafts were accepted: now they are committed tokens
    kv.cache_blocks(a, 8)
    assert len(a.block_hashes) == 2 and len(kv.pool.cached) == 2


def test_lookahead_slots_are_reserved_and_capped_by_max_model_len():
    kv = make_cache(max_model_len=12)
    a = req("a", [1, 2, 3])
    assert len(kv.allocate_slots(a, 3, num_lookahead_tokens=2)) == 2  # 5 slots -> 2 blocks
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert len(kv.allocate_slots(b, 10, num_lookahead_tokens=8)) == 3  # capped at 12 positions


def test_reset_prefix_cache_refused_while_blocks_are_in_use():
    kv = make_cache()
    a = req("a", range(1, 10))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert kv.get_computed_blocks(req("x", range(1, 10)))[1] == 8
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {} and kv.pool.hashes == {}
    assert kv.get_computed_blocks(req("y", range(1, 10))) == ([], 0)


def test_usage_and_hit_stats():
    kv = make_cache(num_blocks=11)
    admit(kv, req("a", range(1, 10)))
    assert kv.usage == pytest.approx(0.3)
    admit(kv, req("b", range(1, 14)))
    assert kv.usage == pytest.approx(0.5)  # 2 shared blocks + 2 of b's own + a's third
    assert kv.take_prefix_cache_stats() == (9 + 13, 8)
    assert kv.take_prefix_cache_stats() == (0, 0)


def test_no_hits_without_caching_or_with_prompt_logprobs():
    for kv in (make_cache(caching=False), make_uncached(_config(enable_prefix_caching=True), 11),
               make_lru(_config(enable_prefix_caching=False), 11)):
        admit(kv, req("a", range(1, 10)))
        assert kv.get_computed_blocks(req("b", range(1, 10))) == ([], 0)
        assert kv.pool.cached == {} and kv.take_prefix_cache_stats() == (0, 0)
    kv = make_cache()
    admit(kv, req("a", range(1, 10)))
    assert kv.get_computed_blocks(req("b", range(1, 10), params={"prompt_logprobs": 1})) == ([], 0)


def test_builtin_policies_are_registered_by_name():
    pm = PluginManager(load_entrypoints=False)
    assert {"lru", "none"} <= set(pm.kv_cache_policies.names())
    kv = pm.kv_cache_policies.create("none", config=_config(), num_blocks=8)
    assert isinstance(kv, PagedKVCache) and not kv.enable_caching


def _config(**kw) -> EngineConfig:
    config = EngineConfig(block_size=BS, max_model_len=32, **kw)
    config.resolve(None)
    return config


def test_a_large_pool_adds_no_objects_for_the_garbage_collector():
    """Millions of blocks on a large GPU: one tracked object per block made every full collection a
    pause of about half a second."""
    import gc

    before = len(gc.get_objects())
    pool = BlockPool(200_000)
    pool.touch([])
    blocks = pool.get_new_blocks(1000)
    pool.free_blocks(reversed(blocks))
    assert len(gc.get_objects()) - before < 50
    assert pool.num_free_blocks == 199_999 and pool.free_queue.block_ids()[-3:] == [3, 2, 1]
