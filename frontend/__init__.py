"""The frontend: tokenizer, incremental detokenizer and stop strings, output processing, the offline
``LLM`` and the streaming ``AsyncEngine``, and ``specloop generate``. Modules import lazily from the
package root (``from specloop import LLM, AsyncEngine``) so the CLI starts without loading torch."""
