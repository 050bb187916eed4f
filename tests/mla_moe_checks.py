"""The MLA and fused-MoE Triton kernels against short PyTorch references, as plain functions of
(device, dtype); part of ``kernel_checks.ALL_CHECKS`` (CPU under ``TRITON_INTERPRET=1`` in
``test_triton_kernels.py``, CUDA at model shapes in ``test_gpu_backend.py``). Not collected by pytest.
"""

from __future__ import annotations

import torch

from specloop.kernels.fused_moe import fused_moe, sort_by_expert
from specloop.kernels.skinny_moe import DOWN_TILE, skinny_moe
from specloop.kernels.moe_route import moe_route as moe_route_kernel
from specloop.kernels.mla_attention import mla_attention
from specloop.kernels.mla_rope_cache import mla_rope_cache
from specloop.models.config import MoEConfig
from specloop.models.ops import TorchOps

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def reference_mla(q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, qsl: torch.Tensor,
                  seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sequence in float64: gather the latent rows through the block table, score every head's
    ``[q_nope | q_rope]`` against them (causal over the new tokens), average their ``c_kv``."""
    rank, page = q_nope.shape[2], cache.shape[1]
    flat = cache.reshape(-1, cache.shape[2]).double().cpu()
    q = torch.cat([q_nope, q_rope], dim=-1).double().cpu()
    out = torch.zeros(q_nope.shape, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        a, b, n = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        keys = torch.arange(n)
        rows = flat[block_table[s].cpu().long()[keys // page] * page + keys % page]
        scores = torch.einsum("qhd,kd->hqk", q[a:b], rows) * scale
        pos = n - (b - a) + torch.arange(b - a)
        scores = scores.masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hqk,kd->qhd", scores.softmax(-1), rows[:, :rank])
    return out


# (heads, kv_lora_rank, rope dim, page size, new tokens per sequence, cached tokens per sequence, splits)
MLA_CASES = [
    (4, 32, 16, 16, [1, 5, 1, 20], [40, 0, 70, 3], 1),  # decode + prefill + chunk after a prefix
    (4, 32, 16, 16, [1, 1, 1], [100, 7, 300], 4),  # split-K decoding, one split past a short context
    (3, 24, 8, 8, [3, 1, 17], [10, 0, 33], 2),  # padded heads, rank and rope dim (prefill-heavy: no split)
    (3, 24, 8, 8, [3, 1, 5], [10, 0, 33], 2),  # the same, few enough q-blocks to keep the splits
    (20, 16, 16, 4, [4, 4], [9, 0], 1),  # two head blocks; verification shape
]


def check_mla_attention(device: str, dtype: torch.dtype, cases: list | None = None) -> None:
    for heads, rank, rope, page, q_lens, ctx, splits in cases or MLA_CASES:
        seq_lens = torch.tensor([q + c for q, c in zip(q_lens, ctx)], dtype=torch.int32)
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        max_blocks = -(-int(seq_lens.max()) // page)
        num_blocks = len(q_lens) * max_blocks + 3
        table = torch.randperm(num_blocks)[:len(q_lens) * max_blocks].view(len(q_lens), max_blocks).int()
        cache = torch.randn(num_blocks, page, rank + rope, dtype=dtype)
        q = torch.randn(int(qsl[-1]), heads, rank + rope + 5, dtype=dtype)  # strided views, as in the model
        q_nope, q_rope = q[:, :, :rank], q[:, :, rank:rank + rope]
        scale = (rank + rope) ** -0.5
        to = lambda t: t.to(device)  # noqa: E731
        out = torch.full((q.shape[0], heads, rank), float("nan"), dtype=dtype, device=device)
        mla_attention(to(q_nope), to(q_rope), to(cache), to(qsl), to(seq_lens), to(table), scale=scale,
                      max_query_len=max(q_lens), num_splits=splits, out=out)
        err = rel_err(out, reference_mla(q_nope, q_rope, cache, qsl, seq_lens, table, scale))
        assert err < TOL[dtype], f"mla case {heads, rank, rope, page, q_lens, ctx, splits}: rel err {err:.2e}"
    _check_unmerged_w_uv(device, dtype)


def _check_unmerged_w_uv(device: str, dtype: torch.dtype) -> None:
    """One token over a long context in several splits, left unmerged: W_UV's product merging them
    (``latent_heads.head_gemv`` on ``SplitParts``) equals the merged attention times W_UV, and one
    split past the context (no keys) weighs nothing."""
    from specloop.kernels.latent_heads import SplitParts, head_gemv

    heads, rank, rope, page, v = 3, 40, 16, 8, 24
    for context, splits in ((70, 4), (3, 8), (21, 1)):
        blocks = -(-context // page)
        table = torch.randperm(blocks + 2)[:blocks].view(1, blocks).int()
        cache = torch.randn(blocks + 2, page, rank + rope, dtype=dtype)
        q_nope, q_rope = torch.randn(1, heads, rank, dtype=dtype), torch.randn(1, heads, rope, dtype=dtype)
        w_uv = (torch.randn(heads, v, rank, dtype=dtype) / rank ** 0.5).transpose(1, 2)  # as the model holds it
        qsl, seq_lens, scale = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([context], dtype=torch.int32), 0.2
        to = lambda t: t.to(device)  # noqa: E731
        args = (to(q_nope), to(q_rope), to(cache), to(qsl), to(seq_lens), to(table))
        parts = mla_attention(*args, scale=scale, max_query_len=1, num_splits=splits, merge=False)
        merged = mla_attention(*args, scale=scale, max_query_len=1, num_splits=splits)
        assert isinstance(parts, SplitParts) == (splits > 1), f"{splits} splits returned {type(parts).__name__}"
        got = head_gemv(parts if splits > 1 else parts[0], to(w_uv), num_sms=4)
        assert torch.allclose(got.float(), head_gemv(merged[0], to(w_uv), num_sms=4).float(), rtol=TOL[dtype],
                              atol=TOL[dtype]), f"merged inside W_UV's product differs at {context} keys, {splits} splits"
        attended = reference_mla(q_nope, q_rope, cache, qsl, seq_lens, table, scale)[0]
        want = torch.bmm(attended[:, None], w_uv.double())[:, 0]
        assert rel_err(got, want) < TOL[dtype], f"W_UV of unmerged splits at {context} keys: {rel_err(got, want):.2e}"


def check_mla_rope_cache(device: str, dtype: torch.dtype) -> None:
    from kernel_checks import reference_rms_norm, reference_rotary, rope_tables

    tokens, heads, nope, rank, rope, num_blocks, page = 6, 3, 8, 24, 16, 5, 4
    cos, sin = rope_tables(64, rope, 10000.0)
    positions, slots = torch.tensor([0, 1, 7, 63, 20, 3]), torch.tensor([5, 0, 17, -1, 9, 2])
    q = torch.randn(tokens, heads, nope + rope, dtype=dtype)
    q_in = q.clone()  # (on the CPU the kernel rotates q itself)
    proj = torch.randn(tokens, 10 + rank + rope, dtype=dtype)  # [q_a | c_kv | k_rope], as the fused projection
    latent, weight = proj[:, 10:], torch.randn(rank, dtype=dtype)
    cache = torch.randn(num_blocks, page, rank + rope, dtype=dtype)
    want_q = reference_rotary(q[:, :, nope:], positions, cos, sin)
    k = reference_rotary(latent[:, None, rank:], positions, cos, sin)[:, 0]
    want_cache = cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_cache.view(-1, rank + rope)[s] = torch.cat([reference_rms_norm(latent[t, :rank], weight, 1e-6), k[t]])
    to = lambda t: t.to(device)  # noqa: E731
    q_d, proj_d, cache_d = to(q), to(proj), to(cache)
    mla_rope_cache(q_d[:, :, nope:], proj_d[:, 10:], to(positions), to(cos), to(sin), to(weight), 1e-6, cache_d,
                   to(slots))
    assert rel_err(q_d[:, :, nope:], want_q) < TOL[dtype], "q_rope differs"
    assert torch.equal(q_d[:, :, :nope].cpu(), q[:, :, :nope]), "the kernel touched q_nope"
    assert rel_err(cache_d, want_cache) < TOL[dtype], "latent cache rows differ"
    # One token: the same work beside W_UK's per-head product, in one launch (latent_heads).
    from specloop.kernels.latent_heads import head_gemv, rope_cache_uk

    w_uk = torch.randn(heads, nope, rank, dtype=dtype) / nope ** 0.5
    for t in (2, 3):  # a cache row written; a padding slot (-1) writing none
        q1, cache1 = to(q_in[t:t + 1].clone()), to(cache.clone())
        q_latent = rope_cache_uk(q1[:, :, :nope], q1[:, :, nope:], proj_d[t:t + 1, 10:], to(positions[t:t + 1]),
                                 to(cos), to(sin), to(weight), 1e-6, cache1, to(slots[t:t + 1]), to(w_uk), num_sms=2)
        want_cache1 = cache.clone()
        if slots[t] >= 0:
            want_cache1.view(-1, rank + rope)[slots[t]] = want_cache.view(-1, rank + rope)[slots[t]]
        assert rel_err(q1[:, :, nope:], want_q[t:t + 1]) < TOL[dtype], "q_rope differs beside W_UK"
        assert rel_err(cache1, want_cache1) < TOL[dtype], "latent cache rows differ beside W_UK"
        assert torch.equal(q_latent[0].cpu(), head_gemv(to(q_in[t, :, :nope]), to(w_uk), num_sms=2).cpu()), \
            "W_UK's product beside the rotary differs from head_gemv's"
        want_latent = torch.bmm(q_in[t, :, None, :nope].double(), w_uk.double())[:, 0]
        assert rel_err(q_latent[0], want_latent) < TOL[dtype], "W_UK's product beside the rotary"


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
                  ) -> torch.Tensor:
    """Expert by expert in float64: the tokens that picked it, weighted by their routing weight."""
    x, ids, weights = x.double().cpu(), ids.cpu(), weights.double().cpu()
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        h = x[token] @ w13[e].double().cpu().T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].double().cpu().T
        out.index_add_(0, token, y * weights[token, slot, None])
    return out


# (tokens, hidden, expert intermediate, experts, top_k)
MOE_CASES = [(5, 64, 48, 8, 2), (1, 32, 16, 4, 3), (150, 32, 40, 4, 2)]  # the last sorts in blocks of 64


def check_fused_moe(device: str, dtype: torch.dtype, cases: list | None = None) -> None:
    for tokens, hidden, inter, experts, top_k in cases or MOE_CASES:
        x = torch.randn(tokens, hidden, dtype=dtype)
        w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, dtype=dtype) / inter ** 0.5
        ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k)
        to = lambda t: t.to(device)  # noqa: E731
        out = fused_moe(to(x), to(w13), to(w2), to(weights), to(ids))
        err = rel_err(out, reference_moe(x, w13, w2, weights, ids))
        assert err < TOL[dtype], f"fused_moe case {tokens, hidden, inter, experts, top_k}: rel err {err:.2e}"
    # The sort: every pair exactly once, each block's pairs all routed to that block's expert.
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [1, 3]], device=device)
    sorted_pairs, block_expert, num_sorted = sort_by_expert(ids, 6, 4)
    pairs, blocks = sorted_pairs.cpu().view(-1, 4), block_expert.cpu()
    assert int(num_sorted) == 16 and sorted(p for p in pairs.flatten().tolist() if p < 8) == list(range(8))
    for b, expert in enumerate(blocks.tolist()):
        real = [p for p in pairs[b].tolist() if p < 8]
        assert (expert == -1) == (b >= 4) and all(int(ids.view(-1)[p]) == expert for p in real), (b, expert, real)


# (tokens, hidden, expert intermediate, experts, top_k): hidden past one 512-wide chunk, an
# intermediate size no block divides, every token's picks ending in the same two (shared) experts.
SKINNY_MOE_CASES = [(1, 600, 40, 10, 4), (3, 64, 24, 6, 3), (4, 32, 17, 5, 5)]


def check_skinny_moe(device: str, dtype: torch.dtype) -> None:
    for tokens, hidden, inter, experts, top_k in SKINNY_MOE_CASES:
        x = torch.randn(tokens, hidden, dtype=dtype)
        w13 = torch.randn(experts, 2 * inter, hidden, dtype=dtype) / hidden ** 0.5
        w2 = torch.randn(experts, hidden, inter, dtype=dtype) / inter ** 0.5
        routed = [torch.randperm(experts - 2)[:top_k - 2] for _ in range(tokens)]
        ids = torch.stack([torch.cat([r, torch.tensor([experts - 2, experts - 1])]) for r in routed]).to(torch.int32)
        weights = torch.cat([torch.rand(tokens, top_k - 2), torch.ones(tokens, 2)], dim=1)
        to = lambda t: t.to(device)  # noqa: E731
        out = skinny_moe(to(x), to(w13), to(w2), to(weights), to(ids))
        assert out.dtype == dtype and out.shape == x.shape
        case = (tokens, hidden, inter, experts, top_k)
        err = rel_err(out, reference_moe(x, w13, w2, weights, ids))
        assert err < TOL[dtype], f"skinny_moe case {case}: rel err {err:.2e}"
        # Rounded where the grouped kernels round: it agrees with them far closer than with float64.
        grouped = fused_moe(to(x), to(w13), to(w2), to(weights), to(ids))
        assert rel_err(out, grouped.double().cpu()) < TOL[dtype] / 4, f"skinny_moe case {case} against fused_moe"
        # Small tiles: several chunks a pick, the last one partial, streamed across the picks.
        small = skinny_moe(to(x), to(w13), to(w2), to(weights), to(ids), gate_up_tile=(8, 32, 4, 1),
                           down_tile=(4, 16, 4, 2))
        assert rel_err(small, grouped.double().cpu()) < TOL[dtype] / 4, f"skinny_moe case {case}, small tiles"
        # The down kernel's picks over several programs a block: one pick each, the same bits (the
        # partial sums added in the same order), except where a GPU fuses a float32 pick's product
        # into the running sum (one rounding, where the partial rounds the product first); two picks
        # each (the last group short), close.
        one_each = skinny_moe(to(x), to(w13), to(w2), to(weights), to(ids), down_tile=(*DOWN_TILE, top_k))
        if dtype == torch.float32 and device != "cpu":
            assert rel_err(one_each, out.double().cpu()) < 1e-6, f"skinny_moe case {case}, a pick a program"
        else:
            assert torch.equal(one_each, out), f"skinny_moe case {case}, a pick a program"
        # ... and added by each block's last group to finish (last_sums), in the same order: the same bits.
        import specloop.kernels.last_sums as last_sums

        last_sums.set_enabled(True)
        try:
            by_last = skinny_moe(to(x), to(w13), to(w2), to(weights), to(ids), down_tile=(*DOWN_TILE, top_k))
        finally:
            last_sums.set_enabled(False)
        assert torch.equal(by_last, one_each), f"skinny_moe case {case}, the last group's sum"
        assert not last_sums.counts(torch.device(device)).any(), "arrival counts left non-zero"
        pairs = skinny_moe(to(x), to(w13), to(w2), to(weights), to(ids), down_tile=(4, 16, 4, 2, -(-top_k // 2)))
        assert rel_err(pairs, grouped.double().cpu()) < TOL[dtype] / 4, f"skinny_moe case {case}, two picks a program"
    # The few-rows op set runs it for a one-token step in half precision, the grouped kernels else.
    from specloop.models.few_rows_ops import FEW_ROWS_OPS

    x, w13, w2, weights, ids = (t.to(device) for t in (x, w13, w2, weights, ids))
    for t in (1, 2):
        kernel = skinny_moe if t == 1 and dtype != torch.float32 else fused_moe
        got = FEW_ROWS_OPS.fused_moe(x[:t], w13, w2, weights[:t], ids[:t])
        assert torch.equal(got, kernel(x[:t], w13, w2, weights[:t], ids[:t])), (t, dtype)
    # The norm before the experts inside the gate/up kernel, rounded as the norm kernel rounds it.
    from specloop.models.ops import TRITON_OPS, norm_moe

    nw = (torch.rand(x.shape[1], device=device) + 0.5).to(dtype)
    normed = skinny_moe(x[:1], w13, w2, weights[:1], ids[:1], norm=(nw, 1e-6))
    plain = skinny_moe(TRITON_OPS.rms_norm(x[:1], nw, 1e-6), w13, w2, weights[:1], ids[:1])
    assert rel_err(normed, plain) < TOL[dtype] / 4, "skinny_moe's norm differs"
    # A MoE layer with its norm (norm_moe): at one token in half precision the norm runs inside the
    # router's product and the experts' kernel; same result as the norm, the router and the experts.
    from specloop.models.layers import RMSNorm
    from specloop.models.moe import MoE

    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=24, num_shared_experts=2, first_dense_layers=0,
                    layer_freq=1, scoring="softmax", topk_method="greedy", num_groups=1, topk_groups=1,
                    norm_topk_prob=False, routed_scaling_factor=1.0)
    layer, norm = MoE(64, cfg).to(device), RMSNorm(64, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.3)
        layer.experts.w13.data = (torch.randn(8, 48, 64, device=device) / 8).to(dtype)
        layer.experts.w2.data = (torch.randn(8, 64, 24, device=device) / 5).to(dtype)
        norm.weight.uniform_(0.5, 1.5)
        for t in (1, 2):
            h, r = torch.randn(t, 64, dtype=dtype, device=device), torch.randn(t, 64, dtype=dtype, device=device)
            got, got_r = norm_moe(FEW_ROWS_OPS, h, r.clone(), norm, layer)
            want, want_r = norm_moe(TRITON_OPS, h, r.clone(), norm, layer)
            assert torch.equal(got_r, want_r) and rel_err(got, want) < TOL[dtype], (t, dtype)
        # At one token in half precision the shared experts' gate/up runs beside the router and the
        # routing (on a second stream on CUDA; its kernel adds the residual and norms the row
        # itself): the same bits as the router, then the experts, one after the other.
        import specloop.kernels.skinny_moe as kernels_moe

        calls, beside = [], kernels_moe.shared_beside_routing
        kernels_moe.shared_beside_routing = lambda *a, **k: calls.append(1) or beside(*a, **k)
        try:
            h, r = torch.randn(1, 64, dtype=dtype, device=device), torch.randn(1, 64, dtype=dtype, device=device)
            got, got_r = norm_moe(FEW_ROWS_OPS, h, r.clone(), norm, layer)
            kernels_moe.set_shared_stream(False)
            want, want_r = norm_moe(FEW_ROWS_OPS, h, r.clone(), norm, layer)
        finally:
            kernels_moe.set_shared_stream(True)
            kernels_moe.shared_beside_routing = beside
        assert len(calls) == (dtype != torch.float32), calls
        assert torch.equal(got, want) and torch.equal(got_r, want_r), f"the shared experts beside the routing ({dtype})"
    try:
        skinny_moe(torch.randn(5, 32, dtype=dtype, device=device), w13.to(device), w2.to(device),
                   torch.rand(5, 2, device=device), torch.zeros(5, 2, dtype=torch.int32, device=device))
    except ValueError as e:
        assert "at most 4 tokens" in str(e)
    else:
        raise AssertionError("skinny_moe took 5 tokens")


def reference_route(logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    return TorchOps().moe_route(logits, bias, moe)


def moe_config(experts: int, top_k: int, shared: int, scoring: str, method: str, groups: int, topk_groups: int,
               renorm: bool, scale: float) -> MoEConfig:
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=8, num_shared_experts=shared,
                     first_dense_layers=0, layer_freq=1, scoring=scoring, topk_method=method, num_groups=groups,
                     topk_groups=topk_groups, norm_topk_prob=renorm, routed_scaling_factor=scale)


ROUTE_CASES = [
    moe_config(8, 2, 1, "sigmoid", "noaux_tc", 4, 2, True, 2.5),  # the tests' DeepSeek-V3
    moe_config(256, 8, 1, "sigmoid", "noaux_tc", 8, 4, True, 2.5),  # DeepSeek-V3
    moe_config(64, 6, 2, "softmax", "greedy", 1, 1, False, 1.0),  # DeepSeek-V2-Lite
    moe_config(16, 3, 0, "softmax", "group_limited_greedy", 4, 2, True, 1.0),  # DeepSeek-V2
    moe_config(160, 6, 2, "softmax", "group_limited_greedy", 8, 3, False, 16.0),  # DeepSeek-V2's 160 experts
]


def check_moe_route(device: str, dtype: torch.dtype) -> None:
    """The kernel picks the reference's experts (as sets) with the reference's weights. Routing is
    float32 whatever the model's dtype, so only the float32 run checks anything."""
    from specloop.models.ops import route_options

    if dtype != torch.float32:
        return
    for moe in ROUTE_CASES:
        logits = torch.randn(9, moe.num_experts) * 2
        bias = torch.randn(moe.num_experts) * 0.3 if moe.topk_method == "noaux_tc" else None
        want_w, want_ids = reference_route(logits, bias, moe)
        def route(logits: torch.Tensor, moe: MoEConfig = moe, bias: torch.Tensor | None = bias) -> list[torch.Tensor]:
            to = lambda t: t.to(device) if t is not None else None  # noqa: E731
            return [t.cpu() for t in moe_route_kernel(to(logits), to(bias), moe.top_k, moe.num_shared_experts,
                                                      **route_options(moe))]

        got_w, got_ids = route(logits)
        for t in range(logits.shape[0]):
            want = dict(zip(want_ids[t].tolist(), want_w[t].tolist()))
            got = dict(zip(got_ids[t].tolist(), got_w[t].tolist()))
            assert want.keys() == got.keys(), (moe, t, sorted(want), sorted(got))
            assert all(abs(want[k] - got[k]) < 1e-5 for k in want), (moe, t, want, got)
        # Rows of NaN logits (a padding row's garbage), whole or in part: distinct experts that exist.
        logits[0], logits[1, ::3] = float("nan"), float("nan")
        _, got_ids = route(logits)
        for t in (0, 1):
            routed = got_ids[t, :moe.top_k].tolist()
            assert len(set(routed)) == moe.top_k and all(0 <= i < moe.num_experts for i in routed), (moe, t, routed)


def check_router_route(device: str, dtype: torch.dtype) -> None:
    """The router and the routing of one token in one launch pick the experts of the router's
    product (its norm and residual add inside) and the routing kernel after it, with their
    weights (the logits' sums run in another order), for every router of the routing checks, with
    and without a residual, in slices of the inputs or not; and write the same residual sum."""
    from specloop.kernels.gemv import skinny_norm_linear
    from specloop.kernels.last_sums import counts
    from specloop.kernels.moe_route import ROUTER_TILE, router_route
    from specloop.models.ops import route_options

    torch.manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for moe in ROUTE_CASES:
        hidden = 96
        x, r = (torch.randn(1, hidden, device=device).to(dtype) for _ in range(2))
        nw = (torch.rand(hidden, device=device) + 0.5).to(dtype)
        w = torch.randn(moe.num_experts, hidden, device=device) / 4
        bias = torch.randn(moe.num_experts, device=device) * 0.3 if moe.topk_method == "noaux_tc" else None
        options = route_options(moe)
        for residual, tile in ((r, ROUTER_TILE), (None, ROUTER_TILE), (r, (4, 1, 32, 4, 2, 32)),
                               (r, (1, 4, 16, 2, 2, 64))):
            logits, want_sum = skinny_norm_linear(x, residual, nw, 1e-6, w, split=1, out_dtype=torch.float32)
            want_w, want_ids = moe_route_kernel(logits, bias, moe.top_k, moe.num_shared_experts, **options)
            got_w, got_ids, got_sum = router_route(x, residual, nw, 1e-6, w, bias, moe.top_k, moe.num_shared_experts,
                                                   tile=tile, **options)
            assert torch.equal(got_sum, want_sum), (moe, dtype, tile, "residual sum")
            want = dict(zip(want_ids[0].tolist(), want_w[0].tolist()))
            got = dict(zip(got_ids[0].tolist(), got_w[0].tolist()))
            assert want.keys() == got.keys(), (moe, dtype, tile, sorted(want), sorted(got))
            assert all(abs(want[k] - got[k]) <= tol * max(1.0, abs(want[k])) for k in want), (moe, dtype, tile, want,
                                                                                              got)
            assert not counts(torch.device(device)).any(), "arrival count left non-zero"
    try:
        router_route(torch.randn(2, 8, device=device), None, torch.ones(8, device=device), 1e-6,
                     torch.randn(4, 8, device=device), None, 2)
    except ValueError as e:
        assert "one token" in str(e)
    else:
        raise AssertionError("router_route took two tokens")


CHECKS = {"mla_attention": check_mla_attention, "mla_rope_cache": check_mla_rope_cache, "fused_moe": check_fused_moe,
          "skinny_moe": check_skinny_moe, "moe_route": check_moe_route,
          "router_route": check_router_route}
