"""One kernel for every decoder layer of a batch-1 decode step (Llama, Qwen2, Qwen3).

At one token a step, a layer is five small steps (the q/k/v projection, attention, the output
projection, gate/up with SiLU, down), each reading a few MB of weights. Launched one kernel a step,
each costs ~3 us past its bytes, which bounds a small model's step near three times its bandwidth
time. Here ``G`` programs (one or two an SM, all resident) run every layer's five steps in one
launch and meet at a grid-wide barrier (an atomic counter) between steps.

Each program owns one block of rows of every projection (``held_rows``) and holds that block's
weights whole in registers: it asks for the next step's block as soon as it has arrived at the
barrier, so those weights stream in while it waits for the others (weights do not depend on the
barrier, only activations do), and after the barrier only the activations, a few KB from L2,
remain to be read. A model qualifies where every block fits a program's registers
(:func:`held_elements`; qwen3-0.6b's at one program an SM, not llama3-8b's).

The residual stream lives in two buffers of the activation dtype: ``s`` enters a layer, the output
projection adds into ``s2``, the down projection adds back into ``s``; after the last layer ``s``
is the stream the final norm reads. Every product accumulates in float32 and every value a layer
hands on is rounded to the activation dtype where the one-kernel-a-step ops round it (RMSNorm
rounds the normalised value before its weight, SiLU rounds the gate, each residual add rounds).
Activations another program wrote are read past L1 (``.cg``: an SM's L1 is not kept coherent with
the others' stores). Attention runs in ``SPLITS`` parts of the keys for each KV head; the last part
to finish merges them (:func:`kernels.last_sums.arrive`), so the sum's order is fixed.

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

# The most 16-bit weights of one held block a thread may keep (128 registers' worth of pairs).
HELD_ELEMENTS = 256
HELD_WARPS = 16  # warps a program at one program an SM (halved per extra program, at least 4)


@triton.jit
def _arrive_all(counter_ptr):
    """Arrive at the grid-wide barrier, this program's stores ordered before."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _wait_all(counter_ptr, target):
    """Wait until ``target`` arrivals have been counted (the others' stores visible after)."""
    while tl.load(counter_ptr, volatile=True) < target:
        pass
    tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _ahead(w_ptr, pid, N, K, BN: tl.constexpr, LP: tl.constexpr, AHEAD: tl.constexpr):
    """With ``AHEAD``: ask L2 for this program's block of ``w`` (``[N, K]``, 16-bit), ``LP``
    128-byte lines (a power of two; requests past the block's lines repeat its last), so that the
    block streams from L2 when it is loaded into registers a step later."""
    if AHEAD:
        if pid * BN < N:
            lines = BN * K // 64
            offs = tl.minimum(tl.arange(0, LP), lines - 1) * 64
            base = w_ptr + (pid * BN).to(tl.int64) * K
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + offs],
                                      dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _block(w_ptr, pid, N, K, BN: tl.constexpr, KP: tl.constexpr):
    """This program's rows of ``w`` (``[N, K]``), whole: ``[BN, KP]``, zero past the edges."""
    rows = pid * BN + tl.arange(0, BN)
    ks = tl.arange(0, KP)
    return tl.load(w_ptr + rows[:, None].to(tl.int64) * K + ks[None, :],
                   mask=(rows < N)[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit
def _input(x_ptr, nw_ptr, K, KP: tl.constexpr, eps, NORM: tl.constexpr):
    """The activations ``x`` (``K``, read past L1) in float32, RMS-normalised with weight ``nw``
    first with ``NORM`` (rounded as ``models.layers.rms_norm`` rounds it)."""
    ks = tl.arange(0, KP)
    ok = ks < K
    x = tl.load(x_ptr + ks, mask=ok, other=0.0, cache_modifier=".cg")
    if NORM:
        dt = x_ptr.dtype.element_ty
        f = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(f * f, 0) / K + eps)
        x = ((f * rstd).to(dt).to(tl.float32) * tl.load(nw_ptr + ks, mask=ok, other=0.0).to(tl.float32)).to(dt)
    return x.to(tl.float32)


@triton.jit
def _apply(block, x, pid, BN: tl.constexpr):
    """This program's row ids and the sums of its held ``block`` times ``x``, in float32."""
    return pid * BN + tl.arange(0, BN), tl.sum(block.to(tl.float32) * x[None, :], 1)


@triton.jit
def _add_store(acc, rows, N, res_ptr, out_ptr):
    """``out = res + acc`` at ``rows`` (the product rounded before the add, as the ops round it)."""
    ok = rows < N
    dt = out_ptr.dtype.element_ty
    out = acc.to(dt).to(tl.float32) + tl.load(res_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
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
                   eps, row_ok, dims, D, HAS_NORM, True)
    if split == (num_tiles - 1) // per:
        if slot >= 0:
            first = tl.zeros([1], tl.int64)
            k_base = (NQ + kv_head) * D
            k = rope_heads(qkv_ptr, k_base + dims[None, :], k_base + first, pos + first, cos_ptr, sin_ptr, kn_ptr,
                           eps, first == 0, dims, D, HAS_NORM, True)
            at = (slot // PAGE) * PAGE * NKV * D + (slot % PAGE) * NKV * D + kv_head * D
            tl.store(k_cache + at + dims[None, :], k)
            tl.store(v_cache + at + dims, tl.load(qkv_ptr + (NQ + NKV + kv_head) * D + dims, cache_modifier=".cg"))
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
    QP: tl.constexpr, IP: tl.constexpr, LAYERS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_KEYS: tl.constexpr, SPLITS: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr,
    BN_GU: tl.constexpr, BN_D: tl.constexpr, LP_QKV: tl.constexpr, LP_O: tl.constexpr, LP_GU: tl.constexpr,
    LP_D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, AHEAD: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    QKV: tl.constexpr = (NQ + 2 * NKV) * D
    Q: tl.constexpr = NQ * D
    zero = (pid * 0).to(tl.int64)  # 64-bit layer offsets: an 8B model's stacked weights pass 2^31
    pos = tl.load(pos_ptr).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr)
    slot = tl.load(slot_ptr).to(tl.int64)
    w_qkv = _block(wqkv_ptr, pid, QKV, H, BN_QKV, HP)
    _ahead(wo_ptr, pid, H, Q, BN_O, LP_O, AHEAD)
    for layer in range(LAYERS):
        li = zero + layer
        nxt = tl.minimum(li + 1, LAYERS - 1)
        # 1. qkv = Wqkv rms(s) (+ b)
        x = _input(s_ptr, n_in_ptr + li * H, H, HP, eps, True)
        rows, acc = _apply(w_qkv, x, pid, BN_QKV)
        ok = rows < QKV
        if HAS_BIAS:
            acc += tl.load(bqkv_ptr + li * QKV + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(qkv_ptr + rows, acc.to(qkv_ptr.dtype.element_ty), mask=ok)
        _arrive_all(counter_ptr)
        w_o = _block(wo_ptr + li * H * Q, pid, H, Q, BN_O, QP)  # held through the attention
        _ahead(wgu_ptr + li * 2 * I * H, pid, I, H, BN_GU, LP_GU, AHEAD)
        _ahead(wgu_ptr + (li * 2 + 1) * I * H, pid, I, H, BN_GU, LP_GU, AHEAD)
        _wait_all(counter_ptr, (layer * 5 + 1) * G)
        # 2. attention: (KV head, share of the keys) units
        k_cache = kv_ptr + li * layer_stride
        for unit in range(pid, NKV * SPLITS, G):
            _attend(qkv_ptr, attn_ptr, k_cache, k_cache + v_offset, part_acc_ptr, part_ml_ptr, count_ptr,
                    unit // SPLITS, unit % SPLITS, pos, seq_len, slot, block_table_ptr, cos_ptr, sin_ptr,
                    qn_ptr + li * D, kn_ptr + li * D, eps, scale, NQ, NKV, D, GROUP, GROUP_PAD, PAGE,
                    BLOCK_KEYS, SPLITS, HAS_NORM, PRECISION)
        _arrive_all(counter_ptr)
        _ahead(wd_ptr + li * H * I, pid, H, I, BN_D, LP_D, AHEAD)
        _wait_all(counter_ptr, (layer * 5 + 2) * G)
        # 3. s2 = s + Wo attn
        rows, acc = _apply(w_o, _input(attn_ptr, attn_ptr, Q, QP, eps, False), pid, BN_O)
        _add_store(acc, rows, H, s_ptr, s2_ptr)
        _arrive_all(counter_ptr)
        w_g = _block(wgu_ptr + li * 2 * I * H, pid, I, H, BN_GU, HP)
        w_u = _block(wgu_ptr + (li * 2 + 1) * I * H, pid, I, H, BN_GU, HP)
        _ahead(wqkv_ptr + nxt * QKV * H, pid, QKV, H, BN_QKV, LP_QKV, AHEAD)
        _wait_all(counter_ptr, (layer * 5 + 3) * G)
        # 4. act = silu(g) * u, [g | u] = Wgu rms(s2)
        x = _input(s2_ptr, n_post_ptr + li * H, H, HP, eps, True)
        rows, g = _apply(w_g, x, pid, BN_GU)
        rows, u = _apply(w_u, x, pid, BN_GU)
        dt = act_ptr.dtype.element_ty
        g = g.to(dt).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u.to(dt).to(tl.float32)
        tl.store(act_ptr + rows, act.to(dt), mask=rows < I)
        _arrive_all(counter_ptr)
        w_d = _block(wd_ptr + li * H * I, pid, H, I, BN_D, IP)
        _ahead(wo_ptr + nxt * H * Q, pid, H, Q, BN_O, LP_O, AHEAD)
        _wait_all(counter_ptr, (layer * 5 + 4) * G)
        # 5. s = s2 + Wd act
        rows, acc = _apply(w_d, _input(act_ptr, act_ptr, I, IP, eps, False), pid, BN_D)
        _add_store(acc, rows, H, s2_ptr, s_ptr)
        _arrive_all(counter_ptr)
        w_qkv = _block(wqkv_ptr + nxt * QKV * H, pid, QKV, H, BN_QKV, HP)
        _wait_all(counter_ptr, (layer * 5 + 5) * G)


def held_rows(n: int, programs: int) -> int:
    """Rows of an ``n``-row projection a program holds: enough for ``programs`` to cover ``n``, a
    power of two."""
    return triton.next_power_of_2(triton.cdiv(n, programs))


def held_warps(per_sm: int) -> int:
    """Warps a program at ``per_sm`` programs an SM."""
    return max(4, HELD_WARPS // per_sm)


def held_elements(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, programs: int) -> int:
    """The most weights a program holds at once (its gate and up blocks, or another step's one
    block; padded to powers of two)."""
    p2 = triton.next_power_of_2
    qkv = (heads + 2 * kv_heads) * head_dim
    return max(held_rows(qkv, programs) * p2(hidden), held_rows(hidden, programs) * p2(heads * head_dim),
               2 * held_rows(inter, programs) * p2(hidden), held_rows(hidden, programs) * p2(inter))


def constants(hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, layers: int, programs: int,
              splits: int, block_keys: int, qk_norm: bool, qkv_bias: bool, float32: bool,
              ahead: bool = False) -> dict[str, object]:
    """The kernel's compile-time arguments for a model's shape and ``programs`` programs; ``ahead``:
    ask L2 for each block a step before it is loaded (GPU only: inline assembly)."""
    qkv, group = (heads + 2 * kv_heads) * head_dim, heads // kv_heads
    p2 = triton.next_power_of_2
    lines = lambda n, k: p2(max(1, held_rows(n, programs) * k // 64))  # noqa: E731
    return dict(H=hidden, HP=p2(hidden), NQ=heads, NKV=kv_heads, D=head_dim, I=inter, QP=p2(heads * head_dim),
                IP=p2(inter), LAYERS=layers, GROUP=group, GROUP_PAD=max(16, p2(group)), BLOCK_KEYS=block_keys,
                SPLITS=splits, BN_QKV=held_rows(qkv, programs), BN_O=held_rows(hidden, programs),
                BN_GU=held_rows(inter, programs), BN_D=held_rows(hidden, programs), LP_QKV=lines(qkv, hidden),
                LP_O=lines(hidden, heads * head_dim), LP_GU=lines(inter, hidden), LP_D=lines(hidden, inter),
                HAS_NORM=qk_norm, HAS_BIAS=qkv_bias, AHEAD=ahead, PRECISION="ieee" if float32 else "tf32")


_FITS: set[tuple] = set()  # (device, programs, warps, compile-time arguments) checked to fit at once


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


def persistent_decode(programs: int, warps: int, *args: torch.Tensor | float | int, **meta: object) -> None:
    """Launch the kernel with ``programs`` programs of ``warps`` warps (its arguments as
    ``_persistent_decode_kernel``'s, ``meta`` from :func:`constants` plus ``PAGE``). Its programs
    wait for each other, so all of them must be resident at once: on a GPU the first launch of each
    shape compiles the kernel and refuses a count the device cannot hold together (a launch would
    hang)."""
    launch = dict(num_warps=warps, num_stages=1)
    if warps < HELD_WARPS:  # registers capped at HELD_WARPS' share, so that several programs fit an SM
        launch["maxnreg"] = 65536 // (32 * HELD_WARPS)
    first = args[0]
    if isinstance(first, torch.Tensor) and first.is_cuda:
        key = (first.device, programs, warps, tuple(sorted(meta.items())))
        if key not in _FITS:
            compiled = _persistent_decode_kernel.warmup(*args, grid=(programs,), **meta, **launch)
            sms = torch.cuda.get_device_properties(first.device).multi_processor_count
            most = sms * resident_programs(compiled, first.device)
            if programs > most:
                raise RuntimeError(f"the persistent decode kernel's {programs} programs cannot all be resident on "
                                   f"{torch.cuda.get_device_name(first.device)} (at most {most} at once: "
                                   f"{compiled.n_regs} registers a thread); set fewer persistent_programs")
            _FITS.add(key)
    _persistent_decode_kernel[(programs,)](*args, **meta, **launch)
