"""Rejection sampling: Triton kernel (interpreted on CPU) against the torch reference, the greedy
rules, the sampled distribution against the target, seeding, and the runner-facing sampler.

The kernel runs under ``TRITON_INTERPRET=1`` in one subprocess (``rejection_cases.py``), since
triton reads that variable when a kernel module is imported; nothing here sets it for other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from specloop.sampling import sampler as sampling
from specloop.kernel.sampling_params import SamplingParams
from specloop.sampling.rejection import PLACEHOLDER_TOKEN_ID, rejection_sample_torch
from specloop.sampling.rejection import RejectionSampler

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import rejection_cases as rc  # noqa: E402

TV_BOUND = 0.01
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On a busy machine a two-thread torch pool stalls; one thread keeps these tests' time
    predictable. Restored for the other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_interpreted(code: str, tmp_path: Path) -> dict:
    """Run ``code`` (which writes ``OUT``) in a fresh interpreter with ``TRITON_INTERPRET=1``."""
    out = tmp_path / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", code, str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def kernel_outputs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The interpreted kernel's outputs for ``rc.ALL_CASES`` and ``rc.mixed_cases()``."""
    return run_interpreted("import sys, rejection_cases; rejection_cases.main(sys.argv[1])",
                           tmp_path_factory.mktemp("kernel"))


def tv_per_position(batch: rc.Batch, out: torch.Tensor, accepted: torch.Tensor) -> list[tuple[int, float]]:
    """(samples, total-variation distance to the target) of the token emitted at each position by
    the requests that reached it."""
    out, accepted = out.numpy(), accepted.numpy()
    assert out.shape == (batch.n, batch.case.k + 1)
    assert ((0 <= out) | (out == PLACEHOLDER_TOKEN_ID)).all() and (out < rc.VOCAB).all()
    result = []
    for j in range(batch.case.k + 1):
        reached = accepted >= j
        tokens = out[reached, j]
        assert (tokens >= 0).all() and (tokens < rc.VOCAB).all()
        hist = np.bincount(tokens, minlength=rc.VOCAB) / len(tokens)
        result.append((len(tokens), 0.5 * float(np.abs(hist - batch.target[j]).sum())))
    return result


def check_distribution(batch: rc.Batch, out: torch.Tensor, accepted: torch.Tensor) -> None:
    for j, (n, tv) in enumerate(tv_per_position(batch, out, accepted)):
        assert n >= rc.MIN_SAMPLES, f"position {j}: only {n} samples"
        assert tv < TV_BOUND, f"position {j}: TV {tv:.4f} over {n} samples"
    # The first position is reached by every request: its acceptance rate is the exact alpha.
    rate = float((accepted.numpy() >= 1).mean())
    sigma = np.sqrt(batch.alpha[0] * (1 - batch.alpha[0]) / batch.n)
    assert abs(rate - batch.alpha[0]) < 5 * sigma + 1e-9, (rate, batch.alpha[0])


@pytest.mark.parametrize("case", rc.ALL_CASES, ids=lambda c: c.name)
def test_reference_follows_target_distribution(case: rc.DistCase) -> None:
    batch = rc.build(case)
    check_distribution(batch, *rejection_sample_torch(**batch.args))


@pytest.mark.parametrize("case", rc.ALL_CASES, ids=lambda c: c.name)
def test_kernel_follows_target_distribution(case: rc.DistCase, kernel_outputs: dict) -> None:
    batch = rc.build(case)
    out, accepted = kernel_outputs[case.name]
    check_distribution(batch, out, accepted)


def test_processing_matches_oracle() -> None:
    """The processed cases' targets come from the normal sampler; check them against the oracle."""
    for case in rc.PROCESSED_CASES:
        batch = rc.build(case)
        probs = batch.args["target_probs"][:case.k + 1].double().numpy()
        assert np.abs(probs - batch.target).max() < 1e-5


def test_a_biased_sampler_fails_the_check() -> None:
    """The distribution check has teeth: accepting every draft (no rejection) is caught."""
    batch = rc.build(rc.RAW_CASES[0])
    out, accepted = rejection_sample_torch(**batch.args)
    k = batch.case.k
    biased = torch.cat([batch.draft_token_ids.to(torch.int32), out[:, -1:]], 1)
    with pytest.raises(AssertionError):
        check_distribution(batch, biased, torch.full_like(accepted, k))


def test_kernel_matches_reference(kernel_outputs: dict) -> None:
    for name, args in rc.mixed_cases().items():
        ref_out, ref_acc = rejection_sample_torch(**args)
        out, acc = kernel_outputs[name]
        # Accept/reject decisions use only exact float32 products and comparisons: identical.
        assert torch.equal(acc, ref_acc)
        accepted = torch.arange(out.shape[1])[None, :] < acc[:, None].long()
        assert torch.equal(out[accepted], ref_out[accepted])
        # The final token's exponential noise goes through log, where numpy (the interpreter) and
        # torch may differ in the last ulp; a flip needs two near-equal scores.
        final = out.gather(1, acc[:, None].long()).squeeze(1)
        ref_final = ref_out.gather(1, ref_acc[:, None].long()).squeeze(1)
        assert (final != ref_final).float().mean() <= 1e-3
        assert ((final >= 0) & (final < 37)).all()
        assert ((out == PLACEHOLDER_TOKEN_ID) == (ref_out == PLACEHOLDER_TOKEN_ID)).all()


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from specloop.kernels.rejection_sample import _rejection_sample_kernel as kernel
ptr = {"out_ptr": "*i32", "num_accepted_ptr": "*i32", "draft_ptr": "*i32", "draft_probs_ptr": "*fp32",
       "target_probs_ptr": "*fp32", "target_argmax_ptr": "*i64", "cu_ptr": "*i32", "greedy_ptr": "*i8",
       "seed_ptr": "*i64", "pos_ptr": "*i64"}
ints = {"out_stride": "i64", "draft_probs_stride": "i64", "target_probs_stride": "i64", "num_reqs": "i32",
        "vocab_size": "i32", "max_spec_len": "i32"}
for has_probs in (True, False):
    signature = {name: ptr.get(name) or ints.get(name) or "constexpr" for name in kernel.arg_names}
    constexprs = {"HAS_DRAFT_PROBS": has_probs, "BLOCK_R": 1, "BLOCK_V": 4096}
    compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm.get("cubin")
"""


def test_kernel_compiles_for_hopper() -> None:
    """The launcher's GPU configuration (one request per program) compiles down to an sm_90 cubin;
    the interpreter alone would not catch code that only the compiler rejects."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_greedy_rules() -> None:
    # Two requests over 5 tokens: argmax per row given directly through one-hot targets.
    argmax = torch.tensor([1, 2, 3, 4, 0, 1, 2])  # request 0: rows 0..3 (3 drafts + bonus); 1: rows 4..6
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    common = dict(target_probs=None, target_argmax=argmax, draft_probs=None, cu_num_logits=cu,
                  greedy=torch.tensor([True, True]), seeds=torch.tensor([1, 2]), positions=torch.tensor([0, 0]),
                  max_spec_len=3)
    all_ok = torch.tensor([1, 2, 3, 0, 0, 1, 0], dtype=torch.int32)
    out, acc = rejection_sample_torch(draft_token_ids=all_ok, **common)
    assert out.tolist() == [[1, 2, 3, 4], [0, 1, 2, -1]] and acc.tolist() == [3, 2]
    mismatch = torch.tensor([1, 9, 3, 0, 7, 1, 0], dtype=torch.int32)
    out, acc = rejection_sample_torch(draft_token_ids=mismatch, **common)
    assert out.tolist() == [[1, 2, -1, -1], [0, -1, -1, -1]] and acc.tolist() == [1, 0]


def sampler_inputs(num_reqs: int, seed: int, vocab: int = 50, greedy_every: int = 4, penalties: bool = False,
                   max_drafts: int = 3):
    """Raw logits and metadata rows as the torch runner builds them (drafts count as output)."""
    g = torch.Generator().manual_seed(seed)
    rows, specs, counts = [], [], []
    for r in range(num_reqs):
        k = int(torch.randint(0, max_drafts + 1, (1,), generator=g))
        spec = torch.randint(0, vocab, (k,), generator=g).tolist()
        params = SamplingParams(temperature=0.0 if r % greedy_every == 0 else 0.8, top_k=20 if r % 3 else 0,
                                top_p=0.9 if r % 2 else 1.0, seed=1000 + r,
                                frequency_penalty=0.5 if penalties else 0.0,
                                repetition_penalty=1.2 if penalties else 1.0,
                                logit_bias={3: 2.0} if penalties and r % 5 == 0 else None)
        prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
        output = torch.randint(0, vocab, (r % 4,), generator=g).tolist()
        for j in range(k + 1):
            rows.append(sampling.SamplingRow(params, 1000 + r, len(prompt) + len(output) + j, prompt,
                                             output + spec[:j], []))
        specs.append(spec)
        counts.append(k + 1)
    logits = torch.randn(len(rows), vocab, generator=g) * 3
    meta = sampling.SamplingMetadata.build(rows, vocab, torch.device("cpu"))
    return logits, meta, specs, counts


def test_without_drafts_equals_the_normal_sampler() -> None:
    logits, meta, specs, counts = sampler_inputs(200, seed=3, penalties=True, max_drafts=0)
    got = RejectionSampler("torch")(logits=logits, metadata=meta, spec_token_ids=specs, num_rows=counts)
    assert [g[0] for g in got] == sampling.sample(logits, meta).tolist()


def test_runner_sampler_matches_direct_call_and_skips_idle_requests() -> None:
    logits, meta, specs, counts = sampler_inputs(300, seed=5, penalties=True)
    # Two requests that sample nothing this step (partial prefills) sit in the batch.
    specs_full = [[]] + specs[:150] + [[]] + specs[150:]
    counts_full = [0] + counts[:150] + [0] + counts[150:]
    result = RejectionSampler("torch").verify(logits, meta, specs_full, counts_full)
    assert result.sampled_token_ids[0] == [] and result.sampled_token_ids[151] == []
    processed = sampling.process_logits(logits, meta)
    probs = sampling.probabilities(processed, meta)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
    first = cu[:-1].long()
    draft_ids = torch.tensor([t for s in specs for t in s + [0]], dtype=torch.int32)
    out, acc = rejection_sample_torch(probs, processed.argmax(-1), draft_ids, None, cu, meta.greedy[first],
                                      meta.seeds[first], meta.positions[first], max(counts) - 1)
    direct = [o[:a + 1] for o, a in zip(out.tolist(), acc.tolist())]
    assert [s for i, s in enumerate(result.sampled_token_ids) if i not in (0, 151)] == direct
    live = [i for i in range(len(specs_full)) if counts_full[i]]
    assert all(result.num_accepted[i] + result.num_rejected[i] == len(specs_full[i]) for i in live)
    assert all(len(result.sampled_token_ids[i]) == result.num_accepted[i] + 1 for i in live)


def test_seeded_rows_are_bit_identical_across_runs_and_batches() -> None:
    logits, meta, specs, counts = sampler_inputs(120, seed=6, greedy_every=1000)
    sampler = RejectionSampler("torch")
    first = sampler.verify(logits, meta, specs, counts).sampled_token_ids
    assert sampler.verify(logits, meta, specs, counts).sampled_token_ids == first
    # The same requests, in reverse order and next to other requests: same tokens for each.
    cu = np.concatenate([[0], np.cumsum(counts)])
    other_logits, other_meta, other_specs, other_counts = sampler_inputs(40, seed=7)
    order = list(reversed(range(120)))
    row_index = torch.tensor(np.concatenate([np.arange(cu[i], cu[i + 1]) for i in order]))
    mixed_logits = torch.cat([other_logits, logits[row_index]])
    mixed_meta = _concat_meta(other_meta, _take_meta(meta, row_index))
    mixed = sampler.verify(mixed_logits, mixed_meta, other_specs + [specs[i] for i in order],
                           other_counts + [counts[i] for i in order]).sampled_token_ids
    assert mixed[40:] == [first[i] for i in order]
    # Another seed changes the tokens of sampled rows.
    reseeded = _take_meta(meta, torch.arange(len(logits)))
    reseeded.seeds = reseeded.seeds + 1
    assert sampler.verify(logits, reseeded, specs, counts).sampled_token_ids != first


def _take_meta(meta: sampling.SamplingMetadata, index: torch.Tensor) -> sampling.SamplingMetadata:
    def take(x):
        return None if x is None else x[index]

    assert meta.bias is None and meta.banned is None and meta.output_counts is None
    return sampling.SamplingMetadata(
        temperature=meta.temperature[index], greedy=meta.greedy[index], all_greedy=meta.all_greedy,
        seeds=meta.seeds[index], positions=meta.positions[index], top_k=take(meta.top_k), top_p=take(meta.top_p),
        min_p=take(meta.min_p), repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
        prompt_mask=None, output_counts=None, bias=None, banned=None,
        num_logprobs=[meta.num_logprobs[i] for i in index.tolist()])


def _concat_meta(a: sampling.SamplingMetadata, b: sampling.SamplingMetadata) -> sampling.SamplingMetadata:
    vocab_fill = {"top_k": None, "top_p": 1.0, "min_p": 0.0}

    def cat(name: str):
        x, y = getattr(a, name), getattr(b, name)
        if x is None and y is None:
            return None
        n_x, n_y = len(a.seeds), len(b.seeds)
        x = x if x is not None else torch.full((n_x,), vocab_fill[name])
        y = y if y is not None else torch.full((n_y,), vocab_fill[name])
        return torch.cat([x, y])

    return sampling.SamplingMetadata(
        temperature=torch.cat([a.temperature, b.temperature]), greedy=torch.cat([a.greedy, b.greedy]),
        all_greedy=a.all_greedy and b.all_greedy, seeds=torch.cat([a.seeds, b.seeds]),
        positions=torch.cat([a.positions, b.positions]), top_k=cat("top_k"), top_p=cat("top_p"),
        min_p=cat("min_p"), repetition_penalty=None, frequency_penalty=None, presence_penalty=None,
        prompt_mask=None, output_counts=None, bias=None, banned=None,
        num_logprobs=a.num_logprobs + b.num_logprobs)


def test_draft_probabilities_are_used_when_given() -> None:
    """With q given, a draft the target likes less than the proposer did is sometimes rejected
    even though the target would have sampled it; acceptance then follows min(1, p/q)."""
    vocab, n = 4, 20000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])).repeat(n, 1)
    rows = [sampling.SamplingRow(SamplingParams(temperature=1.0, seed=r), r, 10, [], [0] * j, [])
            for r in range(n) for j in range(2)]
    meta = sampling.SamplingMetadata.build(rows, vocab, torch.device("cpu"))
    q = torch.tensor([[0.9, 0.05, 0.025, 0.025]])
    result = RejectionSampler("torch").verify(logits, meta, [[0]] * n, [2] * n, [q] * n)
    rate = np.mean(result.num_accepted)
    assert abs(rate - 0.5 / 0.9) < 0.02  # one-hot q would accept with p(0) = 0.5
    with pytest.raises(ValueError, match="rows"):
        RejectionSampler("torch").verify(logits[:3], meta, [[0]], [3])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("case", rc.ALL_CASES, ids=lambda c: c.name)
def test_cuda_kernel_follows_target_distribution(case: rc.DistCase) -> None:
    from specloop.kernels.rejection_sample import rejection_sample

    batch = rc.build(case)
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.args.items()}
    out, accepted = rejection_sample(**args)
    check_distribution(batch, out.cpu(), accepted.cpu())


@pytest.mark.gpu
@cuda
def test_cuda_kernel_matches_reference() -> None:
    from specloop.kernels.rejection_sample import rejection_sample

    for name, host_args in rc.mixed_cases().items():
        args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in host_args.items()}
        out, acc = rejection_sample(**args)
        ref_out, ref_acc = rejection_sample_torch(**args)
        assert torch.equal(acc, ref_acc)
        final = out.gather(1, acc[:, None].long()).squeeze(1)
        ref_final = ref_out.gather(1, ref_acc[:, None].long()).squeeze(1)
        # GPU log and division are not correctly rounded; flips need near-equal scores.
        assert (final != ref_final).float().mean() <= 1e-3
        again, _ = rejection_sample(**args)
        assert torch.equal(out, again)


def test_fast_greedy_verification_matches_the_rejection_sampler() -> None:
    """The GPU stage's greedy verification (argmax rows, one copy, drafts compared on the host)
    emits what the rejection sampler emits, for every acceptance pattern, with requests that
    sample nothing (partial prefills), requests without drafts and requests under a grammar mask
    (at every draft position) in the same batch."""
    from types import SimpleNamespace

    from specloop.backends.gpu.fast_sampling import FastSamplingStage
    from specloop.backends.sampling_stage import SamplingStage
    from specloop.sampling.structured_outputs import GrammarBitmask, apply_token_bitmask_torch, num_words

    torch.manual_seed(0)
    vocab, greedy = 50, SamplingParams(temperature=0.0)
    stage = FastSamplingStage(SamplingStage(torch.nn.Identity(), vocab, torch.device("cpu")),
                              SimpleNamespace(device=torch.device("cpu"), top=torch.zeros(64, dtype=torch.int64)), 64)
    masked_rows = 0
    for trial in range(40):
        counts, specs, rows, masks, masked = [], [], [], [], []
        for r in range(5):
            kind = trial % 3 if not rows else int(torch.randint(0, 3, ()).item())
            n = int(torch.randint(1, 5, ()).item())
            logits = torch.randn(n, vocab)
            if kind == 0:  # partial prefill chunk: samples nothing
                counts.append(0)
                specs.append([])
                continue
            if torch.rand(()) < 0.5:  # constrained: a random mask per row, never empty
                mask = torch.randint(-2**31, 2**31 - 1, (n, num_words(vocab)), dtype=torch.int32) | 1
                masks.append(mask)
                masked.append((f"r{r}", n))
                logits = logits.clone()
                apply_token_bitmask_torch(logits, mask, torch.arange(n))
            top = logits.argmax(-1).tolist()
            drafts = [t if torch.rand(()) < 0.7 else (t + 1) % vocab for t in top[:n - 1]]
            counts.append(n)
            specs.append(drafts)
            rows.append(logits)
        # The stage sees the logits before masking: unmask the constrained rows' -inf back to noise.
        want_logits = torch.cat(rows) if rows else torch.empty(0, vocab)
        raw = torch.where(torch.isinf(want_logits), torch.randn_like(want_logits) + 5, want_logits)
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        batch = SimpleNamespace(precomputed_logits=raw, logits_indices=torch.arange(raw.shape[0]),
                                num_tokens=raw.shape[0], sample_rows=list(zip(firsts, counts)),
                                spec_token_ids=specs, req_ids=[f"r{r}" for r in range(5)],
                                # half the time, the argmax a verification graph would have taken
                                greedy=raw.argmax(-1) if trial % 2 else None)
        grammar = GrammarBitmask([rid for rid, _ in masked], [n for _, n in masked],
                                 torch.cat(masks).numpy()) if masks else None
        masked_rows += sum(n for _, n in masked)
        fast = stage._verify_greedy(batch, raw, grammar, None).sampled
        meta = sampling.SamplingMetadata.build(
            [sampling.SamplingRow(greedy, 0, 10 + j, [1], [], []) for n in counts for j in range(n)], vocab,
            torch.device("cpu"))
        want = RejectionSampler("torch")(logits=want_logits, metadata=meta, spec_token_ids=specs, num_rows=counts)
        assert fast == want
    assert masked_rows > 50
