"""Validation of result documents against moe_ep/bench/schema.json.

A small JSON Schema subset, enough for that file and with no dependency: ``type`` (one or a
list), ``enum``, ``minimum``, ``required``, ``properties``, ``additionalProperties`` (bool or a
schema), ``items`` and local ``$ref`` (``#/$defs/...``).
"""
from __future__ import annotations

import json
import os
from typing import Any

SCHEMA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema.json")
_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def load_schema() -> dict:
    with open(SCHEMA_PATH) as f:
        return json.load(f)


def _is(value: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[t])


def validate(value: Any, schema: dict, root: dict, path: str = "$") -> list[str]:
    """Problems of ``value`` against ``schema`` (empty when it conforms), each naming its JSON path."""
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return validate(value, node, root, path)
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_is(value, t) for t in types):
            return [f"{path}: expected {' or '.join(types)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path}: expected one of {schema['enum']}, got {value!r}"]
    problems: list[str] = []
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        problems.append(f"{path}: expected >= {schema['minimum']}, got {value}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                problems.append(f"{path}: missing required key {key!r}")
        extra = schema.get("additionalProperties", True)
        for key, v in value.items():
            if key in props:
                problems += validate(v, props[key], root, f"{path}.{key}")
            elif extra is False:
                problems.append(f"{path}: unexpected key {key!r}")
            elif isinstance(extra, dict):
                problems += validate(v, extra, root, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            problems += validate(v, schema["items"], root, f"{path}[{i}]")
    return problems


def validate_document(doc: Any) -> list[str]:
    """Problems of a result document against moe_ep/bench/schema.json (empty when it conforms)."""
    schema = load_schema()
    return validate(doc, schema, schema)
