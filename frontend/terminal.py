"""``specloop generate``: run prompts through an ``AsyncEngine`` and stream the text to the terminal.

All prompts are submitted at once (they batch); the first streams live, the others are buffered
and printed, then streamed, in order as the ones before them finish.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any, Callable, Coroutine, TextIO

from specloop.kernel.sampling_params import SamplingParams

from .async_engine import AsyncEngine


def run_generate(args: argparse.Namespace, engine_args: dict[str, Any], out: TextIO | None = None) -> int:
    """Generate for ``args.prompts`` (the ``generate`` flags on ``args``; ``engine_args`` are the
    engine's :class:`~specloop.kernel.config.EngineConfig` keyword arguments). Returns the exit status."""
    out = out or sys.stdout
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sampling_seed)
        engine = AsyncEngine.from_engine_args(args.model_path, **engine_args)
    except (ValueError, OSError) as e:
        print(f"specloop generate: error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(_generate_all(engine, args.prompts, params, args.chat, out))
    except ValueError as e:
        print(f"specloop generate: error: {e}", file=sys.stderr)
        return 2


def _run(main: Coroutine[Any, Any, int]) -> int:
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main)


async def _generate_all(engine: AsyncEngine, prompts: list[str], params: SamplingParams, chat: bool,
                        out: TextIO) -> int:
    inputs: list[Any] = []
    for prompt in prompts:
        if chat:
            if engine.tokenizer is None:
                raise ValueError("--chat needs a tokenizer")
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            inputs.append({"prompt": text, "prompt_token_ids": engine.encode(text, add_special_tokens=False)})
        else:
            inputs.append(prompt)
    for prompt in inputs:  # every prompt checked before any is submitted
        _, ids = engine.processor.parse(prompt)
        engine.validate(ids, params)
    # One buffer per prompt; the printer streams the current one and drains the rest in order.
    buffers: list[list[str]] = [[] for _ in prompts]
    done = [asyncio.Event() for _ in prompts]
    changed = asyncio.Event()
    num_tokens = 0

    async def consume(i: int) -> None:
        nonlocal num_tokens
        try:
            async for output in engine.generate(inputs[i], params, f"cli-{i}", delta=True):
                completion = output.outputs[0]
                buffers[i].append(completion.text)
                num_tokens += len(completion.token_ids)
                changed.set()
        finally:
            done[i].set()
            changed.set()

    start = time.perf_counter()
    tasks = [asyncio.create_task(consume(i)) for i in range(len(prompts))]
    try:
        for i, prompt in enumerate(prompts):
            out.write(("\n" if i else "") + (f"> {prompt}\n" if chat else prompt))
            out.flush()
            while True:
                while buffers[i]:
                    out.write(buffers[i].pop(0))
                out.flush()
                if done[i].is_set() and not buffers[i]:
                    break
                changed.clear()
                await changed.wait()
            out.write("\n")
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await engine.shutdown()
    elapsed = time.perf_counter() - start
    print(f"[{len(prompts)} prompt(s), {num_tokens} tokens in {elapsed:.2f}s, {num_tokens / elapsed:.1f} tok/s]",
          file=sys.stderr)
    return 0
