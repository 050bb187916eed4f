"""Each Triton kernel against a short PyTorch reference, as plain functions of (device, dtype).

Shared by ``test_triton_kernels.py`` (CPU, run in a subprocess under ``TRITON_INTERPRET=1``) and
``test_gpu_backend.py`` (CUDA). Inputs are fresh random values on every call; outputs are poisoned
first so an unwritten element fails the comparison. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import contextlib
import os

import mla_moe_checks
import fast_interpreter
import torch

from specloop.kernels.activation import silu_and_mul
from specloop.kernels.kv_write import kv_write
from specloop.kernels.paged_attention import DecodeRope, paged_attention
from specloop.kernels.qk_rope_cache import qk_rope_cache
from specloop.kernels.rms_norm import rms_norm
from specloop.kernels.rotary import rotary_embedding
from specloop.kernels.sampling import argmax_rows, gumbel_sample

# ||out - ref|| / ||ref|| bounds by dtype (METHOD: fp32 far under 1e-3, 16-bit operands 1e-3..1e-2).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}



fast_interpreter.install()  # a no-op unless TRITON_INTERPRET=1


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    assert not torch.isnan(out).any(), "NaN in output"
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qsl: torch.Tensor,
                        seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """Per sequence: gather the context through the block table, causal over the new tokens, float64."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim).double().cpu()
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim).double().cpu()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for s in range(seq_lens.shape[0]):
        a, b, n = int(qsl[s]), int(qsl[s + 1]), int(seq_lens[s])
        keys = torch.arange(n)
        slots = block_table[s].cpu().long()[keys // page_size] * page_size + keys % page_size
        k = flat_k[slots].repeat_interleave(group, 1)
        v = flat_v[slots].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double().cpu(), k) * scale
        pos = n - (b - a) + torch.arange(b - a)
        scores = scores.masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _ragged_batch(q_lens: list[int], ctx_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                  page_size: int, device: str, dtype: torch.dtype, spare_blocks: int = 3):
    seq_lens = torch.tensor([q + c for q, c in zip(q_lens, ctx_lens)], dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    max_blocks = max(1, -(-int(seq_lens.max()) // page_size))
    num_blocks = len(q_lens) * max_blocks + spare_blocks
    # Scattered physical blocks, so a wrong block-table lookup reads someone else's keys.
    block_table = torch.randperm(num_blocks)[: len(q_lens) * max_blocks].reshape(len(q_lens), max_blocks)
    k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, dtype=dtype)
    q = torch.randn(int(qsl[-1]), num_q_heads, head_dim, dtype=dtype)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(k_cache), to(v_cache), to(qsl), to(seq_lens), to(block_table.int()))


# (q heads, kv heads, head_dim, page_size, new tokens per sequence, cached tokens per sequence, splits)
ATTENTION_CASES = [
    (4, 2, 32, 16, [1, 5, 1, 20], [40, 0, 70, 3], 1),  # decode + prefill + chunk after a prefix
    (4, 2, 32, 16, [1, 1, 1], [100, 7, 300], 4),  # flash-decoding, one split beyond a short context
    (4, 2, 32, 16, [1, 1], [20, 150], 32),  # a graph's 32 splits over one tile or three: most split nothing
    (6, 2, 24, 8, [3, 1, 17], [10, 0, 33], 2),  # group of 3 (padded to 4), head_dim not a power of 2
    (2, 2, 16, 16, [70], [0], 1),  # one long prefill, several q-blocks
    (8, 1, 16, 4, [4, 4], [9, 0], 1),  # draft verification shape: 4 new tokens after a context
    (16, 1, 16, 4, [2, 3], [5, 0], 1),  # a group of 16: short multi-token queries are one token per tile
]


@contextlib.contextmanager
def _nan_scratch():
    """``torch.empty`` of floating point returns NaNs meanwhile: a kernel that reads scratch it did
    not write (the partial sums of a split past the keys) returns NaN instead of what the
    allocator happened to hold."""
    empty = torch.empty

    def poisoned(*args, **kwargs):  # type: ignore[no-untyped-def]
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


def check_paged_attention(device: str, dtype: torch.dtype, cases: list | None = None) -> None:
    for nq, nkv, d, ps, q_lens, ctx, splits in cases or ATTENTION_CASES:
        q, kc, vc, qsl, seq_lens, bt = _ragged_batch(q_lens, ctx, nq, nkv, d, ps, device, dtype)
        out = torch.full_like(q, float("nan"))
        with _nan_scratch():
            paged_attention(q, kc, vc, qsl, seq_lens, bt, scale=d ** -0.5, max_query_len=max(q_lens),
                            num_splits=splits, out=out)
        ref = reference_attention(q, kc, vc, qsl, seq_lens, bt, d ** -0.5)
        err = rel_err(out, ref)
        assert err < TOL[dtype], f"attention case {nq, nkv, d, ps, q_lens, ctx, splits}: rel err {err:.2e}"
        if max(q_lens) == 1 and splits > 1:  # a decode step's splits merged by the last to finish
            import specloop.kernels.last_sums as last_sums

            last_sums.set_enabled(True)
            try:
                with _nan_scratch():
                    merged = paged_attention(q, kc, vc, qsl, seq_lens, bt, scale=d ** -0.5, max_query_len=1,
                                             num_splits=splits)
            finally:
                last_sums.set_enabled(False)
            assert rel_err(merged, ref) < TOL[dtype], f"attention merged by its last split: {rel_err(merged, ref):.2e}"
            assert not last_sums.counts(torch.device(device)).any(), "arrival counts left non-zero"


def check_attention_rope(device: str, dtype: torch.dtype) -> None:
    """A decode step with its q/k norms, rotary embedding and KV write inside the attention kernel
    (``rope=DecodeRope(...)``) against ``qk_rope_cache`` then attention: the same outputs, the
    same cache (the new slots written, nothing else); a padding row (slot -1, no new token)."""
    nq, nkv, d, ps = 4, 2, 32, 4
    cos, sin = rope_tables(128, d, 10000.0)
    for with_norm, ctx, splits in ((True, [9, 0, 30], 1), (False, [9, 0, 30], 4), (True, [3, 17, 60], 8)):
        _, kc, vc, qsl, seq_lens, bt = _ragged_batch([1] * len(ctx), ctx, nq, nkv, d, ps, device, dtype)
        tokens = len(ctx)
        qkv = torch.randn(tokens, (nq + 2 * nkv) * d, dtype=dtype, device=device)
        positions = (seq_lens - 1).long()
        slots = torch.stack([bt[i, int(p) // ps].long() * ps + int(p) % ps for i, p in enumerate(positions.tolist())])
        qw, kw = (torch.randn(d, dtype=dtype, device=device) for _ in range(2))
        norms = (qw, kw) if with_norm else (None, None)
        to = lambda t: t.to(device)  # noqa: E731
        # The reference: the separate kernel, then attention over the cache it wrote.
        kc_ref, vc_ref, qkv_ref = kc.clone(), vc.clone(), qkv.clone()
        q = qk_rope_cache(qkv_ref, nq, nkv, positions, to(cos), to(sin), kc_ref, vc_ref, slots, *norms, eps=1e-6)
        want = paged_attention(q, kc_ref, vc_ref, qsl, seq_lens, bt, scale=d ** -0.5, max_query_len=1,
                               num_splits=splits)
        rope = DecodeRope(positions, to(cos), to(sin), slots, *norms, eps=1e-6)
        got = paged_attention(qkv.view(tokens, nq + 2 * nkv, d), kc, vc, qsl, seq_lens, bt, scale=d ** -0.5,
                              max_query_len=1, num_splits=splits, rope=rope)
        case = f"norm={with_norm} contexts={ctx} splits={splits}"
        assert got.shape == (tokens, nq, d) and rel_err(got, want) < TOL[dtype], f"{case}: output differs"
        assert rel_err(kc, kc_ref) < TOL[dtype] and torch.equal(vc, vc_ref), f"{case}: cache differs"
    # Rows past the batch (CUDA-graph padding: no new token, slot -1) write nothing.
    _, kc, vc, qsl, seq_lens, bt = _ragged_batch([1, 0], [5, 4], nq, nkv, d, ps, device, dtype)
    before = kc.clone()
    qkv = torch.randn(2, (nq + 2 * nkv) * d, dtype=dtype, device=device)
    slots = torch.tensor([int(bt[0, 5 // ps]) * ps + 5 % ps, -1], device=device)
    rope = DecodeRope((seq_lens - 1).long(), cos.to(device), sin.to(device), slots)
    paged_attention(qkv.view(2, nq + 2 * nkv, d), kc, vc, qsl, seq_lens, bt, scale=d ** -0.5, max_query_len=1,
                    num_splits=2, rope=rope)
    changed = (kc != before).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [int(slots[0])], f"rows written: {changed}"


def check_kv_write(device: str, dtype: torch.dtype) -> None:
    num_blocks, page_size, heads, dim = 6, 4, 3, 16
    k = torch.randn(7, heads, dim, dtype=dtype, device=device)
    v = torch.randn(7, heads, dim, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, page_size, heads, dim, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, page_size, heads, dim, dtype=dtype, device=device)
    slots = torch.tensor([5, 0, 23, 9, -1, 14, 2], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k.view(-1, heads, dim)[s] = k[t]
            want_v.view(-1, heads, dim)[s] = v[t]
    kv_write(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), "kv_write wrote the wrong slots"


def reference_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm.forward."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def check_rms_norm(device: str, dtype: torch.dtype) -> None:
    for rows, n in ((5, 64), (3, 48), (4, 1024)):
        x = torch.randn(rows, n, dtype=dtype, device=device)
        res = torch.randn(rows, n, dtype=dtype, device=device)
        w = torch.randn(n, dtype=dtype, device=device)
        out = torch.full_like(x, float("nan"))
        rms_norm(x, w, 1e-6, out=out)
        err = rel_err(out, reference_rms_norm(x, w, 1e-6))
        assert err < TOL[dtype], f"rms_norm {rows}x{n}: rel err {err:.2e}"
        want_res = x + res
        res2 = res.clone()
        out = rms_norm(x, w, 1e-6, residual=res2)
        assert torch.equal(res2, want_res), "fused residual add differs from x + residual"
        err = rel_err(out, reference_rms_norm(want_res, w, 1e-6))
        assert err < TOL[dtype], f"fused rms_norm {rows}x{n}: rel err {err:.2e}"
    # Per-head norm in place on the q slice of a fused qkv projection (a strided 3-D view).
    qkv = torch.randn(5, 6 * 32, dtype=dtype, device=device)
    q = qkv[:, : 4 * 32].view(5, 4, 32)
    w = torch.randn(32, dtype=dtype, device=device)
    want, rest = reference_rms_norm(q, w, 1e-6), qkv[:, 4 * 32:].clone()
    rms_norm(q, w, 1e-6, out=q)
    assert rel_err(q, want) < TOL[dtype], "in-place per-head rms_norm differs"
    assert torch.equal(qkv[:, 4 * 32:], rest), "per-head rms_norm wrote outside its view"


def rope_tables(max_pos: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def reference_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's apply_rotary_pos_emb on [tokens, heads, dim] with its dtype roundings."""
    c = torch.cat([cos, cos], -1)[positions].to(x.dtype)[:, None, :]
    s = torch.cat([sin, sin], -1)[positions].to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * c + rotated * s


def check_rotary(device: str, dtype: torch.dtype) -> None:
    tokens, nq, nkv, d = 6, 4, 2, 32
    cos, sin = rope_tables(64, d, 10000.0)
    qkv = torch.randn(tokens, (nq + 2 * nkv) * d, dtype=dtype, device=device)
    q = qkv[:, : nq * d].view(tokens, nq, d)
    k = qkv[:, nq * d: (nq + nkv) * d].view(tokens, nkv, d)
    positions = torch.tensor([0, 1, 7, 63, 20, 3], device=device)
    want_q = reference_rotary(q.cpu(), positions.cpu(), cos, sin)
    want_k = reference_rotary(k.cpu(), positions.cpu(), cos, sin)
    v_before = qkv[:, (nq + nkv) * d:].clone()
    rotary_embedding(q, k, positions, cos.to(device), sin.to(device))
    # Within the dtype's tolerance, not bit-exact: on the GPU the compiler may keep the products in
    # float32 instead of rounding them (2e-3 relative in bf16, measured on the H200).
    assert rel_err(q, want_q) < TOL[dtype] and rel_err(k, want_k) < TOL[dtype], "rotary differs"
    assert torch.equal(qkv[:, (nq + nkv) * d:], v_before), "rotary touched the value heads"


def check_qk_rope_cache(device: str, dtype: torch.dtype) -> None:
    """The fused q/k norm + rotary + KV write against the reference norm, rotary and slot scatter."""
    tokens, nq, nkv, d, num_blocks, page = 6, 4, 2, 32, 5, 4
    cos, sin = rope_tables(64, d, 10000.0)
    positions = torch.tensor([0, 1, 7, 63, 20, 3])
    slots = torch.tensor([5, 0, 17, -1, 9, 2])
    for with_norm in (True, False):
        qkv = torch.randn(tokens, (nq + 2 * nkv) * d, dtype=dtype)
        qw, kw = torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype)
        k_cache = torch.randn(num_blocks, page, nkv, d, dtype=dtype)
        v_cache = torch.randn(num_blocks, page, nkv, d, dtype=dtype)
        q = qkv[:, : nq * d].view(tokens, nq, d)
        k = qkv[:, nq * d: (nq + nkv) * d].view(tokens, nkv, d)
        v = qkv[:, (nq + nkv) * d:].view(tokens, nkv, d)
        if with_norm:
            q, k = reference_rms_norm(q, qw, 1e-6), reference_rms_norm(k, kw, 1e-6)
        want_q, want_k = reference_rotary(q, positions, cos, sin), reference_rotary(k, positions, cos, sin)
        want_kc, want_vc = k_cache.clone(), v_cache.clone()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                want_kc.view(-1, nkv, d)[s] = want_k[t]
                want_vc.view(-1, nkv, d)[s] = v[t]
        to = lambda t: t.to(device)  # noqa: E731
        qkv_d, kc_d, vc_d = to(qkv), to(k_cache), to(v_cache)
        got_q = qk_rope_cache(qkv_d, nq, nkv, to(positions), to(cos), to(sin), kc_d, vc_d, to(slots),
                              to(qw) if with_norm else None, to(kw) if with_norm else None, eps=1e-6)
        tol = TOL[dtype]
        assert rel_err(got_q, want_q) < tol, f"q differs (norm={with_norm}): {rel_err(got_q, want_q):.2e}"
        assert rel_err(kc_d, want_kc) < tol and rel_err(vc_d, want_vc) < tol, f"cache differs (norm={with_norm})"
        untouched = [b for b in range(num_blocks * page) if b not in slots.tolist()]
        assert torch.equal(kc_d.view(-1, nkv, d)[untouched].cpu(), k_cache.view(-1, nkv, d)[untouched]), \
            "wrote a slot it was not given"


def check_silu_and_mul(device: str, dtype: torch.dtype) -> None:
    for rows, d in ((3, 40), (2, 3000)):
        x = torch.randn(rows, 2 * d, dtype=dtype, device=device)
        want = torch.nn.functional.silu(x[:, :d]) * x[:, d:]
        out = torch.full((rows, d), float("nan"), dtype=dtype, device=device)
        silu_and_mul(x, out=out)
        assert rel_err(out, want) < TOL[dtype] / 10, "silu_and_mul differs"


def check_skinny_linear(device: str, dtype: torch.dtype) -> None:
    """The few-rows linear layer against ``F.linear`` in float64: one to four rows one at a time, 4
    to 16 output features a program, and two to ``MAX_ROWS`` rows on tensor cores, with and without
    a bias, over a single slice of ``K`` and split into slices (a ragged last one) added in order."""
    from specloop.kernels.gemv import (MAX_ROWS, few_rows_linear, skinny_gated_linear, skinny_linear,
                                       skinny_norm_linear)

    # One row at a time (``dot=False``, up to four rows), and from two rows on tensor cores (16 or
    # 32 features a program, up to MAX_ROWS rows).
    for rows, n, k, split, bias, block_n, dot in (
            (1, 37, 300, None, False, None, None), (3, 50, 1100, 4, True, 8, False), (4, 16, 64, 1, True, 16, False),
            (2, 70, 2048, None, False, 4, False), (2, 37, 300, None, False, None, True),
            (5, 50, 1100, 4, True, 16, None), (MAX_ROWS, 40, 64, 1, True, 32, True), (9, 70, 600, 2, False, None, None)):
        x = torch.randn(rows, k, dtype=dtype, device=device)
        w = torch.randn(n, k, dtype=dtype, device=device) / k ** 0.5
        b = torch.randn(n, dtype=dtype, device=device) if bias else None
        want = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
        out = skinny_linear(x, w, b, tile=(64, 4, 2), block_n=block_n, split=split, num_sms=4, dot=dot)
        assert out.dtype == dtype and out.shape == (rows, n)
        assert rel_err(out, want) < TOL[dtype], \
            f"skinny_linear differs at {rows} x {n} x {k}, {block_n} / {split} / dot {dot}"
    for call, words in ((lambda: skinny_linear(x, w, dot=False), "one-row-at-a-time"),
                        (lambda: skinny_linear(x, w, block_n=8, dot=True), "16 features")):
        try:
            call()  # x: 9 rows
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"skinny_linear took a call it refuses ({words})")
    # Slices of K added by the last program of each column block to arrive (``kernels.last_sums``): the
    # second pass's bits, with a bias, the norm and the activation prologues; counters back at zero.
    import specloop.kernels.last_sums as last_sums

    x, w, b = (torch.randn(*shape, dtype=dtype, device=device) for shape in ((2, 1100), (50, 1100), (50,)))
    r, nw, gate_up = (torch.randn(*shape, dtype=dtype, device=device) for shape in ((2, 1100), (1100,), (2, 2200)))
    calls = (lambda: skinny_linear(x, w, b, tile=(64, 4, 2), block_n=8, split=4, num_sms=4, dot=False),
             lambda: skinny_norm_linear(x, r, nw, 1e-6, w, tile=(64, 4, 2), split=4, num_sms=4, dot=False)[0],
             lambda: skinny_gated_linear(gate_up, w, tile=(64, 4, 2), split=2, num_sms=4, dot=False))
    try:
        for call in calls:
            last_sums.set_enabled(False)
            want = call()
            last_sums.set_enabled(True)
            assert torch.equal(call(), want), "the last program's sum differs from the second pass's"
        assert not last_sums.counts(torch.device(device)).any(), "arrival counts left non-zero"
    finally:
        last_sums.set_enabled(False)
    # Per-head products of one token (latent attention's W_UK and W_UV): weights contiguous along
    # the outputs, and a transposed view contiguous along the reduction, as the model holds them.
    from specloop.kernels.latent_heads import head_gemv

    for heads, k, n in ((3, 40, 70), (4, 300, 24)):
        x = torch.randn(heads, k, dtype=dtype, device=device)
        for w in (torch.randn(heads, k, n, dtype=dtype, device=device),
                  torch.randn(heads, n, k, dtype=dtype, device=device).transpose(1, 2)):
            out = head_gemv(x, w / k ** 0.5, num_sms=4)
            want = torch.bmm(x.double()[:, None], (w / k ** 0.5).double())[:, 0]
            assert out.dtype == dtype and rel_err(out, want) < TOL[dtype], f"head_gemv differs at {heads} x {k} x {n}"
    # Fused prologues: a decoder layer's RMSNorm (with and without the residual add), and a gated
    # MLP's SiLU-and-mul, rounded as the unfused ops round them.
    for rows, k, split, with_residual in ((1, 300, None, True), (3, 700, 2, True), (2, 96, 1, False),
                                          (7, 300, 2, True), (MAX_ROWS, 96, 1, False)):
        x, r = (torch.randn(rows, k, dtype=dtype, device=device) for _ in range(2))
        nw = torch.rand(k, dtype=dtype, device=device) + 0.5
        w = torch.randn(40, k, dtype=dtype, device=device) / k ** 0.5
        summed = (x.float() + r.float()).to(dtype) if with_residual else x
        sf = summed.float()
        h = ((sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float() * nw.float()).to(dtype)
        out, new_residual = skinny_norm_linear(x, r if with_residual else None, nw, 1e-6, w, tile=(64, 4, 2),
                                               split=split, num_sms=4)
        assert torch.equal(new_residual, summed), "the fused norm's residual sum differs"
        assert rel_err(out, torch.nn.functional.linear(h.double(), w.double())) < TOL[dtype], "fused norm differs"
        gate_up = torch.randn(rows, 2 * k, dtype=dtype, device=device)
        act = (torch.nn.functional.silu(gate_up[:, :k].float()).to(dtype).float() * gate_up[:, k:].float()).to(dtype)
        out = skinny_gated_linear(gate_up, w, tile=(64, 4, 2), split=split, num_sms=4)
        assert rel_err(out, torch.nn.functional.linear(act.double(), w.double())) < TOL[dtype], "fused SiLU differs"
    # The few-rows op set runs them for a layer's norm + projection and activation + projection.
    from specloop.models.layers import RMSNorm
    from specloop.models.few_rows_ops import FEW_ROWS_OPS
    from specloop.models.ops import TRITON_OPS, gated_linear, norm_linear
    from specloop.models.parallel import ColumnParallelLinear, RowParallelLinear, Shard

    norm = RMSNorm(64, 1e-6).to(device=device, dtype=dtype)
    norm.weight.data.uniform_(0.5, 1.5)
    up = ColumnParallelLinear(64, [Shard(96, 0, 96)], bias=False).to(device=device, dtype=dtype)
    down = RowParallelLinear(48, 64, bias=True).to(device=device, dtype=dtype)
    x, r = torch.randn(2, 64, dtype=dtype, device=device), torch.randn(2, 64, dtype=dtype, device=device)
    with torch.no_grad():
        fused, fused_r = norm_linear(FEW_ROWS_OPS, x, r.clone(), norm, up)
        plain, plain_r = norm_linear(TRITON_OPS, x, r.clone(), norm, up)
        assert torch.equal(fused_r, plain_r) and rel_err(fused, plain) < TOL[dtype], "few-rows norm_linear differs"
        assert rel_err(gated_linear(FEW_ROWS_OPS, fused, down), gated_linear(TRITON_OPS, fused, down)) < TOL[dtype]
    x = torch.randn(2, 3, 64, dtype=dtype, device=device)  # leading dims, as a layer's input has them
    w = torch.randn(24, 64, dtype=dtype, device=device)
    assert few_rows_linear(x, w).shape == (2, 3, 24)
    assert rel_err(few_rows_linear(x, w), torch.nn.functional.linear(x.double(), w.double())) < TOL[dtype]
    try:
        skinny_linear(torch.randn(MAX_ROWS + 1, 64, dtype=dtype, device=device), w)
    except ValueError as e:
        assert "at most" in str(e)
    else:
        raise AssertionError("skinny_linear took more rows than it handles")


def _rowwise_interpreter_dot() -> None:
    """Under ``TRITON_INTERPRET`` a ``tl.dot`` tile is numpy's matmul, whose BLAS may round a row
    differently by where it sits in the tile (numpy 2.4's does, by one ulp); a GPU's MMA tile does
    not. Each row of an interpreted dot is then computed alone, so that the batch-invariance checks
    test the kernel's own tiling and reduction order."""
    import numpy as np
    from triton.runtime import interpreter

    class RowwiseNumpy:
        def __getattr__(self, name: str) -> object:
            return getattr(np, name)

        @staticmethod
        def matmul(a: np.ndarray, b: np.ndarray, **kwargs: object) -> np.ndarray:
            if a.ndim != 2:
                return np.matmul(a, b, **kwargs)
            return np.stack([np.matmul(row[None], b, **kwargs)[0] for row in a])

    interpreter.np = RowwiseNumpy()


def check_matmul(device: str, dtype: torch.dtype) -> None:
    """The batch-invariant matmul against ``F.linear``, and each row bit-identical whatever shares
    its launch (1, 5 or 70 rows, at any offset among them)."""
    from specloop.kernels.matmul import invariant_linear

    if os.environ.get("TRITON_INTERPRET") == "1":
        _rowwise_interpreter_dot()

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 100, generator=gen).to(device=device, dtype=dtype)
    w = torch.randn(90, 100, generator=gen).to(device=device, dtype=dtype) / 10
    b = torch.randn(90, generator=gen).to(device=device, dtype=dtype)
    full = invariant_linear(x, w, b)
    want = torch.nn.functional.linear(x.float(), w.float(), b.float())
    assert rel_err(full, want) < TOL[dtype], "invariant_linear differs from F.linear"
    for rows in (slice(3, 4), slice(0, 5), slice(66, 70)):
        assert torch.equal(invariant_linear(x[rows], w, b), full[rows]), f"rows {rows} depend on the batch"
    assert torch.equal(invariant_linear(x[7].view(1, 1, 100), w)[0, 0], invariant_linear(x, w)[7])


def check_token_bitmask(device: str, dtype: torch.dtype) -> None:
    """The grammar-mask kernel against the torch reference: masked rows only, words past the
    mask's end forbidden, several blocks per row."""
    from specloop.kernels.token_bitmask import apply_token_bitmask
    from specloop.sampling.structured_outputs import apply_token_bitmask_torch

    gen = torch.Generator().manual_seed(0)
    for vocab, words, rows in ((100, 4, [0, 2, 3]), (70, 2, [1]), (64, 2, [])):
        logits = torch.randn(4, vocab, generator=gen).to(device=device, dtype=dtype)
        bitmask = torch.randint(-2**31, 2**31 - 1, (len(rows), words), generator=gen, dtype=torch.int64)
        bitmask = bitmask.to(torch.int32).to(device)
        indices = torch.tensor(rows, dtype=torch.int64, device=device)
        want = logits.clone()
        apply_token_bitmask_torch(want, bitmask, indices)
        got = logits.clone()
        apply_token_bitmask(got, bitmask, indices, block=32)
        assert torch.equal(got, want), f"token bitmask differs (vocab {vocab}, {words} words, rows {rows})"
        untouched = [r for r in range(4) if r not in rows]
        assert torch.equal(got[untouched], logits[untouched])


def check_verify(device: str, dtype: torch.dtype) -> None:
    """A greedy verification's accepted counts, next tokens, rejected counts and drafts written on
    the device against a torch reference; then the prepare kernel pulling a step planned as if
    every draft were accepted back by those counts. (Integers only: ``dtype`` is unused.)"""
    from specloop.kernels.prepare_inputs import prepare_inputs
    from specloop.kernels.verify import accept, write_drafts

    gen = torch.Generator().manual_seed(0)
    for q, k in ((4, 3), (2, 1), (3, 5)):
        n, slots, row_len = 5, 7, 40
        req_slots = torch.randperm(slots, generator=gen)[:n].to(torch.int32)
        first = torch.randint(0, 20, (n,), generator=gen)
        positions = (first[:, None] + torch.arange(q)).reshape(-1)
        top = torch.randint(0, 9, (n * q,), generator=gen)
        input_ids = torch.randint(0, 9, (n * q,), generator=gen)
        # Request i's drafts agree with the target for its first i rows (all of them past q - 1).
        for i in range(n):
            input_ids[i * q + 1:i * q + 1 + min(i, q - 1)] = top[i * q:i * q + min(i, q - 1)]
            if i < q - 1:
                input_ids[i * q + 1 + i] = (top[i * q + i] + 1) % 9
        tokens = torch.randint(0, 9, (slots, row_len), generator=gen, dtype=torch.int32)
        lag = torch.zeros(slots, dtype=torch.int32)
        drafts = torch.randint(100, 200, (n, k), generator=gen)
        want_tokens, want_lag = tokens.clone(), lag.clone()
        want_accepted = torch.tensor([min(i, q - 1) + 1 for i in range(n)])
        for i in range(n):
            a, s = int(want_accepted[i]), int(req_slots[i])
            at = int(first[i]) + a
            want_tokens[s, at] = int(top[i * q + a - 1])
            want_tokens[s, at + 1:at + 1 + k] = drafts[i].to(torch.int32)
            want_lag[s] = q - a
        input_ids, top, positions, req_slots, tokens, lag, drafts = (
            t.to(device) for t in (input_ids, top, positions, req_slots, tokens, lag, drafts))
        accepted = accept(input_ids, top, positions, q, req_slots, tokens, lag)
        write_drafts(drafts, accepted, positions, q, req_slots, tokens)
        assert torch.equal(accepted.cpu(), want_accepted), (q, accepted, want_accepted)
        assert torch.equal(tokens.cpu(), want_tokens) and torch.equal(lag.cpu(), want_lag), (q, k)
        # The next step, planned as if each accepted all q rows, for requests 0, 2, 4 (flagged).
        lagged = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int32, device=device)
        starts = (first.to(device) + q).to(torch.int32)
        seq_lens = starts + q
        qsl = torch.arange(n + 1, dtype=torch.int32, device=device) * q
        table = torch.arange(slots * 4, dtype=torch.int32, device=device).view(slots, 4)
        ids, pos, slot_mapping = (torch.zeros(n * q, dtype=torch.int64, device=device) for _ in range(3))
        back = lagged * lag[req_slots.long()]
        want_starts, want_lens = starts - back, seq_lens - back
        prepare_inputs(tokens, table, req_slots, starts, qsl, 16, ids, pos, slot_mapping, lag=lag, lagged=lagged,
                       seq_lens=seq_lens)
        assert torch.equal(starts, want_starts) and torch.equal(seq_lens, want_lens), (q, starts, want_starts)
        want_pos = (want_starts.long()[:, None] + torch.arange(q, device=device)).reshape(-1)
        assert torch.equal(pos, want_pos)
        assert torch.equal(ids, tokens[req_slots.long().repeat_interleave(q), want_pos].long())


def check_ngram(device: str, dtype: torch.dtype) -> None:
    """The device search after a verification (``kernels.ngram``) against the host proposer's
    (``find_ngram_continuation``), over random token rows of small vocabularies (many matches,
    repeats, no match at all), rows longer than one block of candidates, a newest position past a
    row's end (a padding row) clamped. (Integers only: ``dtype`` is unused.)"""
    import numpy as np

    from specloop.kernels.ngram import ngram_drafts
    from specloop.proposers.ngram import find_ngram_continuation

    gen = torch.Generator().manual_seed(0)
    for q, k, min_n, max_n, vocab, row_len in ((4, 3, 1, 4, 3, 40), (2, 5, 2, 3, 5, 2500), (3, 1, 1, 1, 50, 30)):
        n, slots = 6, 8
        tokens = torch.randint(0, vocab, (slots, row_len), generator=gen, dtype=torch.int32)
        req_slots = torch.randperm(slots, generator=gen)[:n].to(torch.int32)
        accepted = torch.randint(1, q + 1, (n,), generator=gen)
        first = torch.randint(0, row_len - q, (n,), generator=gen)
        first[0] = 0  # one known token: nothing to match
        first[1] = row_len + 5  # past the row: searched as the whole row
        positions = (first[:, None] + torch.arange(q)).reshape(-1)
        out = torch.full((n, k), -7, dtype=torch.int64)
        got = ngram_drafts(tokens.to(device), req_slots.to(device), positions.to(device), accepted.to(device), q,
                           min_n, max_n, k, out=out.to(device)).cpu()
        for i in range(n):
            known = min(max(int(first[i] + accepted[i]) + 1, 1), row_len)
            row = tokens[int(req_slots[i]), :known].numpy().astype(np.int64)
            want = find_ngram_continuation(row, min_n, max_n, k).tolist() or [int(row[-1])] * k
            assert got[i].tolist() == want, (q, k, i, got[i].tolist(), want)


def check_gumbel_sample(device: str, vocab: int = 37, num_draws: int = 20000, max_tv: float = 0.03) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, vocab, generator=gen) * 2
    logits[2, 5] = logits[2].max() + 1.0  # a clear winner for the greedy row
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.3])
    logits, temperature, min_p = logits.to(device), temperature.to(device), min_p.to(device)
    seeds = torch.tensor([11, 12, 13, 14], device=device)
    # Many steps of the same rows: the empirical distribution must match softmax(logits / T).
    out = gumbel_sample(logits.repeat(num_draws, 1), temperature.repeat(num_draws), seeds.repeat(num_draws),
                        torch.arange(num_draws, device=device).repeat_interleave(4),
                        min_p=min_p.repeat(num_draws)).cpu()
    assert (out[2::4] == 5).all(), "greedy row did not take the argmax"
    for r in (0, 1, 3):
        counts = torch.bincount(out[r::4], minlength=vocab).double()
        probs = torch.softmax(logits[r].double().cpu() / float(temperature[r]), -1)
        if r == 3:
            probs = torch.where(probs >= 0.3 * probs.max(), probs, 0.0)
            probs = probs / probs.sum()
            assert counts[probs == 0].sum() == 0, "min-p let a filtered token through"
        tv = 0.5 * float((counts / num_draws - probs).abs().sum())
        assert tv < max_tv, f"row {r}: total variation {tv:.3f} from softmax(logits / T)"
    # Same seeds and positions as the torch reference sampler: the same tokens.
    from specloop.sampling.sampler import SamplingMetadata, SamplingRow, sample
    from specloop.kernel.sampling_params import SamplingParams

    n = min(num_draws, 64)
    params = [SamplingParams(temperature=float(t), min_p=float(m)) for t, m in zip(temperature, min_p)]
    rows = [SamplingRow(params[r % 4], 11 + r % 4, r // 4, [], [], []) for r in range(4 * n)]
    meta = SamplingMetadata.build(rows, vocab, torch.device(device))
    want = sample(logits.float().repeat(n, 1), meta).cpu()
    assert torch.equal(out[: 4 * n], want), "the Gumbel kernel and the torch sampler drew different tokens"
    # A row split over programs draws what the whole row draws (rows without min-p).
    args = (logits.repeat(n, 1), temperature.repeat(n), seeds.repeat(n), torch.arange(n, device=device).repeat_interleave(4))
    whole = gumbel_sample(*args, chunks=1).cpu()
    for chunks in (2, 4):
        assert torch.equal(gumbel_sample(*args, chunks=chunks).cpu(), whole), f"{chunks} chunks a row drew otherwise"


def check_argmax_rows(device: str, dtype: torch.dtype) -> None:
    """The argmax of each row, ties to the lowest index, with the row whole or split over programs
    (a row whose best lies in its last chunk, a tie across chunks, an all -inf row, NaNs: the first
    one, as torch)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(7, vocab, generator=gen).to(dtype)
    logits[1, vocab - 1] = 10.0  # in the last chunk
    logits[2, 700] = logits[2, 100] = 10.0  # a tie across chunks: the lower index
    logits[3] = float("-inf")
    logits[4, 300] = logits[4, 301] = 10.0  # a tie inside a chunk
    logits[5] = float("nan")
    logits[6, 650] = logits[6, 900] = float("nan")
    logits = logits.to(device)
    want = logits.float().argmax(dim=-1).cpu()
    assert want[2] == 100 and want[3] == 0 and want[4] == 300 and want[5] == 0 and want[6] == 650
    for chunks in (None, 1, 2, 8):
        got = argmax_rows(logits, chunks=chunks).cpu()
        assert torch.equal(got, want), f"chunks={chunks}: {got.tolist()} != {want.tolist()}"
    out = torch.full((7,), -1, dtype=torch.int64, device=device)
    assert argmax_rows(logits[:, :512], out=out, chunks=4) is out
    assert torch.equal(out.cpu(), logits[:, :512].float().argmax(dim=-1).cpu())


_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int32: "i32",
                 torch.int64: "i64"}


def hopper_launches() -> list[tuple[object, dict, dict]]:
    """Call every launcher with CPU tensors of the model shapes (qwen3-0.6b attention, bf16) and
    record each kernel launch as (kernel, arguments, launch options) instead of running it."""
    import specloop.kernels.activation as activation
    import specloop.kernels.fused_moe as moe
    import specloop.kernels.gemv as gemv
    import specloop.kernels.kv_write as kv_write_mod
    import specloop.kernels.last_sums as last_sums
    import specloop.kernels.latent_heads as latent_heads
    import specloop.kernels.matmul as matmul
    import specloop.kernels.mla_attention as mla
    import specloop.kernels.mla_rope_cache as mla_rope
    import specloop.kernels.moe_route as route
    import specloop.kernels.ngram as ngram
    import specloop.kernels.paged_attention as attention
    import specloop.kernels.pdl as pdl
    import specloop.kernels.prepare_inputs as prepare
    import specloop.kernels.verify as verify
    import specloop.kernels.qk_rope_cache as qk_rope
    import specloop.kernels.rms_norm as rms_norm_mod
    import specloop.kernels.rotary as rotary
    import specloop.kernels.sampling as sampling
    import specloop.kernels.rows_dot as rows_dot
    import specloop.kernels.skinny_moe as skinny_moe

    launches: list[tuple[object, dict, dict]] = []

    class Recorder:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def __getitem__(self, grid: object):
            def launch(*args, **kwargs):
                names = self.fn.arg_names
                options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
                launches.append((self.fn, dict(zip(names, args)) | kwargs, options))
            return launch

    modules = (activation, kv_write_mod, attention, prepare, qk_rope, rms_norm_mod, rotary, sampling, mla, mla_rope,
               moe, skinny_moe, route, matmul, gemv, rows_dot, verify, ngram, latent_heads)
    saved = [(m, n, getattr(m, n)) for m in modules for n in dir(m) if n.startswith("_") and n.endswith("_kernel")]
    for m, n, fn in saved:
        setattr(m, n, Recorder(fn))
    # As on the H200: programmatic dependent launch on (the kernels' waits, the weights' prefetch).
    saved += [(pdl, "launch_options", pdl.launch_options), (pdl, "prefetch_budget", pdl.prefetch_budget)]
    pdl.launch_options = lambda device: {"PDL": True, "launch_pdl": True}
    pdl.prefetch_budget = lambda device: 1 << 30
    try:
        for dtype in (torch.bfloat16,):
            q, kc, vc, qsl, seq_lens, bt = _ragged_batch([1, 1, 300], [500, 9, 0], 16, 8, 128, 16, "cpu", dtype)
            for splits in (1, 8):
                attention.paged_attention(q, kc, vc, qsl, seq_lens, bt, scale=0.1, max_query_len=300,
                                          num_splits=splits)
                attention.paged_attention(q, kc, vc, qsl, seq_lens, bt, scale=0.1, max_query_len=1,
                                          num_splits=splits)
            last_sums.set_enabled(True)  # a decode step's splits merged by the last to finish
            try:
                attention.paged_attention(q, kc, vc, qsl, seq_lens, bt, scale=0.1, max_query_len=1, num_splits=8)
            finally:
                last_sums.set_enabled(False)
            from specloop.backends.gpu.triton_attention import TritonAttentionBackend

            for max_q in (1, 300):  # batch-invariant mode
                attention.paged_attention(q, kc, vc, qsl, seq_lens, bt, scale=0.1, max_query_len=max_q, invariant=True)
            for rows in (1, 300):
                matmul.invariant_linear(torch.randn(rows, 1024, dtype=dtype), torch.randn(4096, 1024, dtype=dtype))
            for rows, tile in ((1, gemv.DEFAULT_TILE), (4, (512, 8, 4)), (2, (128, 2, 2))):
                w = torch.randn(1024, 3072, dtype=dtype)  # narrow (a down projection) and wide (an LM head)
                for block_n, split in ((4, 1), (4, 2), (8, 1), (16, 1)):
                    gemv.skinny_linear(torch.randn(rows, 3072, dtype=dtype), w, w[0], tile=tile, block_n=block_n,
                                       split=split, dot=False)
                last_sums.set_enabled(True)  # the slices added by the last program to arrive
                try:
                    gemv.skinny_linear(torch.randn(rows, 3072, dtype=dtype), w, w[0], tile=tile, block_n=4, split=4, dot=False)
                    gemv.skinny_gated_linear(torch.randn(rows, 6144, dtype=dtype), w, tile=tile, block_n=4, split=4, dot=False)
                finally:
                    last_sums.set_enabled(False)
                gemv.skinny_linear(torch.randn(rows, 1024, dtype=dtype), torch.randn(151936, 1024, dtype=dtype),
                                   tile=tile, dot=False)
                h = torch.randn(rows, 1024, dtype=dtype)
                gemv.skinny_norm_linear(h, h.clone(), h[0], 1e-6, torch.randn(4096, 1024, dtype=dtype), tile=tile,
                                        dot=False)
                gemv.skinny_norm_linear(h, None, h[0], 1e-6, torch.randn(6144, 1024, dtype=dtype), tile=tile,
                                        dot=False)
                gemv.skinny_gated_linear(torch.randn(rows, 6144, dtype=dtype), w, tile=tile, dot=False)
            for rows in (gemv.DOT_ROWS, 16):  # the tensor-core kernel: its prologues, splits and widths
                w = torch.randn(1024, 3072, dtype=dtype)
                for block_n, split in ((16, 1), (32, 4)):
                    gemv.skinny_linear(torch.randn(rows, 3072, dtype=dtype), w, w[0], block_n=block_n, split=split)
                h = torch.randn(rows, 1024, dtype=dtype)
                gemv.skinny_norm_linear(h, h.clone(), h[0], 1e-6, torch.randn(4096, 1024, dtype=dtype))
                gemv.skinny_norm_linear(h, None, h[0], 1e-6, torch.randn(64, 1024), split=1, out_dtype=torch.float32)
                gemv.skinny_gated_linear(torch.randn(rows, 6144, dtype=dtype), w)
            for config in TritonAttentionBackend.DECODE_CONFIGS:
                attention.paged_attention(q, kc, vc, qsl, seq_lens, bt, scale=0.1, max_query_len=1,
                                          decode_config=config)
            k = torch.randn(4, 8, 128, dtype=dtype)
            kv_write_mod.kv_write(k, k, kc, vc, torch.arange(4))
            x = torch.randn(4, 1024, dtype=dtype)
            rms_norm_mod.rms_norm(x, x[0], 1e-6, residual=x.clone())
            rms_norm_mod.rms_norm(x, x[0], 1e-6)
            heads = x.view(4, 8, 128)
            rms_norm_mod.rms_norm(heads, x[0, :128], 1e-6, out=heads)
            i32 = torch.zeros(4, dtype=torch.int32)
            prepare.prepare_inputs(torch.zeros(4, 64, dtype=torch.int32), torch.zeros(4, 4, dtype=torch.int32), i32,
                                   i32, torch.zeros(5, dtype=torch.int32), 16, *torch.zeros(3, 64, dtype=torch.int64))
            prepare.prepare_inputs(torch.zeros(4, 64, dtype=torch.int32), torch.zeros(4, 4, dtype=torch.int32), i32,
                                   i32, torch.zeros(5, dtype=torch.int32), 16, *torch.zeros(3, 64, dtype=torch.int64),
                                   lag=i32, lagged=i32, seq_lens=i32, write_at=i32)
            ids64 = torch.zeros(16, dtype=torch.int64)
            verify.accept(ids64, ids64, ids64, 4, i32, torch.zeros(4, 64, dtype=torch.int32), i32)
            verify.write_drafts(torch.zeros(4, 3, dtype=torch.int64), ids64[:4], ids64, 4, i32,
                                torch.zeros(4, 64, dtype=torch.int32))
            ngram.ngram_drafts(torch.zeros(4, 64, dtype=torch.int32), i32, ids64, ids64[:4], 4, 1, 4, 3)
            qkv = torch.randn(4, 32 * 128, dtype=dtype)
            cos, sin = rope_tables(64, 128, 1e6)
            rotary.rotary_embedding(qkv[:, :2048].view(4, 16, 128), qkv[:, 2048:3072].view(4, 8, 128),
                                    torch.arange(4), cos, sin)
            activation.silu_and_mul(torch.randn(4, 6144, dtype=dtype))
            for w in (x[0, :128], None):
                qk_rope.qk_rope_cache(qkv, 16, 8, torch.arange(4), cos, sin, kc, vc, torch.arange(4), w, w)
                for splits in (1, 8):  # decode steps with the rotary and KV write inside attention
                    rope = attention.DecodeRope(torch.arange(3), cos, sin, torch.arange(3), w, w)
                    attention.paged_attention(qkv[:3].view(3, 32, 128), kc, vc, qsl, seq_lens, bt, scale=0.1,
                                              max_query_len=1, num_splits=splits, rope=rope)
            # DeepSeek-V3's MLA (the tiles do not depend on the head count), V2-Lite's experts.
            qn, qr = torch.randn(4, 128, 512, dtype=dtype), torch.randn(4, 128, 64, dtype=dtype)
            lat = torch.randn(8, 16, 576, dtype=dtype)
            for max_q, splits in ((300, 1), (1, 1), (1, 8)):
                mla.mla_attention(qn, qr, lat, qsl, seq_lens, bt, scale=0.1, max_query_len=max_q, num_splits=splits)
            mla_rope.mla_rope_cache(qr, torch.randn(4, 576, dtype=dtype), torch.arange(4), cos[:, :32], sin[:, :32],
                                    torch.ones(512, dtype=dtype), 1e-6, lat, torch.arange(4))
            # One token: the rotary beside W_UK's product, W_UV's product merging the splits (and not).
            w_kv = torch.randn(128, 256, 512, dtype=dtype)  # kv_b_proj's [heads, nope + v, rank]
            q1 = torch.randn(1, 128, 192, dtype=dtype)
            latent_heads.rope_cache_uk(q1[:, :, :128], q1[:, :, 128:], torch.randn(1, 576, dtype=dtype), torch.arange(1),
                                       cos[:, :32], sin[:, :32], torch.ones(512, dtype=dtype), 1e-6, lat,
                                       torch.arange(1), w_kv[:, :128])
            parts = mla.mla_attention(qn[:1], qr[:1], lat, qsl[:2], seq_lens[:1], bt[:1], scale=0.1, max_query_len=1,
                                      num_splits=8, merge=False)
            for x in (parts, qn[0]):
                latent_heads.head_gemv(x, w_kv[:, 128:].transpose(1, 2))
            route.moe_route(torch.randn(4, 256), torch.randn(256), 8, 1, num_groups=8, topk_groups=4)  # V3
            route.moe_route(torch.randn(4, 64), None, 6, 2, softmax=True, renormalize=False)  # V2-Lite
            for tokens in (4, 512):
                moe.fused_moe(torch.randn(tokens, 2048, dtype=dtype), torch.randn(64, 2816, 2048, dtype=dtype),
                              torch.randn(64, 2048, 1408, dtype=dtype), torch.rand(tokens, 6),
                              torch.randint(0, 64, (tokens, 6)))
            h = torch.randn(1, 2048, dtype=dtype)  # a MoE router with its norm: float32 weight and logits
            gemv.skinny_norm_linear(h, h.clone(), h[0], 1e-6, torch.randn(64, 2048), split=1, out_dtype=torch.float32)
            route.router_route(h, h.clone(), h[0], 1e-6, torch.randn(64, 2048), None, 6, 2, softmax=True,
                               renormalize=False)  # the same in one launch with the routing (V2-Lite)
            route.router_route(h, None, h[0], 1e-6, torch.randn(256, 2048), torch.randn(256), 8, 1, num_groups=8,
                               topk_groups=4)  # V3
            for norm, groups in ((None, 1), ((h[0], 1e-6), 1), (None, 4)):  # groups: the down kernel's picks spread
                skinny_moe.skinny_moe(h, torch.randn(66, 2816, 2048, dtype=dtype),
                                      torch.randn(66, 2048, 1408, dtype=dtype), torch.rand(1, 8),
                                      torch.randint(0, 66, (1, 8), dtype=torch.int32), norm=norm,
                                      down_tile=(*skinny_moe.DOWN_TILE, groups))
            # the shared experts' gate/up beside the routing: the residual added in the kernel
            skinny_moe.shared_beside_routing(h, h.clone(), (h[0], 1e-6), torch.empty(66, 2816, 2048, dtype=dtype),
                                             torch.empty(66, 2048, 1408, dtype=dtype), 6, 2,
                                             lambda: (torch.rand(1, 8), torch.randint(0, 66, (1, 8), dtype=torch.int32),
                                                      h.clone()))
            last_sums.set_enabled(True)  # the groups' sums added by each block's last group
            try:
                skinny_moe.skinny_moe(h, torch.empty(66, 2816, 2048, dtype=dtype), torch.empty(66, 2048, 1408, dtype=dtype),
                                      torch.rand(1, 8), torch.randint(0, 66, (1, 8), dtype=torch.int32),
                                      down_tile=(*skinny_moe.DOWN_TILE, 8))
            finally:
                last_sums.set_enabled(False)
            logits = torch.randn(4, 151936, dtype=dtype)
            sampling.gumbel_sample(logits, torch.ones(4), torch.arange(4), torch.arange(4), min_p=torch.zeros(4))
            sampling.gumbel_sample(logits, torch.ones(4), torch.arange(4), torch.arange(4))
            sampling.gumbel_sample(logits[:1], torch.ones(1), torch.arange(1), torch.arange(1), chunks=32)
            sampling.argmax_rows(logits[:2], chunks=32)
    finally:
        for m, n, fn in saved:
            setattr(m, n, fn)
    return launches


def check_compiles_for_hopper() -> None:
    """Compile every recorded launch for sm_90 (ptxas runs here, no GPU needed), specialised the
    way Triton's JIT specialises on the device: tensors and multiples of 16 as 16-divisible."""
    import triton
    from triton.backends.compiler import GPUTarget

    launches = hopper_launches()
    assert len(launches) >= 16, f"only {len(launches)} launches recorded"
    compiled_keys = set()
    for fn, args, options in launches:
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            value = args[name]
            if fn.params[i].is_constexpr:
                signature[name] = "constexpr"
                constexprs[name] = value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + _TRITON_TYPES[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, bool):
                signature[name] = "i1"
            elif isinstance(value, int):
                signature[name] = "i64" if abs(value) >= 2 ** 31 else "i32"
                if value % 16 == 0 and value != 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32"
        key = (fn.__name__, repr(sorted(constexprs.items())), repr(signature), repr(sorted(attrs.items())),
               repr(sorted(options.items())))
        if key in compiled_keys:  # the same specialisation launched twice compiles to the same code
            continue
        compiled_keys.add(key)
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm.get("cubin"), f"{fn.__name__} produced no cubin"
        # An H100/H200 block gets at most 227 KiB of shared memory; more fails only at launch.
        assert compiled.metadata.shared <= 227 * 1024, f"{fn.__name__} needs {compiled.metadata.shared} bytes of smem"


ALL_CHECKS = {
    "paged_attention": check_paged_attention,
    "attention_rope": check_attention_rope,
    "kv_write": check_kv_write,
    "rms_norm": check_rms_norm,
    "rotary": check_rotary,
    "qk_rope_cache": check_qk_rope_cache,
    "silu_and_mul": check_silu_and_mul,
    "matmul": check_matmul,
    "skinny_linear": check_skinny_linear,
    **mla_moe_checks.CHECKS,
    "token_bitmask": check_token_bitmask,
    "verify": check_verify,
    "ngram": check_ngram,
    "argmax_rows": check_argmax_rows,
}


def _main() -> None:
    """``python kernel_checks.py CHECK [DTYPE,...]``: run one check on the CPU (under the interpreter
    when the caller set ``TRITON_INTERPRET=1``)."""
    import sys

    name = sys.argv[1]
    if name == "compiles_for_hopper":
        check_compiles_for_hopper()
    elif name == "gumbel_sample":  # the interpreter runs one program at a time: a small vocabulary
        check_gumbel_sample("cpu", vocab=8, num_draws=250, max_tv=0.15)
    else:
        for dtype_name in (sys.argv[2] if len(sys.argv) > 2 else "float32").split(","):
            ALL_CHECKS[name]("cpu", getattr(torch, dtype_name))
    print(f"ok {name}")


if __name__ == "__main__":
    _main()
