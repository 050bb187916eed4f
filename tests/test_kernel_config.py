import sys

import pytest

from specloop.kernel import EngineConfig, SamplingParams, SpeculativeConfig


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("n", 0),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("max_tokens", 0),
    ("min_tokens", -1), ("logprobs", 21), ("prompt_logprobs", -1), ("stop_token_ids", [-1]),
    ("logit_bias", {1: 1000.0}),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalise():
    p = SamplingParams(stop="x", top_k=-1, logit_bias={"5": 1}, temperature=0)
    assert p.stop == ["x"] and p.top_k == 0 and p.logit_bias == {5: 1.0} and p.greedy
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
    with pytest.raises(ValueError, match="vocabulary"):
        SamplingParams(logit_bias={100: 1.0}).verify_vocab(50)


def test_speculative_config_parsing():
    spec = SpeculativeConfig.from_any('{"method": "ngram", "num_speculative_tokens": 3}')
    assert spec.prompt_lookup_min == 1 and spec.prompt_lookup_max == 4
    with pytest.raises(ValueError, match="JSON"):
        SpeculativeConfig.from_any("{nope")
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig.from_any({"num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 0})
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2}).num_lookahead_tokens == 2


def test_engine_config_resolve():
    c = EngineConfig(enable_chunked_prefill=False)
    c.resolve(32768)
    assert c.max_model_len == 32768 and c.max_num_batched_tokens == 32768
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(max_model_len=100).resolve(50)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)


def test_kernel_imports_no_torch():
    import subprocess
    code = "import specloop.kernel, specloop.cli, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
