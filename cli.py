"""``specloop`` command line: builds the parser for ``serve``, ``generate``, ``token-map`` and
``plugins`` and dispatches to the server's launcher, the frontend's terminal streaming or the
token-map counter.

Imports stay lazy so ``specloop --help`` never loads torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Sequence

from specloop.frontend.engine_args import add_engine_args, engine_kwargs


def _cmd_plugins(args: argparse.Namespace) -> int:
    from specloop.kernel.plugins import PluginManager

    pm = PluginManager(disable=args.disable_plugins)
    for kind, entries in pm.list_components().items():
        print(f"{kind}:")
        for e in entries:
            print(f"  {e.name:<28} {e.source}")
        if not entries:
            print("  (none)")
    return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 1-65535, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an integer in 1-65535, got {port}")
    return port


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specloop", description="specloop LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model over the OpenAI-compatible HTTP API")
    serve.add_argument("model_path", nargs="?", default=None,
                       help="local Hugging Face model directory (default: the embedded default model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--log-level", default="info")
    count, seconds = _positive(int), _positive(float)
    serve.add_argument("--max-body-bytes", type=count, default=None, help="largest request body (default 16 MiB)")
    serve.add_argument("--max-n", type=count, default=None, help="largest 'n' per request (default 16)")
    serve.add_argument("--max-prompts", type=count, default=None,
                       help="most prompts per completions request (default 64)")
    serve.add_argument("--max-prompt-tokens", type=count, default=None,
                       help="longest prompt in tokens (default: max_model_len - 1)")
    serve.add_argument("--max-stop-strings", type=count, default=None,
                       help="most different stop strings per request (default 64)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine core (scheduler, model, busy loop) in its own process, apart from "
                            "HTTP, tokenization and detokenization (default: on)")
    serve.add_argument("--max-stop-string-length", type=count, default=None,
                       help="longest stop string in characters (default 1024)")
    serve.add_argument("--max-messages", type=count, default=None, help="most messages per chat request (default 4096)")
    serve.add_argument("--request-header-timeout", type=seconds, default=None,
                       help="seconds a client has to send a request's head (default 10)")
    serve.add_argument("--request-body-timeout", type=seconds, default=None,
                       help="seconds a client has to send a request's body once its head is in (default 60)")
    serve.add_argument("--max-connections", type=count, default=None,
                       help="most open client connections (default: 3/4 of the open-file limit beyond 128)")
    add_engine_args(serve)

    gen = sub.add_parser("generate", help="generate text for prompts and stream it to the terminal")
    gen.add_argument("prompts", nargs="+")
    gen.add_argument("--model", dest="model_path", default=None,
                     help="local Hugging Face model directory (default: the embedded default model)")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_engine_args(gen)

    token_map = sub.add_parser("token-map", help="count a draft vocabulary (speculative_config's token_map) "
                               "from local text")
    token_map.add_argument("text", nargs="+", help="text files, or directories of them, to count tokens in")
    token_map.add_argument("--model", dest="model_path", default=None,
                           help="local Hugging Face model directory whose tokenizer counts (default: the embedded "
                                "default model)")
    token_map.add_argument("--size", type=_positive(int), default=32768, help="most frequent tokens kept "
                           "(default 32768), plus the model's EOS ids")
    token_map.add_argument("--out", required=True, help="the JSON file to write")

    plugins = sub.add_parser("plugins", help="list every registered component by kind")
    plugins.add_argument("--disable-plugin", action="append", default=[], dest="disable_plugins")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "plugins":
        return _cmd_plugins(args)
    if args.command == "token-map":
        from specloop.frontend.token_map import run_token_map

        return run_token_map(args)
    if os.environ.get("RANK", "0") != "0" and "WORLD_SIZE" in os.environ:
        # torchrun started this process as a tensor-parallel rank > 0: it serves rank 0's engine.
        from specloop.backends.distributed import run_torchrun_worker
        from specloop.kernel.config import EngineConfig

        return run_torchrun_worker(EngineConfig(**engine_kwargs(args)))
    if args.command == "generate":
        from specloop.frontend.terminal import run_generate

        return run_generate(args, engine_kwargs(args))
    from specloop.server.launcher import run_serve

    return run_serve(args, engine_kwargs(args))


if __name__ == "__main__":
    sys.exit(main())
