"""Batch-invariant mode through the engine: a request's greedy tokens and logprobs, bit for bit,
alone, among other requests (ragged decode, prefill chunks beside it) and with drafts verified
(several query rows per request), on the gpu runner.

Shared by ``test_triton_kernels.py`` (CPU, in a child process under ``TRITON_INTERPRET=1``) and
``test_gpu_backend.py`` (CUDA, bf16, CUDA graphs).
"""

from __future__ import annotations

from typing import Any

from hf_models import prompts, tiny
import fast_interpreter

from specloop import LLM, SamplingParams



fast_interpreter.install()  # a no-op unless TRITON_INTERPRET=1


def _outputs(llm: Any, batch: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    out = []
    for o in got:
        c = o.outputs[0]
        out.append((list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    return out


def check_batch_invariance(device: str, dtype: str, variant: str = "qwen3", invariant: bool = True
                           ) -> list[tuple[list[int], list[float]]]:
    """Runs the request alone, in a batch, and with drafts; asserts (with ``invariant``) that its
    tokens and logprobs are identical in all three. Returns the three results."""
    model = tiny(variant)
    ps = prompts(4, seed=31, min_len=9, max_len=21)
    target = ps[0]
    engine = dict(model_runner="gpu", device=device, dtype=dtype, skip_tokenizer_init=True, block_size=4,
                  num_kv_blocks=64, max_model_len=64, max_num_batched_tokens=24, batch_invariant=invariant)
    llm = LLM(model.path, **engine)
    alone = _outputs(llm, [target])[0]
    batched = _outputs(llm, [ps[1], target, ps[2], ps[3]])[1]
    # Drafts that are the request's own greedy continuation (the acceptance-controlled proposer at
    # alpha 1): every verification step computes 4 rows for it, and they are accepted.
    known = {tuple(target): alone[0], tuple(ps[1]): _outputs(llm, [ps[1]])[0][0]}
    llm.core.shutdown()
    spec = LLM(model.path, **engine, plugin_options={"controlled": {"continuations": known}},
               speculative_config={"method": "controlled", "extra": {"wraps": "ngram", "alpha": 1.0},
                                   "num_speculative_tokens": 3})
    drafted = _outputs(spec, [target, ps[1]])[0]
    accepted = spec.get_metrics()["spec_num_accepted_tokens"]
    spec.core.shutdown()
    if invariant:
        assert accepted > 0, "no draft was accepted: the verification rows were not exercised"
        assert batched == alone, (alone, batched)
        assert drafted == alone, (alone, drafted)
    return [alone, batched, drafted]


def _main() -> None:
    import sys

    for variant in sys.argv[1].split(","):
        for dtype in sys.argv[2].split(","):
            check_batch_invariance("cpu", dtype, variant)
    print("ok batch_invariance")


if __name__ == "__main__":
    _main()
