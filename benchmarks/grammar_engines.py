"""Compare grammar engines for structured outputs: llguidance and xgrammar on the schema set of
``structured_schemas.py``, with one tokenizer.

Per engine and schema: compile time (cold, no cache), whether the schema compiles and its instance
is accepted token by token, and the time to compute the next-token bitmask at every position of the
instance (mean and max). Runs on a CPU; neither engine uses the GPU for masks.

    python benchmarks/grammar_engines.py [--tokenizer DIR] [--train-vocab 65536]

``--train-vocab N`` trains a byte-level BPE of N tokens on Python sources first (larger vocabularies
cost more per mask; the default model's has 8192). xgrammar needs ``transformers`` to read a
tokenizer; both engines are optional imports here.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from structured_schemas import SCHEMAS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train_tokenizer(vocab: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "**", "*.py"), recursive=True))[:2000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Ids 0-2 special, as the random checkpoints' BOS (1) and EOS (2) must be.
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    def texts() -> Any:
        for path in files:
            with open(path, encoding="utf-8", errors="ignore") as f:
                yield f.read()

    tok.train_from_iterator(texts(), trainer)
    path = tempfile.mkdtemp(prefix="grammar-bench-tok-")
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return path


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer_dir: str, eos: int) -> None:
        import llguidance
        import llguidance.torch

        self.ll = llguidance
        self.llt = llguidance.torch
        with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
            self.tokenizer = llguidance.LLTokenizer(f.read(), eos_token=eos)
        self.vocab = self.tokenizer.vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        matcher = self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(self, matcher: Any, tokens: list[int], mask: Any) -> list[float]:
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            self.llt.fill_next_token_bitmask(matcher, mask, 0)
            times.append(time.perf_counter() - t0)
            if not matcher.consume_token(t):
                raise ValueError(f"token {t} refused: {matcher.get_error()}")
        return times

    def mask(self) -> Any:
        return self.llt.allocate_token_bitmask(1, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer_dir: str, eos: int) -> None:
        import transformers
        import xgrammar

        self.xgr = xgrammar
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(tokenizer_dir, "tokenizer.json"))
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
        self.vocab = self.info.vocab_size

    def compile(self, schema: dict[str, Any]) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema))

    def walk(self, matcher: Any, tokens: list[int], mask: Any) -> list[float]:
        times = []
        for t in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            if not matcher.accept_token(t):
                raise ValueError(f"token {t} refused")
        return times

    def mask(self) -> Any:
        return self.xgr.allocate_token_bitmask(1, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=os.path.join(ROOT, "default_models", "specloop-tiny"))
    parser.add_argument("--train-vocab", type=int, default=0)
    parser.add_argument("--engines", default="llguidance,xgrammar")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    tokenizer_dir = train_tokenizer(args.train_vocab) if args.train_vocab else args.tokenizer
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    eos = 0
    print(f"tokenizer {tokenizer_dir} vocab {tok.get_vocab_size()}; {len(SCHEMAS)} schemas")
    results: dict[str, Any] = {"vocab": tok.get_vocab_size(), "engines": {}}
    for name in args.engines.split(","):
        try:
            engine = LLGuidance(tokenizer_dir, eos) if name == "llguidance" else XGrammar(tokenizer_dir, eos)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            continue
        t0 = time.perf_counter()
        engine.compile({"type": "object"})  # warm-up: lazy tables, thread pools
        warm = time.perf_counter() - t0
        compile_ms, mask_us, warm_us, first_request_ms, supported, failures = [], [], [], [], 0, {}
        for key, (schema, instance) in SCHEMAS.items():
            tokens = tok.encode(json.dumps(instance), add_special_tokens=False).ids + [eos]
            try:
                t0 = time.perf_counter()
                template = engine.compile(schema)
                matcher = engine.matcher(template)
                compile_ms.append(1e3 * (time.perf_counter() - t0))
                times = engine.walk(matcher, tokens, engine.mask())
                mask_us.extend(1e6 * t for t in times)
                first_request_ms.append(compile_ms[-1] + 1e3 * sum(times))
                # The same schema again, from the cached compiled grammar (what a server sees).
                warm_us.extend(1e6 * t for t in engine.walk(engine.matcher(template), tokens, engine.mask()))
                supported += 1
            except Exception as e:  # an unsupported keyword, or the instance refused
                failures[key] = f"{type(e).__name__}: {str(e)[:120]}"
        r = {"first_compile_ms": 1e3 * warm, "supported": supported, "of": len(SCHEMAS), "failures": failures,
             "compile_ms_median": statistics.median(compile_ms) if compile_ms else None,
             "compile_ms_max": max(compile_ms) if compile_ms else None,
             "mask_us_mean": statistics.fmean(mask_us) if mask_us else None,
             "mask_us_p99": sorted(mask_us)[int(0.99 * (len(mask_us) - 1))] if mask_us else None,
             "mask_us_max": max(mask_us) if mask_us else None,
             "first_request_ms_median": statistics.median(first_request_ms) if first_request_ms else None,
             "first_request_ms_max": max(first_request_ms) if first_request_ms else None,
             "cached_mask_us_mean": statistics.fmean(warm_us) if warm_us else None,
             "cached_mask_us_p99": sorted(warm_us)[int(0.99 * (len(warm_us) - 1))] if warm_us else None}
        results["engines"][name] = r
        print(f"{name}: {supported}/{len(SCHEMAS)} schemas; compile median {r['compile_ms_median']:.2f} ms, "
              f"max {r['compile_ms_max']:.2f} ms (first {r['first_compile_ms']:.1f} ms); mask mean "
              f"{r['mask_us_mean']:.1f} us, p99 {r['mask_us_p99']:.1f} us, max {r['mask_us_max']:.1f} us; "
              f"compile + every mask of one request median {r['first_request_ms_median']:.2f} ms, max "
              f"{r['first_request_ms_max']:.2f} ms; masks from a cached grammar mean {r['cached_mask_us_mean']:.1f} "
              f"us, p99 {r['cached_mask_us_p99']:.1f} us")
        for key, why in failures.items():
            print(f"  {key}: {why}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
