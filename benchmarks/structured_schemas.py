"""The JSON schemas the structured-output benchmarks (and the grammar-engine comparison) run, each
with one instance that satisfies it. They cover what API users send: bounded strings, enums,
integer and number ranges, bounded arrays, nesting, optional and nullable fields, ``$ref``,
``anyOf``, formats, patterns, recursion and a large enum."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "person": ({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36}),
    "enum": ({"type": "object", "properties": {"status": {"enum": ["active", "inactive", "banned"]}},
              "required": ["status"]}, {"status": "active"}),
    "tags": ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                         "maxItems": 3}},
              "required": ["tags"]}, {"tags": ["a", "bc"]}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "address": {"type": "object", "properties": {
                                                      "city": {"type": "string"}, "zip": {"type": "string"}},
                                                      "required": ["city"]}},
                 "required": ["id", "address"]}}, "required": ["user"]},
        {"user": {"id": 7, "address": {"city": "Paris", "zip": "75001"}}}),
    "number_range": ({"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
                      "required": ["score"]}, {"score": 0.25}),
    "nullable": ({"type": "object", "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"]},
                 {"note": None}),
    "any_of": ({"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string",
                                                                                            "maxLength": 5}]}},
                "required": ["value"]}, {"value": "abc"}),
    "refs": ({"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                                  "required": ["x", "y"]}},
              "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
              "required": ["a", "b"]}, {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}}),
    "pattern": ({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                 "required": ["code"]}, {"code": "ABC-123"}),
    "format": ({"type": "object", "properties": {"when": {"type": "string", "format": "date-time"},
                                                 "id": {"type": "string", "format": "uuid"}},
                "required": ["when", "id"]},
               {"when": "2024-01-02T03:04:05Z", "id": "123e4567-e89b-12d3-a456-426614174000"}),
    "const": ({"type": "object", "properties": {"kind": {"const": "event"}, "n": {"type": "integer"}},
               "required": ["kind", "n"]}, {"kind": "event", "n": 3}),
    "objects_array": ({"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["sku", "qty"], "additionalProperties": False}},
        [{"sku": "A1", "qty": 2}, {"sku": "B2", "qty": 10}]),
    "recursive": ({"$defs": {"node": {"type": "object", "properties": {
        "name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["name"]}}, "$ref": "#/$defs/node"},
        {"name": "root", "children": [{"name": "leaf"}]}),
    "big_enum": ({"type": "object", "properties": {"city": {"enum": [f"city-{i:03d}" for i in range(200)]}},
                  "required": ["city"]}, {"city": "city-123"}),
    "all_of": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                          {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
               {"a": 1, "b": True}),
    "tool_arguments": ({"type": "object", "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["location", "unit"]}, {"location": "Oslo, Norway", "unit": "celsius", "days": 3}),
    "min_max_length": ({"type": "object", "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
                        "required": ["s"]}, {"s": "abc"}),
    "unique_items": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}, [1, 2]),
    "dependent": ({"type": "object", "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
                   "dependentRequired": {"card": ["billing"]}}, {"card": "x", "billing": "y"}),
    "free_object": ({"type": "object"}, {"k": [1, {"v": None}]}),
}
