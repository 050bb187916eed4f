"""``specloop token-map``: a draft vocabulary counted from local text.

The ``size`` tokens the model's tokenizer produces most often over the given files (directories:
every file under them), most frequent first, ties to the lower id, plus the model's EOS ids (a
draft of the end of a sequence is as acceptable as any other) as a JSON list: the
``speculative_config["token_map"]`` of a proposer that drafts through the target's head
(``proposers.draft_vocab``). Count it on text like what the server will generate: a map counted on
code accepts fewer drafts on prose.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import Counter
from typing import Iterable

from .tokenizer import Tokenizer


def text_files(paths: Iterable[str]) -> list[str]:
    """Each path that is a file, and every file under each directory, sorted within a directory."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            out += sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names)
        elif os.path.isfile(path):
            out.append(path)
        else:
            raise ValueError(f"{path!r} is neither a file nor a directory")
    if not out:
        raise ValueError("no text files to count tokens in")
    return out


def count_token_map(tokenizer: Tokenizer, files: list[str], size: int) -> tuple[list[int], Counter[int], list[str]]:
    """The map (most frequent first, then the EOS ids it lacks), every token's count, and the files
    skipped for not being UTF-8 text."""
    if size < 1:
        raise ValueError(f"the token map's size must be positive, got {size}")
    counts: Counter[int] = Counter()
    skipped = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            skipped.append(path)
            continue
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return ranked + [t for t in tokenizer.eos_token_ids if t not in ranked], counts, skipped


def run_token_map(args: argparse.Namespace) -> int:
    from .model_path import resolve_model

    model = resolve_model(args.model_path)
    tokenizer = Tokenizer(model)
    try:
        files = text_files(args.text)
    except ValueError as e:
        raise SystemExit(f"specloop token-map: {e}") from None
    ids, counts, skipped = count_token_map(tokenizer, files, args.size)
    if not counts:
        raise SystemExit("specloop token-map: no UTF-8 text in the given files")
    with open(args.out, "w") as f:
        json.dump(ids, f)
    total = sum(counts.values())
    covered = sum(counts[t] for t in ids)
    print(f"{args.out}: {len(ids)} token ids of {len(counts)} seen ({tokenizer.vocab_size} in the vocabulary); "
          f"they are {covered / total:.1%} of the {total} tokens of {len(files) - len(skipped)} file(s)"
          + (f"; skipped {len(skipped)} file(s) not UTF-8 text" if skipped else ""))
    return 0

