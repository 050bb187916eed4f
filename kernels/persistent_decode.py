"""One kernel for every decoder layer of a batch-1 decode step (Llama, Qwen2, Qwen3).

At one token a step, a layer is five small steps (the q/k/v projection, attention, the output
projection, gate/up with SiLU, down), each reading a few MB of weights. Launched one kernel a step,
each costs ~3 us before a byte moves, which bounds a small model's step near twice its bandwidth
time. Here ``G`` programs (a few per SM, all resident) run every layer's five steps in one launch
and meet at a grid-wide barrier between steps (an atomic counter, :func:`grid_sync`): while a
program waits, it asks L2 for the weight rows it multiplies next, so the weights stream in while
the step before finishes.

The residual stream lives in two buffers of the activation dtype: ``s`` enters a layer, the output
projection adds into ``s2``, the down projection adds back into ``s``; after the last layer ``s``
is the stream the final norm reads. Every product accumulates in float32 and every value a layer
hands on is rounded to the activation dtype where the one-kernel-a-step ops round it (RMSNorm
rounds the normalised value before its weight, SiLU rounds the gate, each residual add rounds).
Attention runs in ``SPLITS`` parts of the keys for each KV head; the last part to finish merges
them (:func:`kernels.last_sums.arrive`), so the sum's order is fixed.

Weights are the layers' own parameters stacked along a first, layer dimension
(``backends.gpu.persistent`` re-points each layer's parameters at its slice), and the KV caches
one ``[layers, 2, blocks, page, kv_heads, head_dim]`` tensor. On a CPU (Triton's interpreter runs
programs one after another) only ``G = 1`` can run: its barriers pass at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .last_sums import arrive
from .qk_rope_cache import rope_heads


@triton.jit
def grid_sync(counter_ptr, target):
    """Arrive at a grid-wide barrier (this program's stores ordered before), then wait until
    ``target`` arrivals have been counted (the others' stores visible after)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    while tl.load(counter_ptr, volatile=True) < target:
        pass
    tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def ask_l2(w_ptr, pid, G, N, K, BN: tl.constexpr, LP: tl.constexpr):
    """Ask L2 for the rows of ``w`` (``[N, K]``, 16-bit) that this program multiplies next: blocks
    of ``BN`` rows, ``LP`` 128-byte lines a block (a power of two; the requests past a block's
    lines repeat its last)."""
    lines = BN * K // 64
    offs = tl.minimum(tl.arange(0, LP), lines - 1) * 64
    for rb in range(pid, tl.cdiv(N, BN), G):
        base = w_ptr + rb.to(tl.int64) * BN * K
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + offs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _rstd(x_ptr, K, KP: tl.constexpr, eps):
    ks = tl.arange(0, KP)
    x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    return 1.0 / tl.sqrt(tl.sum(x * x, 0) / K + eps)


@triton.jit
def _rows_dot(w_ptr, x_ptr, nw_ptr, rstd, rb, N, K, NORM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows ``rb * BN ..`` of ``w @ x`` (``w`` ``[N, K]``) in float32, ``x`` RMS-normalised by
    ``rstd`` and ``nw`` first with ``NORM`` (rounded as ``models.layers.rms_norm`` rounds it); the
    rows, their mask and the sums."""
    dt = x_ptr.dtype.element_ty
    rows = rb * BN + tl.arange(0, BN)
    row_ok = rows < N
    acc = tl.zeros([BN], tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < K
        x = tl.load(x_ptr + ks, mask=k_ok, other=0.0)
        if NORM:
            x = ((x.to(tl.float32) * rstd).to(dt).to(tl.float32)
                 * tl.load(nw_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)).to(dt)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)
    return rows, row_ok, acc


@triton.jit
def _project_add(w_ptr, x_ptr, res_ptr, out_ptr, pid, G, N, K, BN: tl.constexpr, BK: tl.constexpr):
    """This program's blocks of ``out = res + w @ x`` (the product rounded before the add)."""
    for rb in range(pid, tl.cdiv(N, BN), G):
        rows, ok, acc = _rows_dot(w_ptr, x_ptr, x_ptr, 1.0, rb, N, K, False, BN, BK)
        dt = out_ptr.dtype.element_ty
        out = acc.to(dt).to(tl.float32) + tl.load(res_ptr + rows, mask=ok).to(tl.float32)
        tl.store(out_ptr + rows, out.to(dt), mask=ok)


@triton.jit
def _attend(qkv_ptr, attn_ptr, k_cache, v_cache, part_acc_ptr, part_ml_ptr, count_ptr, kv_head, split,
            pos, seq_len, slot, block_table_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, eps, scale,
            NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
            PAGE: tl.constexpr, BLOCK_KEYS: tl.constexpr, SPLITS: tl.constexpr, HAS_NORM: tl.constexpr,
            PRECISION: tl.constexpr):
    """One KV head's share ``split`` of the keys for the step's token: its q heads normed and
    rotated, by the share holding the new key its k and v into the cache, then flash attention
    over the share; the last share to finish merges them into ``attn``."""
    rows = tl.arange(0, GROUP_PAD)
    row_ok = rows < GROUP
    q_head = kv_head * GROUP + rows
    dims = tl.arange(0, D)
    zero = rows.to(tl.int64) * 0
    num_tiles = tl.cdiv(seq_len, BLOCK_KEYS)
    per = tl.cdiv(num_tiles, SPLITS)
    lo = split * per
    hi = tl.minimum(lo + per, num_tiles)
    q = rope_heads(qkv_ptr, q_head[:, None] * D + dims[None, :], q_head * D, pos + zero, cos_ptr, sin_ptr, qn_ptr,
                   eps, row_ok, dims, D, HAS_NORM)
    if split == (num_tiles - 1) // per:
        if slot >= 0:
            first = tl.zeros([1], tl.int64)
            k_base = (NQ + kv_head) * D
            k = rope_heads(qkv_ptr, k_base + dims[None, :], k_base + first, pos + first, cos_ptr, sin_ptr, kn_ptr,
                           eps, first == 0, dims, D, HAS_NORM)
            at = (slot // PAGE) * PAGE * NKV * D + (slot % PAGE) * NKV * D + kv_head * D
            tl.store(k_cache + at + dims[None, :], k)
            tl.store(v_cache + at + dims, tl.load(qkv_ptr + (NQ + NKV + kv_head) * D + dims))
        tl.debug_barrier()  # the new key and value, stored by this program's threads, are read below
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    cols = tl.arange(0, BLOCK_KEYS)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2
    for tile in range(lo, hi):
        key = tile * BLOCK_KEYS + cols
        key_ok = key < seq_len
        page = tl.load(block_table_ptr + key // PAGE, mask=key_ok, other=0).to(tl.int64)
        at = page * PAGE * NKV * D + (key % PAGE) * NKV * D + kv_head * D
        k = tl.load(k_cache + at[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache + at[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(attn_ptr + q_head[:, None] * D + dims[None, :], out.to(attn_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        part = q_head * SPLITS + split  # a share past the keys stores l = 0 and weighs nothing
        tl.store(part_acc_ptr + part[:, None] * D + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        if arrive(count_ptr, kv_head, SPLITS):
            first = q_head * SPLITS
            m_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
            for sp in range(SPLITS):
                m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (first + sp) * 2, mask=row_ok, other=float("-inf"),
                                                  cache_modifier=".cg"))
            denom = tl.zeros([GROUP_PAD], tl.float32)
            total = tl.zeros([GROUP_PAD, D], tl.float32)
            for sp in range(SPLITS):  # in order: the same sum whichever share finished last
                m_s = tl.load(part_ml_ptr + (first + sp) * 2, mask=row_ok, other=0.0, cache_modifier=".cg")
                l_s = tl.load(part_ml_ptr + (first + sp) * 2 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
                w = tl.where(l_s > 0.0, tl.math.exp2(m_s - m_max), 0.0)
                denom += l_s * w
                total += tl.load(part_acc_ptr + (first + sp)[:, None] * D + dims[None, :],
                                 mask=(row_ok & (l_s > 0.0))[:, None], other=0.0, cache_modifier=".cg") * w[:, None]
            out = total / tl.where(denom == 0.0, 1.0, denom)[:, None]
            tl.store(attn_ptr + q_head[:, None] * D + dims[None, :], out.to(attn_ptr.dtype.element_ty),
                     mask=row_ok[:, None])


@triton.jit
def _persistent_decode_kernel(
    s_ptr, s2_ptr, qkv_ptr, attn_ptr, act_ptr, part_acc_ptr, part_ml_ptr, count_ptr, counter_ptr,
    wqkv_ptr, bqkv_ptr, wo_ptr, wgu_ptr, wd_ptr, n_in_ptr, n_post_ptr, qn_ptr, kn_ptr,
    kv_ptr, layer_stride, v_offset, block_table_ptr, seq_lens_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr,
    eps, scale,
    H: tl.constexpr, HP: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, I: tl.constexpr,
    LAYERS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_KEYS: tl.constexpr, SPLITS: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr,
    BN_GU: tl.constexpr, BN_D: tl.constexpr, LP_QKV: tl.constexpr, LP_O: tl.constexpr, LP_GU: tl.constexpr,
    LP_D: tl.constexpr, BK_QKV: tl.constexpr, BK_O: tl.constexpr, BK_GU: tl.constexpr, BK_D: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr, PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    QKV: tl.constexpr = (NQ + 2 * NKV) * D
    Q: tl.constexpr = NQ * D
    zero = (pid * 0).to(tl.int64)  # 64-bit layer offsets: an 8B model's stacked weights pass 2^31
    pos = tl.load(pos_ptr).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr)
    slot = tl.load(slot_ptr).to(tl.int64)
    for layer in range(LAYERS):
        li = zero + layer
        wqkv = wqkv_ptr + li * QKV * H
        wo = wo_ptr + li * H * Q
        wgu = wgu_ptr + li * 2 * I * H
        wd = wd_ptr + li * H * I
        # 1. qkv = Wqkv rms(s) (+ b)
        rstd = _rstd(s_ptr, H, HP, eps)
        for rb in range(pid, tl.cdiv(QKV, BN_QKV), G):
            rows, ok, acc = _rows_dot(wqkv, s_ptr, n_in_ptr + li * H, rstd, rb, QKV, H, True, BN_QKV, BK_QKV)
            if HAS_BIAS:
                acc += tl.load(bqkv_ptr + li * QKV + rows, mask=ok, other=0.0).to(tl.float32)
            tl.store(qkv_ptr + rows, acc.to(qkv_ptr.dtype.element_ty), mask=ok)
        if PREFETCH:
            ask_l2(wo, pid, G, H, Q, BN_O, LP_O)
        grid_sync(counter_ptr, (layer * 5 + 1) * G)
        # 2. attention: (KV head, share of the keys) units
        k_cache = kv_ptr + li * layer_stride
        for unit in range(pid, NKV * SPLITS, G):
            _attend(qkv_ptr, attn_ptr, k_cache, k_cache + v_offset, part_acc_ptr, part_ml_ptr, count_ptr,
                    unit // SPLITS, unit % SPLITS, pos, seq_len, slot, block_table_ptr, cos_ptr, sin_ptr,
                    qn_ptr + li * D, kn_ptr + li * D, eps, scale, NQ, NKV, D, GROUP, GROUP_PAD, PAGE,
                    BLOCK_KEYS, SPLITS, HAS_NORM, PRECISION)
        grid_sync(counter_ptr, (layer * 5 + 2) * G)
        # 3. s2 = s + Wo attn
        _project_add(wo, attn_ptr, s_ptr, s2_ptr, pid, G, H, Q, BN_O, BK_O)
        if PREFETCH:
            ask_l2(wgu, pid, G, I, H, BN_GU, LP_GU)
            ask_l2(wgu + I * H, pid, G, I, H, BN_GU, LP_GU)
        grid_sync(counter_ptr, (layer * 5 + 3) * G)
        # 4. act = silu(g) * u, [g | u] = Wgu rms(s2)
        rstd = _rstd(s2_ptr, H, HP, eps)
        for rb in range(pid, tl.cdiv(I, BN_GU), G):
            rows, ok, g = _rows_dot(wgu, s2_ptr, n_post_ptr + li * H, rstd, rb, I, H, True, BN_GU, BK_GU)
            rows, ok, u = _rows_dot(wgu + I * H, s2_ptr, n_post_ptr + li * H, rstd, rb, I, H, True, BN_GU, BK_GU)
            dt = act_ptr.dtype.element_ty
            g = g.to(dt).to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(dt).to(tl.float32)
            tl.store(act_ptr + rows, act.to(dt), mask=ok)
        if PREFETCH:
            ask_l2(wd, pid, G, H, I, BN_D, LP_D)
        grid_sync(counter_ptr, (layer * 5 + 4) * G)
        # 5. s = s2 + Wd act
        _project_add(wd, act_ptr, s2_ptr, s_ptr, pid, G, H, I, BN_D, BK_D)
        if PREFETCH:
            if layer + 1 < LAYERS:
                ask_l2(wqkv + QKV * H, pid, G, QKV, H, BN_QKV, LP_QKV)
        grid_sync(counter_ptr, (layer * 5 + 5) * G)


def block_rows(n: int, programs: int, most: int = 64) -> int:
    """Rows a block of a projection's ``n``: the largest power of two (at most ``most``) that still
    gives every one of ``programs`` a block."""
    bn = 1
    while n // (bn * 2) >= programs and bn < most:
        bn *= 2
    return bn


def prefetch_lines(bn: int, k: int) -> int:
    """L2 requests for a block of ``bn`` rows of ``k`` 16-bit weights: its 128-byte lines, rounded
    up to a power of two."""
    return triton.next_power_of_2(max(1, bn * k // 64))


def chunk(bn: int, k: int, elements: int = 8192) -> int:
    """Inputs a step of a block of ``bn`` rows multiplies: a tile of about ``elements`` weights
    (at least 128 inputs, at most ``k`` rounded up to a power of two)."""
    return min(triton.next_power_of_2(k), max(128, elements // bn))


def constants(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, layers: int, programs: int,
              splits: int, block_keys: int, qk_norm: bool, qkv_bias: bool, prefetch: bool,
              float32: bool) -> dict[str, object]:
    """The kernel's compile-time arguments for a model's shape and ``programs`` programs."""
    qkv, group = (heads + 2 * kv_heads) * head_dim, heads // kv_heads
    bn = (block_rows(qkv, programs), block_rows(hidden, programs), block_rows(inter, programs),
          block_rows(hidden, programs))
    return dict(H=hidden, HP=triton.next_power_of_2(hidden), NQ=heads, NKV=kv_heads, D=head_dim, I=inter,
                LAYERS=layers, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_KEYS=block_keys,
                SPLITS=splits, BN_QKV=bn[0], BN_O=bn[1], BN_GU=bn[2], BN_D=bn[3],
                LP_QKV=prefetch_lines(bn[0], hidden), LP_O=prefetch_lines(bn[1], heads * head_dim),
                LP_GU=prefetch_lines(bn[2], hidden), LP_D=prefetch_lines(bn[3], inter),
                BK_QKV=chunk(bn[0], hidden), BK_O=chunk(bn[1], heads * head_dim), BK_GU=chunk(bn[2], hidden),
                BK_D=chunk(bn[3], inter), HAS_NORM=qk_norm, HAS_BIAS=qkv_bias,
                PREFETCH=prefetch, PRECISION="ieee" if float32 else "tf32")


_FITS: set[tuple] = set()  # (device, programs, compile-time arguments) checked to fit the device at once


def resident_programs(kernel: object, device: torch.device) -> int:
    """How many programs of the compiled ``kernel`` one SM holds at once: its registers (allocated
    a warp at a time, in 256s), shared memory and threads against the SM's."""
    kernel._init_handles()
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    regs = -(-kernel.n_regs * 32 // 256) * 256 * warps
    fits = [getattr(props, "regs_per_multiprocessor", 65536) // max(regs, 1),
            getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps), 32]
    if kernel.metadata.shared:
        fits.append(getattr(props, "shared_memory_per_multiprocessor", 233472) // kernel.metadata.shared)
    return min(fits)


def persistent_decode(programs: int, *args: torch.Tensor | float | int, **meta: object) -> None:
    """Launch the kernel with ``programs`` programs (its arguments as ``_persistent_decode_kernel``'s,
    ``meta`` from :func:`constants` plus ``PAGE``). Its programs wait for each other, so all of them
    must be resident at once: on a GPU the first launch of each shape compiles the kernel and
    refuses a count the device cannot hold together (a launch would hang)."""
    first = args[0]
    if isinstance(first, torch.Tensor) and first.is_cuda:
        key = (first.device, programs, tuple(sorted(meta.items())))
        if key not in _FITS:
            compiled = _persistent_decode_kernel.warmup(*args, grid=(programs,), **meta, num_warps=4)
            sms = torch.cuda.get_device_properties(first.device).multi_processor_count
            most = sms * resident_programs(compiled, first.device)
            if programs > most:
                raise RuntimeError(f"the persistent decode kernel's {programs} programs cannot all be resident on "
                                   f"{torch.cuda.get_device_name(first.device)} (at most {most} at once: "
                                   f"{compiled.n_regs} registers a thread); set fewer persistent_programs")
            _FITS.add(key)
    _persistent_decode_kernel[(programs,)](*args, **meta, num_warps=4)
