"""A request body as JSON: bounded before it is parsed, integers kept exact."""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

from .errors import BadRequest, PayloadTooLarge

# A JSON parser takes ~0.03 us per number and ~1 us per object, holding the GIL: beyond these counts
# (each an upper bound computed from the bytes, strings included) a body is refused unparsed.
MAX_JSON_VALUES = 500_000
# Bodies this small cannot hold enough of anything to be worth counting.
_COUNT_FROM_BYTES = 256 * 1024
# Maps every digit to "0" and everything else to " ", to find runs of digits at C speed.
_DIGITS = bytes(ord("0") if chr(c).isdigit() and c < 128 else ord(" ") for c in range(256))
_LONG_INTEGER = b"0" * 19  # as many digits as the largest 64-bit integers


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text} is out of range")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(body: bytes, max_objects: int = 65_536) -> dict[str, Any]:
    """A request body as a JSON object.

    Integers keep every digit (orjson turns those past 64 bits into floats, so a body with such a
    literal goes through the standard library's parser instead); NaN and infinities are refused.

    :param max_objects: most ``{`` a large body may hold (an upper bound on its objects).
    :raises PayloadTooLarge: the body could hold more than ``max_objects`` objects or
        :data:`MAX_JSON_VALUES` values.
    """
    if len(body) > _COUNT_FROM_BYTES:
        objects = body.count(b"{")
        values = objects + body.count(b"[") + body.count(b",")
        if objects > max_objects or values > MAX_JSON_VALUES:
            raise PayloadTooLarge(f"The request body holds up to {objects} JSON objects and {values} values; this "
                                  f"server parses at most {max_objects} objects and {MAX_JSON_VALUES} values.")
    try:
        if _LONG_INTEGER in body.translate(_DIGITS):
            data = json.loads(body, parse_float=_finite, parse_constant=_no_constant)
        else:
            data = orjson.loads(body)
    except (orjson.JSONDecodeError, ValueError, RecursionError) as e:
        raise BadRequest(f"The request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest(f"The request body must be a JSON object, got {type(data).__name__}.")
    return data
