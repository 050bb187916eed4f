"""Physical KV blocks: the pool, its free queue, ref counts and the prefix-cache hash map.

The pool knows nothing about requests. :mod:`specloop.plugins.kv_cache` maps requests to blocks
and decides what gets cached; this module only keeps the ledger honest:

* block 0 is the reserved *null block*: never handed out, so runners may use id 0 for padding;
* a block is in the free queue exactly when its ref count is 0;
* a free block may still hold a cached prefix (its ``block_hash`` is set): it is revived in O(1)
  on a prefix hit, or evicted (hash dropped) when the free queue hands it out again.

The free queue is the eviction order: blocks are taken from the head and returned to the tail, so
the least recently freed cached block is evicted first (LRU).
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


class KVBlock:
    """One physical block. Ref count and hash set by :class:`BlockPool`; links by the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while the block is a cached full block
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks between two sentinels.

    A list would make reviving a cached block (removing it from the middle) O(n); the links make
    ``remove`` O(1), and ``popleft``/``append`` keep the eviction order.
    """

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __contains__(self, block: KVBlock) -> bool:
        return block.prev_free is not None

    def block_ids(self) -> list[int]:
        """Head (evicted first) to tail."""
        out, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            out.append(block.block_id)
            block = block.next_free
        return out


class BlockPool:
    """``num_blocks`` physical blocks, of which ``num_blocks - 1`` are usable (block 0 is null)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached prefixes."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks found by a prefix hit (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those reaching 0 join the tail in the given order."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a full block under its hash. When another block already holds the same content,
        the first one stays the cached copy and this one is left private."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
