"""JSON schemas a request carries (a `response_format`'s, a tool's parameters): bounded in
depth, since the server walks and rebuilds them."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator

MAX_SCHEMA_DEPTH = 100  # JSON levels of a schema the server walks (tools' rebuild them)


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
