"""``plugin_options``: a key names a registered component or plugin, and each built-in owner refuses
an option it does not know, naming it (``plugins/options.py``)."""

from __future__ import annotations

import types

import pytest

from specloop import LLM, SamplingParams
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager

SCRIPTED = dict(model_runner="scripted", num_kv_blocks=64, max_model_len=256, skip_tokenizer_init=True)


def test_a_key_that_names_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="plugin_options has key\\(s\\) 'gpuu' that name no registered component"):
        LLM(plugin_options={"gpuu": {"skinny_gemv": False}}, **SCRIPTED)
    # nor one of a plugin turned off
    with pytest.raises(ValueError, match="key\\(s\\) 'tracing' that name no registered"):
        LLM(plugin_options={"tracing": True}, disable_plugins=("specloop.plugins.tracing",), **SCRIPTED)


def test_components_and_plugins_name_their_options() -> None:
    """A component's name (the scripted runner, a proposer) and a plugin's (the last part of its
    registered name) are keys; the plugin reads its own."""
    seen = {}
    plugin = types.ModuleType("mypackage.myplugin")

    @hookimpl
    def specloop_startup(engine) -> None:
        seen.update(engine.config.plugin_options["myplugin"])

    plugin.specloop_startup = specloop_startup
    llm = LLM(plugin_options={"myplugin": {"colour": "blue"}, "scripted": {"vocab_size": 50}}, **SCRIPTED,
              plugins=PluginManager([plugin]))
    assert seen == {"colour": "blue"} and llm.core.runner.vocab_size == 50
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("options, message", [
    ({"scripted": {"vocab": 50}}, "plugin_options\\['scripted'\\] has unknown option\\(s\\) 'vocab'; known: vocab_size"),
    ({"spec_metrics": {"log_interval": 1}}, "'log_interval'; known: log_interval_s"),
    ({"tracing": {"step": False}}, "'step'; known: enabled, steps"),
    ({"timeline": {"file": "t.json"}}, "'file'; known: path"),
    ({"timeline": "t.json"}, "plugin_options\\['timeline'\\] must be a dict of options"),
])
def test_built_in_owners_refuse_options_they_do_not_know(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(plugin_options=options, **SCRIPTED)


def test_the_controlled_proposer_refuses_options_it_does_not_know() -> None:
    spec = {"method": "controlled", "num_speculative_tokens": 2, "extra": {"wraps": "ngram"}}
    with pytest.raises(ValueError, match="plugin_options\\['controlled'\\] has unknown option\\(s\\) 'continuation'"):
        LLM(plugin_options={"controlled": {"continuation": {}}}, speculative_config=spec, max_model_len=64)
