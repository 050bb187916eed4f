"""The GPU runner's ``persistent_decode`` option: a batch-1 decode step's decoder layers in one
kernel (``kernels.persistent_decode``), for the Llama family (Llama, Qwen2, Qwen3) on one device,
where each program's block of every projection fits its registers (small models: qwen3-0.6b).

:class:`PersistentDecoder` stacks each kind of layer weight into one tensor (the layers' parameters
become views of it: no memory is added) and keeps the step's small buffers. Called in the batch-1
decode graph in place of the model's forward, it gathers the token's embedding, runs the kernel
over every layer and applies the final norm: three launches and a counter reset where the
one-kernel-a-step path has about six a layer.
"""

from __future__ import annotations

import torch
from specloop.kernels import last_sums
from specloop.kernels.persistent_decode import HELD_ELEMENTS, constants, held_elements, held_warps, persistent_decode
from specloop.models.attention import AttentionMetadata
from specloop.models.llama import LlamaForCausalLM
from specloop.models.ops import Ops

MAX_SPLITS = 32  # shares of the keys a KV head's attention takes at most
BLOCK_KEYS = 64


def unsupported(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run its decode step in the persistent kernel, or None."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a Llama-family decoder (Llama, Qwen2, Qwen3)"
    cfg, layer = model.config, model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    if attn.num_heads != cfg.num_heads or attn.num_kv_heads != cfg.num_kv_heads:
        return "its heads are split over tensor-parallel ranks"
    if attn.o_proj.bias is not None or mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None:
        return "its output or MLP projections have biases"
    d = cfg.head_dim
    if d < 16 or d & (d - 1):
        return f"its head size {d} is not a power of two of at least 16"
    dtype = attn.qkv_proj.weight.dtype
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"its weights are {dtype}"
    return None


def _stack(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """One tensor of ``params`` along a new first dimension; each parameter becomes its slice."""
    stacked = torch.stack([p.detach() for p in params])
    for i, p in enumerate(params):
        p.data = stacked[i]
    return stacked


def cache_layout(kv_caches: list[torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    """The first cache, the elements from one layer's cache to the next and from a cache's K to its
    V: the caches must be equally spaced slices of one allocation (the model runner's)."""
    first, size = kv_caches[0], kv_caches[0].element_size()
    v_offset = (first[1].data_ptr() - first[0].data_ptr()) // size
    stride = (kv_caches[1].data_ptr() - first.data_ptr()) // size if len(kv_caches) > 1 else 0
    for i, cache in enumerate(kv_caches):
        if cache.data_ptr() != first.data_ptr() + i * stride * size or not cache.is_contiguous():
            raise RuntimeError("the persistent decode kernel needs the layers' KV caches as equally spaced, "
                               "contiguous slices of one tensor")
    return first, stride, v_offset


class PersistentDecoder:
    """Batch-1 decode steps of ``model`` in one kernel launch over its layers (module docstring).
    ``programs``: the kernel's programs, all resident at once (a few per SM; one on a CPU, where
    Triton's interpreter runs them in turn); ``splits``: shares of the keys a KV head's attention
    takes (by default enough units for every program), ``block_keys``: keys a tile; ``per_sm``: the
    programs an SM (sets a program's warps)."""

    def __init__(self, model: LlamaForCausalLM, ops: Ops, device: torch.device, programs: int,
                 splits: int | None = None, block_keys: int = BLOCK_KEYS, per_sm: int = 1) -> None:
        reason = unsupported(model)
        cfg = model.config
        self.warps = held_warps(per_sm)
        held = held_elements(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                             programs)
        if reason is None and device.type == "cuda" and held > HELD_ELEMENTS * 32 * self.warps:
            reason = (f"a program of {programs} would hold {held} weights of a projection, more than its "
                      f"{self.warps} warps' registers keep ({HELD_ELEMENTS} a thread)")
        if reason is not None:
            raise ValueError(f"plugin_options['gpu']['persistent_decode']: {reason}")
        self.model, self.ops, self.device = model, ops, device
        self.h, self.nq, self.nkv, self.d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.inter, self.layers, self.eps = cfg.intermediate_size, cfg.num_layers, cfg.rms_norm_eps
        self.programs = programs
        layers = list(model.layers)
        attn = [layer.self_attn for layer in layers]
        self.wqkv = _stack([a.qkv_proj.weight for a in attn])
        self.bqkv = _stack([a.qkv_proj.bias for a in attn]) if attn[0].qkv_proj.bias is not None else None
        self.wo = _stack([a.o_proj.weight for a in attn])
        self.wgu = _stack([layer.mlp.gate_up_proj.weight for layer in layers])
        self.wd = _stack([layer.mlp.down_proj.weight for layer in layers])
        self.n_in = _stack([layer.input_layernorm.weight for layer in layers])
        self.n_post = _stack([layer.post_attention_layernorm.weight for layer in layers])
        self.has_norm = attn[0].q_norm is not None
        self.qn = _stack([a.q_norm.weight for a in attn]) if self.has_norm else self.n_in
        self.kn = _stack([a.k_norm.weight for a in attn]) if self.has_norm else self.n_in
        dtype, qkv = self.wqkv.dtype, (self.nq + 2 * self.nkv) * self.d
        self.splits = splits or max(1, min(MAX_SPLITS, programs // self.nkv))
        new = lambda n, dt=dtype: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        self.s, self.s2, self.qkv = new(self.h), new(self.h), new(qkv)
        self.attn, self.act = new(self.nq * self.d), new(self.inter)
        self.part_acc = new(self.nq * self.splits * self.d, torch.float32)
        self.part_ml = new(self.nq * self.splits * 2, torch.float32)
        self.counter = new(1, torch.int32)
        self.counts = last_sums.counts(device) if device.type == "cuda" else new(last_sums.MAX_COUNTS, torch.int32)
        self.constants = constants(self.h, self.nq, self.nkv, self.d, self.inter, self.layers, programs, self.splits,
                                   block_keys, self.has_norm, self.bqkv is not None, float32=dtype == torch.float32,
                                   ahead=device.type == "cuda" and dtype != torch.float32)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The final hidden state ``[1, hidden]`` of the step's one token (``input_ids[:1]`` at
        ``positions[:1]``), its K and V written at ``meta.slot_mapping[0]`` of every layer's cache."""
        cache, layer_stride, v_offset = cache_layout(kv_caches)
        model = self.model
        self.counter.zero_()
        torch.index_select(model.embed_tokens.weight, 0, input_ids[:1], out=self.s.view(1, -1))
        persistent_decode(
            self.programs, self.warps, self.s, self.s2, self.qkv, self.attn, self.act, self.part_acc, self.part_ml, self.counts,
            self.counter,
            self.wqkv, self.bqkv if self.bqkv is not None else self.wqkv, self.wo, self.wgu, self.wd,
            self.n_in, self.n_post, self.qn, self.kn, cache, layer_stride, v_offset, meta.block_tables[0],
            meta.seq_lens, positions, meta.slot_mapping, model.rotary.cos, model.rotary.sin, self.eps,
            model.layers[0].self_attn.scale, PAGE=cache.shape[2], **self.constants)
        return self.ops.rms_norm(self.s.view(1, -1), model.norm.weight, model.norm.eps)
