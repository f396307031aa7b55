"""Values made from a JSON schema, for structured output and tool-call arguments.

The simulated models answer a request for JSON by a schema (Ollama's `format`, OpenAI's
`response_format` `json_schema`, a tool's `parameters`) with a value valid against it, drawn from a
seeded generator so that the same seed gives the same value. What is read:

- `type` (a list of types: the first that is not "null"), `enum` (a drawn member), `const`;
- objects: every property in `properties`, required or not, each valid against its own schema;
  an object without `properties` is `{}`;
- strings: pseudo-words, between `minLength` and `maxLength`; `format` `date-time`, `date`, `time`,
  `email`, `uri`/`url` and `uuid` give values of that shape (`pattern` is not read);
- integers and numbers: within `minimum`/`maximum` (and the exclusive bounds), 0 to 100 without them;
  `multipleOf` is honoured for integers;
- booleans; `null`;
- arrays: `items` (or `prefixItems`) values, three of them unless `minItems`/`maxItems` say
  otherwise; `uniqueItems` is honoured for enums and strings by drawing distinct values where it can;
- `anyOf`/`oneOf`: the first alternative that is not `{"type": "null"}`; `allOf`: the alternatives'
  properties merged; `$ref` to `#/$defs/…` or `#/definitions/…` (recursion stops at depth 8 with the
  smallest value the schema allows).
"""

from __future__ import annotations

import random
import uuid
from typing import Any, Final

from sim.backends.text import LATIN_TOKENS

# Deeper than this, a recursive schema gets its smallest value (an empty object or array).
MAX_DEPTH: Final = 8
# An array without bounds gets this many items (the pipeline decomposer's three sub-prompts).
DEFAULT_ITEMS: Final = 3
# A string without bounds gets this many pseudo-words.
DEFAULT_WORDS: Final = 8


def schema_value(schema: object, rng: random.Random) -> Any:
    """A value valid against `schema` (a JSON schema as a dict; anything else: any string)."""
    root = schema if isinstance(schema, dict) else {}
    return _value(root, root, rng, 0)


def _resolve(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    ref = schema.get("$ref")
    seen = 0
    while isinstance(ref, str) and seen < MAX_DEPTH:
        target: Any = root
        for key in ref.removeprefix("#/").split("/") if ref.startswith("#/") else []:
            target = target.get(key, {}) if isinstance(target, dict) else {}
        schema = {
            **(target if isinstance(target, dict) else {}),
            **{k: v for k, v in schema.items() if k != "$ref"},
        }
        ref = schema.get("$ref") if schema.get("$ref") != ref else None
        seen += 1
    return schema


def _merge_all_of(schema: dict[str, Any], root: dict[str, Any]) -> dict[str, Any]:
    parts = schema.get("allOf")
    if not isinstance(parts, list):
        return schema
    merged: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
    for part in parts:
        if not isinstance(part, dict):
            continue
        part = _resolve(part, root)
        for key, value in part.items():
            if key == "properties" and isinstance(value, dict):
                merged["properties"] = {**merged.get("properties", {}), **value}
            elif key == "required" and isinstance(value, list):
                merged["required"] = [*merged.get("required", []), *value]
            else:
                merged.setdefault(key, value)
    return merged


def _type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if isinstance(kind, str):
        return kind
    if "properties" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def _value(schema: dict[str, Any], root: dict[str, Any], rng: random.Random, depth: int) -> Any:
    schema = _merge_all_of(_resolve(schema, root), root)
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return rng.choice(enum)
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list) and options:
            chosen = next(
                (o for o in options if isinstance(o, dict) and _resolve(o, root).get("type") != "null"),
                options[0],
            )
            return _value(chosen if isinstance(chosen, dict) else {}, root, rng, depth + 1)
    kind = _type_of(schema)
    if kind == "object":
        return _object(schema, root, rng, depth)
    if kind == "array":
        return _array(schema, root, rng, depth)
    if kind == "integer":
        return _integer(schema, rng)
    if kind == "number":
        return _number(schema, rng)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return _string(schema, rng)


def _object(schema: dict[str, Any], root: dict[str, Any], rng: random.Random, depth: int) -> dict[str, Any]:
    props = schema.get("properties")
    if not isinstance(props, dict):
        return {}
    listed = schema.get("required")
    required: list[Any] = listed if isinstance(listed, list) else []
    out: dict[str, Any] = {}
    for name, sub in props.items():
        if depth >= MAX_DEPTH and name not in required:
            continue
        out[name] = _value(sub if isinstance(sub, dict) else {}, root, rng, depth + 1)
    return out


def _array(schema: dict[str, Any], root: dict[str, Any], rng: random.Random, depth: int) -> list[Any]:
    low = int(schema.get("minItems", 0))
    high = schema.get("maxItems")
    count = (
        low
        if depth >= MAX_DEPTH
        else max(low, DEFAULT_ITEMS if high is None else min(int(high), DEFAULT_ITEMS))
    )
    listed = schema.get("prefixItems")
    prefix: list[Any] = listed if isinstance(listed, list) else []
    items = schema.get("items") if isinstance(schema.get("items"), dict) else {}
    out: list[Any] = []
    for i in range(max(count, len(prefix))):
        sub = prefix[i] if i < len(prefix) else items
        value = _value(sub if isinstance(sub, dict) else {}, root, rng, depth + 1)
        if schema.get("uniqueItems") and value in out:
            # Drawn again a few times; an enum smaller than the count gives what it has.
            for _ in range(8):
                value = _value(sub if isinstance(sub, dict) else {}, root, rng, depth + 1)
                if value not in out:
                    break
            else:
                if len(out) >= low:
                    break
        out.append(value)
    return out


def _integer(schema: dict[str, Any], rng: random.Random) -> int:
    low, high = _bounds(schema, integer=True)
    step = schema.get("multipleOf")
    if isinstance(step, int) and step > 0:
        first = -(-low // step) * step
        last = high // step * step
        if first <= last:
            return int(first + step * rng.randint(0, int((last - first) // step)))
    return rng.randint(int(low), int(high))


def _number(schema: dict[str, Any], rng: random.Random) -> float:
    low, high = _bounds(schema, integer=False)
    value = round(rng.uniform(low, high), 2)
    # Rounding may step over an exclusive bound or out of a narrow range.
    return value if low <= value <= high else float(low)


def _bounds(schema: dict[str, Any], *, integer: bool) -> tuple[float, float]:
    nudge = 1 if integer else 1e-6
    low = schema.get("minimum")
    high = schema.get("maximum")
    if isinstance(schema.get("exclusiveMinimum"), int | float):
        low = schema["exclusiveMinimum"] + nudge
    if isinstance(schema.get("exclusiveMaximum"), int | float):
        high = schema["exclusiveMaximum"] - nudge
    low = float(low) if isinstance(low, int | float) else None
    high = float(high) if isinstance(high, int | float) else None
    if low is None and high is None:
        low, high = 0.0, 100.0
    elif low is None:
        low = min(0.0, high - 100.0) if high is not None else 0.0
    elif high is None:
        high = low + 100.0
    assert low is not None and high is not None
    if integer:
        low, high = float(-(-low // 1)), float(high // 1)
    return low, max(low, high)


def _string(schema: dict[str, Any], rng: random.Random) -> str:
    fmt = schema.get("format")
    if fmt == "date-time":
        day = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        return f"{day}T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z"
    if fmt == "date":
        return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if fmt == "time":
        return f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00"
    if fmt == "email":
        return f"{_word(rng)}@{_word(rng)}.example"
    if fmt in ("uri", "url"):
        return f"https://{_word(rng)}.example/{_word(rng)}"
    if fmt == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    text = " ".join(_word(rng) for _ in range(DEFAULT_WORDS))
    while len(text) < low:
        text += " " + _word(rng)
    if isinstance(high, int):
        text = text[:high].rstrip() if len(text[:high].rstrip()) >= low else text[:high]
    return text


def _word(rng: random.Random) -> str:
    while True:
        token = rng.choice(LATIN_TOKENS).strip()
        if token.isalpha():
            return token
