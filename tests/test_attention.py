"""The torch reference paged-attention backend against dense attention computed per query."""

from __future__ import annotations

import pytest
import torch

from specloop.models.context import ForwardContext
from specloop.models.attention import AttentionMetadata, TorchAttentionBackend, write_kv

BLOCK = 4
NUM_BLOCKS = 40
D = 16


def dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int,
                    scale: float) -> torch.Tensor:
    """Query j (position context_len + j) attends keys 0..context_len + j; float64, one at a time."""
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    out = torch.empty(n, hq, D, dtype=torch.float64)
    for j in range(n):
        visible = context_len + j + 1
        for h in range(hq):
            k = keys[:visible, h // group].double()
            v = values[:visible, h // group].double()
            weights = torch.softmax(k @ q[j, h].double() * scale, dim=0)
            out[j, h] = weights @ v
    return out


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_mixed_batch_over_a_shuffled_paged_cache(num_heads: int, num_kv_heads: int) -> None:
    """A prefill, a chunk continuing a prefill, a decode and a 4-token verification, in one batch,
    with each request's context already in the cache at scattered blocks."""
    g = torch.Generator().manual_seed(0)
    cases = [(0, 7), (5, 3), (12, 1), (8, 4)]  # (cached context, new tokens)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    backend = TorchAttentionBackend()
    cache = torch.zeros(backend.kv_cache_shape(NUM_BLOCKS, BLOCK, num_kv_heads, D))
    tables, full_k, full_v, slots, qsl, seq_lens = [], [], [], [], [0], []
    for ctx, n in cases:
        blocks = [perm.pop() for _ in range(-(-(ctx + n) // BLOCK))]
        tables.append(blocks)
        k = torch.randn(ctx + n, num_kv_heads, D, generator=g)
        v = torch.randn(ctx + n, num_kv_heads, D, generator=g)
        slot = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx + n)])
        write_kv(cache, k[:ctx], v[:ctx], slot[:ctx])  # the context, written by earlier steps
        full_k.append(k)
        full_v.append(v)
        slots.append(slot[ctx:])
        qsl.append(qsl[-1] + n)
        seq_lens.append(ctx + n)
    block_tables = torch.zeros(len(cases), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = torch.tensor(t)
    meta = AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             torch.cat(slots), block_tables, max(n for _, n in cases), max(seq_lens), qsl, seq_lens)
    q = torch.randn(qsl[-1], num_heads, D, generator=g)
    new_k = torch.cat([k[ctx:] for k, (ctx, _) in zip(full_k, cases)])
    new_v = torch.cat([v[ctx:] for v, (ctx, _) in zip(full_v, cases)])
    scale = D ** -0.5
    other_layer = torch.zeros_like(cache)
    ctx_obj = ForwardContext(backend, meta, [other_layer, cache])
    out = ctx_obj.attention(1, q, new_k, new_v, scale)
    assert other_layer.abs().sum() == 0  # only the named layer's cache is touched
    for i, (ctx, n) in enumerate(cases):
        expected = dense_reference(q[qsl[i]:qsl[i + 1]], full_k[i], full_v[i], ctx, scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].double(), expected, atol=1e-5, rtol=0)
        slot = torch.tensor([tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx + n)])
        torch.testing.assert_close(cache[0].view(-1, num_kv_heads, D)[slot], full_k[i])
        torch.testing.assert_close(cache[1].view(-1, num_kv_heads, D)[slot], full_v[i])


def test_requests_do_not_see_each_other() -> None:
    """Two requests with identical queries but different contexts get different outputs, each
    equal to attending over its own context alone."""
    g = torch.Generator().manual_seed(1)
    backend = TorchAttentionBackend()
    cache = torch.zeros(backend.kv_cache_shape(4, BLOCK, 1, D))
    k = torch.randn(6, 1, D, generator=g)
    v = torch.randn(6, 1, D, generator=g)
    q = torch.randn(1, 1, D, generator=g).repeat(2, 1, 1)
    # Request 0: 3 tokens in block 2; request 1: 3 tokens in block 0. One new token each.
    write_kv(cache, k[[0, 1, 3, 4]], v[[0, 1, 3, 4]], torch.tensor([8, 9, 0, 1]))
    meta = AttentionMetadata(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([3, 3], dtype=torch.int32),
                             torch.tensor([10, 2]), torch.tensor([[2], [0]], dtype=torch.int32), 1, 3, [0, 1, 2], [3, 3])
    out = backend.forward(q, k[[2, 5]], v[[2, 5]], cache, meta, 1.0)
    torch.testing.assert_close(out[0].double(), dense_reference(q[:1], k[:3], v[:3], 2, 1.0)[0])
    torch.testing.assert_close(out[1].double(), dense_reference(q[1:], k[3:], v[3:], 2, 1.0)[0])
    assert (out[0] - out[1]).abs().max() > 1e-3
