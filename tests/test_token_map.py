"""Draft vocabularies (``speculative_config["token_map"]``, ``proposers.draft_vocab``) and their
counter (``specloop token-map``): the file formats and their errors, the methods that take one,
and EAGLE drafting only the map's tokens with greedy output unchanged (MTP's oracles with a map are
in test_mtp.py: draft counts and logits against a reference, sampled output's distribution)."""

from __future__ import annotations

import json
import os
import sysconfig
from collections import Counter
from pathlib import Path

import pytest
import torch

from specloop import LLM, SamplingParams
from specloop.cli import main
from specloop.frontend.tokenizer import Tokenizer
from specloop.kernel.hookspecs import hookimpl
from specloop.kernel.plugins import PluginManager
from specloop.proposers.base import DraftProposal, ProposerInputs
from specloop.proposers.draft_vocab import load_token_map
from specloop.proposers.eagle import EagleProposer

SHIPPED = Path(__file__).resolve().parent.parent / "default_models"
TARGET = str(SHIPPED / "specloop-tiny")
STDLIB = sysconfig.get_paths()["stdlib"]


def test_token_map_files_json_and_saved_tensors(tmp_path: Path) -> None:
    (tmp_path / "ids.json").write_text(json.dumps([7, 3, 3, 100]))
    torch.save(torch.tensor([5, 1], dtype=torch.int32), tmp_path / "ids.pt")
    assert load_token_map(str(tmp_path / "ids.json"), 101).tolist() == [3, 7, 100]
    assert load_token_map(str(tmp_path / "ids.pt"), 101).tolist() == [1, 5]


@pytest.mark.parametrize("content, message", [
    (None, "is not a file"),
    ("[1, 2", "neither a JSON list of token ids nor a saved tensor"),
    ("[]", "non-empty list of integer token ids"),
    ("[1.5, 2]", "non-empty list of integer token ids"),
    ("[[1], [2]]", "non-empty list of integer token ids"),
    ("[1, 101]", r"ids outside the target's vocabulary \[0, 101\)"),
    ("[-1, 2]", "ids outside"),
])
def test_malformed_token_maps_are_clear_errors(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "ids.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_token_map(str(path), 101)


@pytest.mark.parametrize("method", ["eagle3", "medusa"])
def test_methods_with_their_own_vocabulary_refuse_a_token_map(tmp_path: Path, method: str) -> None:
    (tmp_path / "ids.json").write_text("[1, 2, 3]")
    spec = {"method": method, "num_speculative_tokens": 2, "model": str(SHIPPED / f"specloop-tiny-{method}"),
            "token_map": str(tmp_path / "ids.json")}
    with pytest.raises(ValueError, match=f"token_map does not apply to method '{method}'"):
        LLM(TARGET, skip_tokenizer_init=True, max_model_len=64, speculative_config=spec)


def test_counted_map_holds_the_most_frequent_tokens_and_eos(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    text = tmp_path / "text"
    (text / "sub").mkdir(parents=True)
    (text / "a.py").write_text("def f(x):\n    return x + 1\n" * 20)
    (text / "sub" / "b.py").write_text("import os\nprint(os.getcwd())\n")
    (text / "blob.bin").write_bytes(b"\xff\xfe\x00binary")
    out = tmp_path / "map.json"
    assert main(["token-map", str(text), "--size", "5", "--out", str(out)]) == 0
    assert "skipped 1 file(s) not UTF-8 text" in capsys.readouterr().out
    tok = Tokenizer(TARGET)
    counts = Counter(tok.encode((text / "a.py").read_text(), add_special_tokens=False)
                     + tok.encode((text / "sub" / "b.py").read_text(), add_special_tokens=False))
    ids = json.loads(out.read_text())
    assert ids[:5] == sorted(counts, key=lambda t: (-counts[t], t))[:5]
    assert ids[5:] == [t for t in tok.eos_token_ids if t not in ids[:5]] and len(ids) > 5
    with pytest.raises(SystemExit, match="neither a file nor a directory"):
        main(["token-map", str(tmp_path / "missing"), "--out", str(out)])


def test_eagle_drafts_only_the_map_s_tokens_and_greedy_output_is_unchanged(tmp_path: Path) -> None:
    """A map counted from standard-library code (the default model's kind of text), 1,024 ids of
    its 8,192: every draft is in it, greedy output equals the output without speculation, and
    drafts are still accepted."""
    path = tmp_path / "map.json"
    assert main(["token-map", os.path.join(STDLIB, "json"), os.path.join(STDLIB, "email"), "--size", "1024",
                 "--out", str(path)]) == 0
    token_map = set(json.loads(path.read_text()))
    drafted: list[int] = []

    class Checked(EagleProposer):
        def propose(self, inputs: ProposerInputs) -> DraftProposal:
            proposal = super().propose(inputs)
            drafted.extend(t for d in proposal.draft_token_ids for t in d)
            return proposal

    class Plugin:
        @hookimpl
        def specloop_register_proposers(self, register) -> None:
            register("checked", Checked)

    prompts = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef main():"]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(TARGET, max_model_len=128).generate(prompts, params, use_tqdm=False)]
    spec = {"method": "checked", "num_speculative_tokens": 3, "model": str(SHIPPED / "specloop-tiny-eagle"),
            "token_map": str(path)}
    llm = LLM(TARGET, max_model_len=128, speculative_config=spec, plugins=PluginManager([Plugin()],
                                                                                         load_entrypoints=False))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    assert drafted and set(drafted) <= token_map
    m = llm.get_metrics()
    print(f"acceptance with a 1,024-token map: {m['spec_acceptance_rate']:.3f}, mean length "
          f"{m['spec_mean_acceptance_length']:.2f}")
    assert m["spec_mean_acceptance_length"] > 1.5
