"""Physical KV blocks: the pool, its free queue, ref counts and the prefix-cache hash map.

The pool knows nothing about requests. :mod:`specloop.plugins.kv_cache` maps requests to blocks
and decides what gets cached; this module only keeps the ledger honest:

* block 0 is the reserved *null block*: never handed out, so runners may use id 0 for padding;
* a block is in the free queue exactly when its ref count is 0;
* a free block may still hold a cached prefix (its ``block_hash`` is set): it is revived in O(1)
  on a prefix hit, or evicted (hash dropped) when the free queue hands it out again.

The free queue is the eviction order: blocks are taken from the head and returned to the tail, so
the least recently freed cached block is evicted first (LRU).

Blocks are ids, and the ledger is flat arrays (ref counts, the free queue's links) and two dicts
(cached blocks' hashes): no Python object per block. A large GPU holds millions of blocks; as
objects they took seconds to build, hundreds of megabytes, and made every full garbage collection
a pause of about half a second.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterable

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Iterable[int],
                      extra_keys: tuple[object, ...] | None = None) -> BlockHash:
    """Hash one full block, chained to its parent so equal blocks at different prefixes differ.

    ``extra_keys`` carries whatever else changes the KV of these tokens (e.g. a cache salt).
    sha256 rather than ``hash()``: a collision would silently serve another prompt's KV.
    """
    h = hashlib.sha256(parent_hash or b"\0")
    h.update(array("q", token_ids).tobytes())
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


NOT_FREE = -1  # a block's links while it is out of the free queue


class FreeBlockQueue:
    """Doubly linked list of free block ids, over two arrays indexed by block id (and a sentinel at
    index ``num_blocks`` that closes the ring). A list would make reviving a cached block (removing
    it from the middle) O(n); the links make ``remove`` O(1), and ``popleft``/``append`` keep the
    eviction order. Starts holding ``first .. num_blocks - 1`` in order."""

    def __init__(self, num_blocks: int, first: int = 1) -> None:
        s = self._sentinel = num_blocks
        self._next = array("q", range(1, num_blocks + 2))  # i -> i + 1; the last block's next is s
        self._prev = array("q", range(-1, num_blocks))  # i -> i - 1
        for i in range(first):
            self._next[i] = self._prev[i] = NOT_FREE
        if first < s:
            self._next[s], self._prev[s], self._prev[first] = first, s - 1, s
        else:
            self._next[s] = self._prev[s] = s
        self.num_free_blocks = s - first if first < s else 0

    def popleft(self) -> int:
        block = self._next[self._sentinel]
        if block == self._sentinel:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: int) -> None:
        prev, nxt = self._prev[block], self._next[block]
        if prev == NOT_FREE:
            raise ValueError(f"block {block} is not in the free queue")
        self._next[prev], self._prev[nxt] = nxt, prev
        self._prev[block] = self._next[block] = NOT_FREE
        self.num_free_blocks -= 1

    def append(self, block: int) -> None:
        s = self._sentinel
        last = self._prev[s]
        self._next[last], self._prev[block] = block, last
        self._next[block], self._prev[s] = s, block
        self.num_free_blocks += 1

    def __contains__(self, block: int) -> bool:
        return self._prev[block] != NOT_FREE

    def block_ids(self) -> list[int]:
        """Head (evicted first) to tail."""
        out, block = [], self._next[self._sentinel]
        while block != self._sentinel:
            out.append(block)
            block = self._next[block]
        return out


class BlockPool:
    """``num_blocks`` physical blocks, of which ``num_blocks - 1`` are usable (block 0 is null)."""

    null_block = 0

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnts = array("i", bytes(4 * num_blocks))  # how many requests hold each block
        self.free_queue = FreeBlockQueue(num_blocks)
        self.hashes: dict[int, BlockHash] = {}  # block id -> hash, while it is a cached full block
        self.cached: dict[BlockHash, int] = {}  # hash -> block id

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached prefixes."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if self.hashes:
                self._evict(block)
            self.ref_cnts[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit (reviving free ones)."""
        for block in blocks:
            if self.ref_cnts[block] == 0:
                self.free_queue.remove(block)
            self.ref_cnts[block] += 1

    def free_blocks(self, ordered: Iterable[int]) -> None:
        """Drop one reference from each block; those reaching 0 join the tail in the given order."""
        for block in ordered:
            n = self.ref_cnts[block] - 1
            if n < 0:
                raise AssertionError(f"block {block} freed more often than taken")
            self.ref_cnts[block] = n
            if n == 0:
                self.free_queue.append(block)

    def cache_block(self, block: int, block_hash: BlockHash) -> None:
        """Publish a full block under its hash. When another block already holds the same content,
        the first one stays the cached copy and this one is left private."""
        if block in self.hashes or block_hash in self.cached:
            return
        self.hashes[block] = block_hash
        self.cached[block_hash] = block

    def block_hash(self, block: int) -> BlockHash | None:
        return self.hashes.get(block)

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self.hashes.clear()
        self.cached.clear()
        return True

    def _evict(self, block: int) -> None:
        block_hash = self.hashes.pop(block, None)
        if block_hash is not None:
            del self.cached[block_hash]
