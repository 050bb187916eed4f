"""The Triton kernels on the CPU, through Triton's interpreter, against short PyTorch references.

``TRITON_INTERPRET=1`` decides how ``@triton.jit`` wraps a kernel when its module is first
imported, and would leak into every other test of the session; so each check runs in a child
process (``tests/kernel_checks.py``) with the variable set only there. Shapes are small (the
interpreter runs one program at a time); the same checks run on the GPU with bf16 in
``test_gpu_backend.py``. float16 stands in for bf16 here: the interpreter computes bf16 dot products
wrongly (Triton 3.9, numpy has no bf16).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECKS = Path(__file__).with_name("kernel_checks.py")


def _env(interpret: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return env


def _run(*args: str, interpret: bool = True, script: Path = CHECKS, expect: str = "", timeout: int = 300) -> None:
    proc = subprocess.run([sys.executable, str(script), *args], env=_env(interpret), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (expect or f"ok {args[0]}") in proc.stdout


def _run_together(*runs: tuple[str, str], script: Path, timeout: int = 900) -> None:
    """Each ``(argument, expected line)`` as a child process of ``script``, all at once (the
    interpreter keeps one core busy each), every one checked."""
    procs = [(subprocess.Popen([sys.executable, str(script), arg], env=_env(True), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True), expect) for arg, expect in runs]
    failures = []
    for proc, expect in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            failures.append(f"{expect!r}: timed out after {timeout} s\n{out[-2000:]}{err[-2000:]}")
            continue
        if proc.returncode != 0 or expect not in out:
            failures.append(f"{expect!r}: exit {proc.returncode}\n{out[-3000:]}{err[-3000:]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.parametrize("check", ["paged_attention", "attention_rope", "kv_write", "rms_norm", "rotary", "qk_rope_cache",
                                   "silu_and_mul", "matmul", "skinny_linear", "mla_attention", "mla_rope_cache", "fused_moe", "skinny_moe", "moe_route", "router_route",
                                   "token_bitmask", "verify", "ngram", "argmax_rows"])
def test_kernel_matches_torch_reference(check: str) -> None:
    _run(check, "float32,float16")


def test_gumbel_sample_follows_softmax_and_is_seeded() -> None:
    _run("gumbel_sample")


def test_every_kernel_compiles_for_hopper() -> None:
    # Catches what the interpreter cannot: types, layouts and shared memory of the real compile.
    _run("compiles_for_hopper", interpret=False)


def test_gpu_runner_matches_torch_runner_under_interpreter() -> None:
    # The whole gpu runner (persistent batch, prepare kernel, fused forward, fast sampler; MLA and
    # fused MoE for DeepSeek-V3) on the CPU: same tokens as the torch runner through chunking, a
    # prefix hit, a seeded sampled request and preemption; grammar masks on the fast sampler with
    # asynchronous scheduling; n-gram and Medusa proposals launched from the device. CUDA graphs need
    # a GPU (test_gpu_backend.py); their ragged and decode bodies (the decode graph's own draws) and
    # the launch graphs run here as eager stand-ins on the graphs' buffers. The few-rows kernels
    # (DeepSeek-V3: fused norms, the one-token MoE) decode a lone request in float16 as without them,
    # and so do decode steps with the rotary and KV write inside attention (rope_in_attention).
    _run_together(("qwen3,llama,deepseek_v3", "ok runner"), ("launch:ngram", "ok launch"),
                  ("launch:medusa", "ok launch"), ("few_rows:deepseek_v3", "ok few_rows"),
                  ("rope:qwen3,llama", "ok rope"),
                  script=CHECKS.with_name("runner_checks.py"))


def test_draft_graph_paths_under_interpreter() -> None:
    # EAGLE-3, EAGLE-1 with a token map, MTP and draft-model graph paths (run eagerly on their static buffers) drafting what
    # their eager paths draft, their proposals launched from the device with their drafts read a
    # step late (EAGLE-3 through admissions, a preemption and a sampled request; with
    # asynchronous scheduling the verification itself read a step late), and the
    # acceptance-controlled proposer wrapping EAGLE-3 on that path accepting at alpha; MTP's graph
    # paths in float16, whose padding rows may hold NaN (experts and tokens that exist all the same).
    _run_together(("drafts:eagle3,eagle+map", "ok drafts"), ("drafts:mtp,draft_model,controlled", "ok drafts"),
                  ("half_drafts", "ok half_drafts"), script=CHECKS.with_name("runner_checks.py"))


def test_batch_invariant_mode_under_interpreter() -> None:
    # batch_invariant=True on the gpu runner: a request's greedy tokens and logprobs bit-identical
    # alone, among others and verifying drafts (the same run without the mode differs in the last
    # bits of its logprobs here). On CUDA in bf16: test_gpu_backend.py.
    _run("qwen3,llama", "float16", script=CHECKS.with_name("batch_invariance_checks.py"), expect="ok batch_invariance")


def test_a_prompt_arriving_alone_runs_the_unsplit_prefill_kernel(monkeypatch) -> None:
    """Flash-decoding splits are sized for one program per sequence along the queries. A
    prefill-heavy step has many programs already: a 1,024-token prompt alone must not run 8 splits
    (every split count is a kernel compile of its own, most of a second on the GPU, and the
    partial sums are extra work), while a short verification or a decode after a long context
    keeps its splits. Launches are recorded, not run."""
    import kernel_checks as kc
    import torch

    import specloop.kernels.paged_attention as attention

    launched: list[tuple[str, int]] = []

    class Recorder:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: object):
            return lambda *args, **kwargs: launched.append((self.name, kwargs["NUM_SPLITS"]))

    monkeypatch.setattr(attention, "_paged_attention_kernel", Recorder("attention"))
    monkeypatch.setattr(attention, "_reduce_splits_kernel", Recorder("reduce"))
    for q_len, context, want in ((1024, 0, [("attention", 1)]),
                                 (4, 2000, [("attention", 8), ("reduce", 8)]),
                                 (1, 2000, [("attention", 8), ("reduce", 8)])):
        launched.clear()
        q, kc_, vc, qsl, seq_lens, bt = kc._ragged_batch([q_len], [context], 16, 8, 128, 16, "cpu", torch.bfloat16)
        attention.paged_attention(q, kc_, vc, qsl, seq_lens, bt, scale=0.1, max_query_len=q_len, num_splits=8)
        assert launched == want, (q_len, context, launched)

    # The latent (MLA) kernel sizes its splits the same way.
    import specloop.kernels.mla_attention as mla

    monkeypatch.setattr(mla, "_mla_attention_kernel", Recorder("attention"))
    monkeypatch.setattr(mla, "_reduce_splits_kernel", Recorder("reduce"))
    for q_len, context, want in ((1024, 0, [("attention", 1)]), (1, 2000, [("attention", 8), ("reduce", 8)])):
        launched.clear()
        _, _, _, qsl, seq_lens, bt = kc._ragged_batch([q_len], [context], 1, 1, 8, 16, "cpu", torch.bfloat16)
        latent = torch.randn(int(bt.max()) + 1, 16, 80, dtype=torch.bfloat16)
        q_nope = torch.randn(q_len, 16, 64, dtype=torch.bfloat16)
        q_rope = torch.randn(q_len, 16, 16, dtype=torch.bfloat16)
        mla.mla_attention(q_nope, q_rope, latent, qsl, seq_lens, bt, scale=0.1, max_query_len=q_len, num_splits=8)
        assert launched == want, ("mla", q_len, context, launched)



def test_dense_attention_splits_its_keys_until_the_chip_is_filled_four_times() -> None:
    """A decode step of few sequences x KV heads splits its keys until the programs fill the chip
    four times over (132 SMs), in slices of two tiles at least; a step of as many programs as
    SMs runs unsplit."""
    from specloop.kernels.splits import choose_num_splits

    assert choose_num_splits(16, 8, 32768) == 4  # 128 programs -> 512
    assert choose_num_splits(8, 8, 32768) == 8
    assert choose_num_splits(1, 8, 32768) == 32  # capped
    assert choose_num_splits(1, 8, 640) == 4  # 640 keys: five slices of 128, a power of two below
    assert choose_num_splits(16, 8, 256) == 1  # two slices' worth of keys at most
    assert choose_num_splits(17, 8, 32768) == 1  # 136 programs: the chip is full
    assert choose_num_splits(16, 8, 32768, fill=2) == 2


def test_latent_attention_splits_its_keys_down_to_a_few_each() -> None:
    """An MLA decode step whose programs (sequences x head blocks) leave the chip idle splits its
    keys until the programs fill it twice or a split holds 16 keys; a full batch runs unsplit."""
    from specloop.backends.gpu.triton_attention import choose_latent_splits

    assert choose_latent_splits(1, 16, 160) == 8  # DeepSeek-V2-Lite: one head block of 16 heads
    assert choose_latent_splits(1, 16, 40960) == 32  # capped
    assert choose_latent_splits(16, 16, 304) == 16  # 256 programs: twice the chip
    assert choose_latent_splits(64, 16, 304) == 4
    assert choose_latent_splits(1, 16, 16) == 1  # one split's worth of keys
    assert choose_latent_splits(256, 16, 4096) == 1
