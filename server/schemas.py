"""JSON schemas a request carries (a `response_format`'s, a tool's parameters): bounded in
depth, since the server walks and rebuilds them, and in what the engine's grammar compiler
pays for (`length_bounds`)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator

MAX_SCHEMA_DEPTH = 100  # JSON levels of a schema the server walks (tools' rebuild them)
# Strings bounded in length (minLength, maxLength, or a pattern's {m,n}) that one request's
# schemas may hold, all of them together. vLLM compiles a request's schema into a grammar
# (xgrammar) on a pool of (cores + 1) // 2 threads, one on 2 cores, and a compile once started
# runs to its end: each bounded string costs it 0.4 s (a bound of 32) to 3 s (a bound of 512
# or more) on this host, and every structured request behind it waits. 16 of them: under a
# minute of compile at worst, against hours for a 256 KiB body of them.
MAX_SCHEMA_LENGTH_BOUNDS = 16
# an escape (skipped: `\{` is a brace, `\\{` a backslash before a quantifier) or a `{m,n}`
_QUANTIFIER = re.compile(r"\\.|(\{\s*\d+\s*(?:,\s*\d*\s*)?\})", re.S)


def check_schema_depth(schema: Any) -> Any:
    """`schema`, unless it nests deeper than `MAX_SCHEMA_DEPTH` JSON levels (ValueError).
    Measured without recursion."""
    level: list[Any] = [schema]
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        level = [v for node in level if isinstance(node, (dict, list))
                 for v in (node.values() if isinstance(node, dict) else node)]
        if not level:
            return schema
    raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")


SchemaObject = Annotated[dict[str, Any], AfterValidator(check_schema_depth)]


# JSON values, not schemas, under these keywords
SCHEMA_VALUES = frozenset({"const", "enum", "default", "examples"})
# schemas by name (the names are not keywords: a property may be called "enum")
NAMED_SCHEMAS = frozenset({"properties", "patternProperties", "$defs", "definitions",
                           "dependentSchemas"})


def length_bounds(*schemas: Any) -> int:
    """Strings bounded in length in `schemas`: nodes with minLength or maxLength, and the
    `{m,n}` repetitions of patterns (`patternProperties`' too). Values are walked as if they
    were schemas (a `$ref` may point into a `default`, which the compiler then takes for
    one), property names are not. Walked without recursion (depth is bounded)."""
    count = 0
    stack: list[tuple[Any, bool]] = [(schema, True) for schema in schemas]
    while stack:
        node, is_schema = stack.pop()
        if isinstance(node, list):
            stack.extend((item, is_schema) for item in node)
        elif isinstance(node, dict) and not is_schema:  # names -> schemas
            stack.extend((value, True) for value in node.values())
        elif isinstance(node, dict):
            count += "minLength" in node or "maxLength" in node
            patterns = [node.get("pattern")]
            if isinstance(node.get("patternProperties"), dict):
                patterns += list(node["patternProperties"])
            count += sum(_quantifiers(p) for p in patterns if isinstance(p, str))
            stack.extend((value, key not in NAMED_SCHEMAS) for key, value in node.items())
    return count


def _quantifiers(pattern: str) -> int:
    return sum(1 for match in _QUANTIFIER.finditer(pattern) if match.group(1))
