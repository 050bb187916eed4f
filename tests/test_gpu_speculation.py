"""Every built-in proposer and structured outputs on the ``"gpu"`` runner (Triton kernels, CUDA
graphs): the shipped default model and its draft and heads in float32, greedy output equal to the
output without drafts, and JSON-schema output that validates, with and without drafts. Skipped
without CUDA."""

from __future__ import annotations

import gc
import json
import os
import sysconfig
import tempfile

import jsonschema
import pytest
import torch
from hf_models import prompts
from scripted_policy import Alternating, OverlapCounter

from specloop import LLM, SamplingParams, StructuredOutputsParams
from specloop.cli import main
from specloop.frontend.model_path import default_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "medusa": {"method": "medusa", "num_speculative_tokens": 3},
    # EAGLE-1 drafting from 1,024 of the vocabulary's 8,192 ids (a token map counted on code)
    "eagle+map": {"method": "eagle", "num_speculative_tokens": 3, "token_map": "counted"},
}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


def _counted_map() -> str:
    """A token map of the default model's 1,024 most frequent tokens in two standard-library packages."""
    path = os.path.join(tempfile.gettempdir(), f"specloop-test-map-{os.getpid()}.json")
    if not os.path.exists(path):
        stdlib = sysconfig.get_paths()["stdlib"]
        assert main(["token-map", os.path.join(stdlib, "json"), os.path.join(stdlib, "email"), "--size", "1024",
                     "--out", path]) == 0
    return path


def _llm(spec: dict | None) -> LLM:
    if spec is not None and spec["method"] not in ("ngram",):
        name = "specloop-tiny-draft" if spec["method"] == "draft_model" else f"specloop-tiny-{spec['method']}"
        spec = dict(spec, model=default_model_dir(name))
    if spec is not None and spec.get("token_map") == "counted":
        spec = dict(spec, token_map=_counted_map())
    return LLM(device="cuda", dtype="float32", max_model_len=512, speculative_config=spec)


def _generate(spec: dict | None, batch: list, params: SamplingParams) -> list[list[int]]:
    """Token ids from a fresh engine, closed (and unreferenced) before returning."""
    llm = _llm(spec)
    out = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    llm.core.shutdown()
    del llm  # the last reference: what is left are cycles, which collect() frees
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _close(llm: LLM) -> None:
    llm.core.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


CODE = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\n\n\ndef main():\n",
        "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(", "    for key, value in sorted(items.items()):\n",
        "class Error(Exception):\n    \"\"\"Base class for", "try:\n    import _thread\nexcept ImportError:\n",
        "def __repr__(self):\n        return", "        if not isinstance(other, self.__class__):\n            return"]


@pytest.fixture(scope="module")
def batch() -> list:
    # The default model's own kind of text (its heads were trained on it) and random token ids.
    return CODE + [{"prompt_token_ids": p} for p in prompts(3, seed=11, min_len=16, max_len=120)]


@pytest.fixture(scope="module")
def reference(batch: list) -> list[list[int]]:
    llm = _llm(None)
    out = [o.outputs[0].token_ids for o in llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=64,
                                                                              ignore_eos=True), use_tqdm=False)]
    assert llm.core.runner.parts.executor.num_replays > 0, "the gpu runner did not replay CUDA graphs"
    _close(llm)
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_is_unchanged_by_drafts(name: str, batch: list, reference: list[list[int]]) -> None:
    llm = _llm(SPECS[name])
    method = name.split("+")[0]
    proposer = llm.core.runner.drafter.proposer
    launched = []
    launch = proposer.launch
    proposer.launch = _counting(launch, launched)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=64,
                                                                              ignore_eos=True), use_tqdm=False)]
    metrics = llm.get_metrics()
    runner = llm.core.runner
    verify_replays = runner.parts.executor.num_replays
    graphs = getattr(runner.drafter.proposer, "chain", None) or getattr(runner.drafter.proposer, "graphs", None)
    draft_replays = graphs.num_replays if graphs is not None else None
    feeds = getattr(runner.drafter.proposer, "feed_graphs", {})
    feed_replays = sum(g.num_replays for g in feeds.values())
    device_fed = sum(getattr(g, "num_device_replays", 0) for g in feeds.values())
    # n-gram, Medusa and the draft model: one graph per verification shape, fed from the device
    launch_replays = sum(g.num_replays for g in getattr(runner.drafter.proposer, "launch_graphs", {}).values())
    _close(llm)
    assert metrics["spec_num_accepted_tokens"] > 0, f"{method} never had a draft accepted"
    for i, (a, b) in enumerate(zip(got, reference)):
        assert list(a) == list(b), f"{method}: prompt {i} differs from decoding without drafts"
    assert verify_replays > 0, f"{method}: no verification step replayed a CUDA graph"
    if method in ("draft_model", "eagle", "eagle3"):
        assert draft_replays, f"{method}: no drafting step replayed a CUDA graph"
    if method in ("eagle", "eagle3"):
        assert feed_replays, f"{method}: no first drafting step (the feed of the target's rows) replayed a graph"
        # After a uniform verification the whole proposal is launched from the device.
        assert sum(launched) > 10, f"{method}: proposals never launched from the device"
        # ... in the graph that reads the verification's own tensors (no host inputs).
        assert device_fed > 10, f"{method}: {device_fed} proposals fed from the device"
    if method in ("ngram", "medusa", "draft_model"):  # after a verification, one graph replay each
        assert sum(launched) > 10 and launch_replays > 10, \
            f"{method}: {sum(launched)} launches, {launch_replays} replayed"


def _counting(launch, launched: list):
    def counted(step):
        drafts = launch(step)
        launched.append(drafts is not None)
        return drafts
    return counted


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_sampled_drafting_runs_on_the_gpu(method: str, batch: list) -> None:
    """Seeded sampling with drafts (the eager drafting path and the reference verification) gives
    the same tokens twice, and every request its full length."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)
    outs = [_generate(SPECS[method], batch, params) for _ in range(2)]
    assert outs[0] == outs[1]
    assert all(len(t) == 32 for t in outs[0])


@pytest.mark.parametrize("method", [None, "ngram"])
def test_json_schema_outputs_validate_on_the_gpu(method: str | None) -> None:
    llm = _llm(SPECS[method] if method else None)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA))
              for t, s in ((0.0, 0), (0.8, 1), (1.0, 2), (0.8, 3))]
    outs = llm.generate(["The pet record:", "JSON please", "def f(x):", "{"], params, use_tqdm=False)
    _close(llm)
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_drafting_in_runs_overlaps_the_steps_without_drafts(method: str, batch: list, reference: list[list[int]]) -> None:
    """Asynchronous scheduling (the default on CUDA) with a policy that drafts in runs: steps
    without drafts are deferred on the device and overlap the next, steps with drafts are
    committed before it (EAGLE-3 keeps its cache up on the device after the steps without
    drafts); greedy output is unchanged."""
    llm = _llm(SPECS[method])
    assert llm.config.async_scheduling
    core = llm.core
    core.runner.drafter.policy = Alternating()
    overlapped = OverlapCounter(core)
    got = [o.outputs[0].token_ids for o in llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=64,
                                                                              ignore_eos=True), use_tqdm=False)]
    metrics = llm.get_metrics()
    _close(llm)
    assert [list(t) for t in got] == [list(t) for t in reference]
    assert metrics["spec_num_accepted_tokens"] > 0 and overlapped.count > 10
