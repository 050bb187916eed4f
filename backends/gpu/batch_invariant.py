"""Batch-invariant mode (``batch_invariant=True``, ``--batch-invariant``): a token's logits do not
depend on what else shares its step.

In bf16 a matmul's rounding depends on the kernel cuBLAS picks for the problem size, and
attention's on the tile and the KV splits chosen for the batch. So one token can get different
logits when it decodes alone, verifies drafts, is prefilled in a chunk or decodes among 200
others, and greedy output with and without speculation (or at another batch size) parts at the
first near-tie. In this mode:

* every linear layer of the target (the fused projections, the MLP, the LM head) runs
  :func:`specloop.kernels.matmul.invariant_linear`, one tile shape for every batch;
* attention runs one program per new token, one key tile and no KV splits
  (``paged_attention(invariant=True)``), so decode, verification and prefill rows compute the same
  sums in the same order;
* RMSNorm (one program per row), rotary, the activation and the embedding are per token already,
  and greedy sampling is an argmax.

Dense (Llama / Qwen) targets at ``tensor_parallel_size`` 1 on the GPU runner with its fused Triton
ops; anything else is refused by name. Drafts are the proposer's business: they change which
tokens are verified, never the target's logits for a token.
"""

from __future__ import annotations

from torch import nn

from specloop.kernels.matmul import invariant_linear
from specloop.models.ops import TRITON_OPS
from specloop.models.parallel import ColumnParallelLinear, ParallelLMHead, RowParallelLinear

from .triton_attention import TritonAttentionBackend


def make_batch_invariant(runner) -> int:  # type: ignore[no-untyped-def]
    """Switch ``runner``'s target model to batch-invariant kernels; returns the layers switched.
    Raises ``ValueError`` naming what the mode does not cover."""
    config, mc = runner.config, runner.model_config
    if config.tensor_parallel_size > 1:
        raise ValueError("batch_invariant=True runs at tensor_parallel_size 1 (the all-reduce is not covered)")
    if mc.mla is not None or mc.moe is not None:
        raise ValueError("batch_invariant=True covers dense Llama/Qwen models; this model's MLA attention "
                         "or MoE layers have no batch-invariant kernels")
    if not isinstance(runner.attn_backend, TritonAttentionBackend):
        raise ValueError(f"batch_invariant=True needs the 'triton' attention backend, not "
                         f"{runner.attention_backend_name!r}")
    if runner.ops is not TRITON_OPS:
        raise ValueError("batch_invariant=True needs the fused Triton ops (plugin_options gpu fused=True)")
    switched = 0
    for name, module in runner.model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            module.matmul = invariant_linear
            switched += 1
        elif isinstance(module, nn.Linear):
            raise ValueError(f"batch_invariant=True: layer {name!r} is a plain nn.Linear this mode does not switch")
    return switched
