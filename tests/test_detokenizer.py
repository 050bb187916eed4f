import random

import pytest
from tokenizer_helpers import build_tokenizer

from specloop.frontend.detokenizer import IncrementalDetokenizer
from specloop.frontend.tokenizer import Tokenizer
from specloop.kernel import SamplingParams

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(build_tokenizer(str(tmp_path_factory.mktemp("tok"))))


def stream(tok, prompt_ids, out_ids, params=None, step=1, stop_terminated=False):
    """Feed ``out_ids`` ``step`` tokens at a time; returns (deltas, detokenizer, tokens consumed)."""
    detok = IncrementalDetokenizer(tok, prompt_ids, params or SamplingParams())
    deltas, consumed = [], 0
    for i in range(0, len(out_ids), step):
        chunk = out_ids[i:i + step]
        last = i + step >= len(out_ids)
        n = detok.update(chunk, stop_terminated=stop_terminated and last)
        deltas.append(detok.take_delta())
        if n is not None:
            consumed += n
            break
        consumed += len(chunk)
    detok.finish()
    deltas.append(detok.take_delta())
    return deltas, detok, consumed


def split_points(tok, ids):
    """Indices k where ids[:k] ends in the middle of a character."""
    return [k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(REPLACEMENT)]


@pytest.mark.parametrize("text", ["Emoji test: 😀 🎉 🚀 👍🏽 and 👨‍👩‍👧", "你好，世界！今天天气很好。",
                                  "mixed 日本語 and 😀 with ascii"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_multibyte_characters_split_across_tokens(tok, text, step):
    prompt = tok.encode("Hello")
    out = tok.encode(text, add_special_tokens=False)
    assert split_points(tok, out), "the test text must split some character across tokens"
    deltas, detok, _ = stream(tok, prompt, out, step=step)
    assert "".join(deltas) == text == detok.text
    assert all(REPLACEMENT not in d for d in deltas)


def test_random_tokens_concatenate_to_full_decode(tok):
    rng = random.Random(0)
    prompt = tok.encode("Hi there")
    for _ in range(50):
        out = [rng.randrange(5, tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        deltas, detok, _ = stream(tok, prompt, out, step=rng.choice([1, 2, 4]))
        assert "".join(deltas) == tok.decode(out) == detok.text
    # Random prompts too, which often end mid-character: the output is the full decode minus the
    # prompt's own text.
    for _ in range(200):
        prompt = [rng.randrange(0, tok.vocab_size) for _ in range(rng.randrange(1, 10))]
        out = [rng.randrange(0, tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        joined = "".join(stream(tok, prompt, out, step=rng.choice([1, 3]))[0])
        full = tok.decode(prompt + out)
        rest = full[:len(full) - len(joined)]
        assert full.endswith(joined) and tok.decode(prompt).startswith(rest)
        # At most the prompt's broken tail goes to the output (completed there).
        assert rest.rstrip(REPLACEMENT) == tok.decode(prompt).rstrip(REPLACEMENT)


def test_prompt_ending_mid_character(tok):
    ids = tok.encode("Look: 😀🎉 done", add_special_tokens=False)
    cuts = split_points(tok, ids)
    assert cuts
    for k in cuts:
        prompt, out = ids[:k], ids[k:]
        deltas, _, _ = stream(tok, prompt, out)
        full, joined = "Look: 😀🎉 done", "".join(deltas)
        # The character split across the boundary belongs to the output, whole: nothing is lost,
        # nothing is broken, and the rest is the prompt's own text.
        assert full.endswith(joined) and REPLACEMENT not in joined
        assert tok.decode(prompt).startswith(full[:len(full) - len(joined)])
        assert REPLACEMENT not in full[:len(full) - len(joined)]
        # An output that does not complete the character: the broken tail stays the prompt's.
        out = tok.encode(" Hello 你好", add_special_tokens=False)
        deltas, _, _ = stream(tok, prompt, out)
        assert "".join(deltas) == " Hello 你好"
        assert tok.decode(prompt) + "".join(deltas) == tok.decode(prompt + out)


def test_stop_string_spanning_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog."
    out = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([t]) for t in out]
    # A stop string that starts inside one token and ends inside a later one.
    i = next(i for i, p in enumerate(pieces) if len(p) >= 3 and i + 1 < len(pieces))
    start = sum(len(p) for p in pieces[:i]) + 1
    stop = text[start:start + len(pieces[i]) + 1]
    params = SamplingParams(stop=[stop])
    deltas, detok, consumed = stream(tok, tok.encode("x"), out, params)
    assert detok.stop_reason == stop
    assert "".join(deltas) == detok.text == text[:start]
    # Consumed up to and including the token that completed the stop string (a later one).
    ends = [sum(len(p) for p in pieces[:j + 1]) for j in range(len(pieces))]
    completing = next(j for j, end in enumerate(ends) if end >= start + len(stop))
    assert completing > i and consumed == completing + 1
    incl = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    deltas, detok, _ = stream(tok, tok.encode("x"), out, incl)
    assert "".join(deltas) == text[:start + len(stop)]


def test_stop_prefix_is_held_back_then_released(tok):
    out = tok.encode("Hello world", add_special_tokens=False)
    params = SamplingParams(stop=["worldwide", "lo x"])
    detok = IncrementalDetokenizer(tok, tok.encode("x"), params)
    seen = ""
    for t in out:
        assert detok.update([t]) is None
        seen += detok.take_delta()
        held = detok.output_text[len(seen):]
        # What is held back is a tail that could still grow into a stop string, and the longest one.
        assert detok.output_text.startswith(seen)
        assert held == "" or any(s.startswith(held) for s in params.stop)
        assert not seen or not any(s.startswith(detok.output_text[len(seen) - 1:]) for s in params.stop)
    assert seen == "Hello "  # "world" could still become "worldwide"
    detok.finish()
    assert seen + detok.take_delta() == "Hello world"
    assert detok.stop_reason is None


def test_earliest_stop_string_wins_and_min_tokens(tok):
    out = tok.encode("one two three four", add_special_tokens=False)
    _, detok, _ = stream(tok, [5], out, SamplingParams(stop=["four", "two"]))
    assert detok.stop_reason == "two" and detok.text == "one "
    # Stop strings are not checked before min_tokens tokens are out.
    n_before_two = len(tok.encode("one two", add_special_tokens=False))
    _, detok, _ = stream(tok, [5], out, SamplingParams(stop=["two", "four"], min_tokens=n_before_two, max_tokens=99))
    assert detok.stop_reason == "four" and detok.text == "one two three "


def test_stop_token_text_excluded_unless_asked(tok):
    out = tok.encode("Hello", add_special_tokens=False) + tok.encode(" world", add_special_tokens=False)[:1]
    last = tok.decode(out[-1:])
    _, detok, _ = stream(tok, [5], out, SamplingParams(), stop_terminated=True)
    assert detok.text == tok.decode(out[:-1])
    _, detok, _ = stream(tok, [5], out, SamplingParams(include_stop_str_in_output=True), stop_terminated=True)
    assert detok.text == tok.decode(out[:-1]) + last


def test_special_tokens_skipped_or_kept(tok):
    eos = tok.eos_token_id
    out = tok.encode("Hi", add_special_tokens=False) + [eos] + tok.encode(" there", add_special_tokens=False)
    _, detok, _ = stream(tok, [5], out)
    assert detok.text == "Hi there"
    _, detok, _ = stream(tok, [5], out, SamplingParams(skip_special_tokens=False))
    assert detok.text == "Hi<|eos|> there"


def test_stop_string_inside_text_held_until_the_end(tok):
    from specloop.frontend.output_processor import CompletionTracker
    from specloop.kernel import EngineCoreOutput, FinishReason, Request

    # A token carrying a space plus the first bytes of an emoji: its text stays held (broken UTF-8).
    broken = next(t for t in range(5, tok.vocab_size)
                  if tok.decode([t]).startswith(" ") and tok.decode([t]).endswith(REPLACEMENT))
    out = tok.encode("Hello", add_special_tokens=False) + [broken]
    params = SamplingParams(stop=["o "], max_tokens=len(out))
    detok = IncrementalDetokenizer(tok, [5], params)
    assert detok.update(out) is None and detok.stop_reason is None
    detok.finish()
    assert detok.stop_reason == "o " and detok.text == "Hell"
    # The request ended by length in the core, but the stop string decides what is reported.
    state = CompletionTracker(0, Request("r", [5], params), tok)
    state.process(EngineCoreOutput("r", out, finish_reason=FinishReason.LENGTH))
    assert state.finish_reason == "stop" and state.stop_reason == "o " and state.detokenizer.text == "Hell"


def reference_stop(text, old_len, stops):
    """The stop-string rule by its definition: among the stop strings that end in the new text, the
    one that starts earliest (ties: the first listed)."""
    found = [(text.find(s, max(0, old_len - len(s) + 1)), i) for i, s in enumerate(stops)]
    found = [f for f in found if f[0] >= 0]
    return min(found) if found else None


@pytest.mark.parametrize("seed", range(6))
def test_stop_matching_follows_its_definition(tok, seed):
    """Random stop sets over a small alphabet (overlapping prefixes, stops inside stops), random
    token streams, min_tokens and include_stop_str_in_output: the completion stops exactly where the
    definition says, and what is released always stops before the longest tail that could still
    grow into a stop string."""
    rng = random.Random(seed)
    alphabet = "ab c"
    vocab = [t for t in range(tok.vocab_size) if tok.decode([t]) and set(tok.decode([t])) <= set(alphabet)]
    for _ in range(40):
        stops = list(dict.fromkeys("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
                                   for _ in range(rng.randint(1, 5))))
        params = SamplingParams(stop=stops, min_tokens=rng.choice([0, 0, 3]), max_tokens=99,
                                include_stop_str_in_output=rng.random() < 0.3)
        detok = IncrementalDetokenizer(tok, [5], params)
        text = ""
        for n, token in enumerate(rng.choice(vocab) for _ in range(30)):
            old_len, text = len(text), text + tok.decode([token])
            want = reference_stop(text, old_len, stops) if n + 1 > params.min_tokens else None
            if detok.update([token]) is not None:
                at, i = want
                assert detok.stop_reason == stops[i]
                assert detok.text == text[:at + len(stops[i]) if params.include_stop_str_in_output else at]
                break
            assert want is None and detok.output_text == text, (stops, text)
            if not params.include_stop_str_in_output:
                held = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                            if text.endswith(s[:k])), default=0)
                assert detok.text == text[:len(text) - held]


def test_stop_matching_cost_does_not_grow_with_stop_length(tok):
    """Each stop string's every prefix was tried for every token: 64 stop strings of 20,000
    characters took 190 s for what 200-character ones did in 8. Now the work per character of output
    is the same whatever their length (timed against 100x shorter stop strings, best of three)."""
    import time

    rng = random.Random(0)
    ids = tok.encode("".join(rng.choice("ab ") for _ in range(3000)), add_special_tokens=False)

    def seconds(length):
        stops = [("ab" * length)[:length - 1] + chr(0x4E00 + i) for i in range(8)]
        params = SamplingParams(stop=stops, max_tokens=len(ids))
        best = float("inf")
        for _ in range(3):
            detok = IncrementalDetokenizer(tok, [5], params)
            start = time.perf_counter()
            for t in ids:
                assert detok.update([t]) is None
            best = min(best, time.perf_counter() - start)
        return best

    short, long = seconds(200), seconds(20_000)
    assert long < 3 * short + 0.05, (short, long)
