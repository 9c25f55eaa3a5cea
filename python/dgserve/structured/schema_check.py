"""What can be judged of a JSON schema before any token is generated beyond its size and depth (which the one
reader of a client's JSON bounds, ``dgserve.text.client_json``): whether it admits a finite document at all
(docs/structured-output.md, "Bounds").

A self-recursive schema such as ``{"type": "array", "minItems": 1, "items": {"$ref": "#"}}``, an object whose
required property refers back to the object, or ``$defs`` that refer to each other in a ring, admit no finite JSON
document: every document would have to contain itself. A grammar engine given such a schema either accepts only
the empty output or runs into its own limits one token into the document. ``check_productive`` finds them with the
classic least-fixpoint "productive symbols" pass of grammar analysis: a subschema is productive when some finite
instance satisfies it given which of its subschemas are already known to be productive, iterated until nothing
changes. The pass is conservative: whatever it cannot judge (remote ``$ref``, keywords it does not model) counts
as productive, so it never rejects a schema that has finite documents; constraints that contradict each other
(``minimum`` above ``maximum``, incompatible types) are the grammar compiler's to reject.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_SCHEMA_DEPTH = 64  # nesting of JSON values in a schema (read_schema); real schemas stay well below 20

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_VALUES = ("items", "additionalProperties", "not", "contains", "if", "then", "else", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def check_productive(schema: object, field: str = "response_format") -> None:
    """ValueError naming ``field`` when ``schema`` admits no finite JSON document (see the module doc)."""
    nodes = _subschemas(schema)
    productive: set[int] = set()
    changed = True
    while changed:  # least fixpoint: at most one pass per node
        changed = False
        for node in nodes.values():
            if id(node) not in productive and _productive(node, schema, productive):
                productive.add(id(node))
                changed = True
    if id(schema) not in productive:
        raise ValueError(
            f"{field}: the schema admits no finite JSON document (a required part refers back to itself, "
            "directly or through $ref; make the recursion optional, e.g. minItems 0 or a property not required)"
        )


def _subschemas(root: object) -> dict[int, object]:
    """Every subschema reachable from ``root`` through schema keywords, by id (refs are resolved when used)."""
    seen: dict[int, object] = {}
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, (dict, bool)):
            continue
        seen[id(node)] = node
        stack.extend(_children(node))
    return seen


def _children(node: object) -> Iterator[object]:
    if not isinstance(node, dict):
        return
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            yield from node[key].values()
    for key in _SUBSCHEMA_VALUES:
        if isinstance(node.get(key), (dict, bool)):
            yield node[key]
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            yield from node[key]


def _resolve(ref: object, root: object) -> object | None:
    """The subschema a local ``$ref`` (``#`` or a JSON pointer ``#/...``) names; None when it is not local or
    does not resolve (then it is not judged)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node = root
    for raw in ref[1:].split("/")[1:] if ref != "#" else []:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _productive(node: object, root: object, known: set[int]) -> bool:
    """Whether ``node`` has a finite instance, given the subschemas already ``known`` productive."""
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        return True  # not a schema: not judged

    def ok(sub: object) -> bool:
        if isinstance(sub, bool):
            return sub
        return not isinstance(sub, dict) or id(sub) in known

    if "$ref" in node:
        target = _resolve(node["$ref"], root)
        if target is not None and not ok(target):
            return False
    if isinstance(node.get("allOf"), list) and not all(ok(s) for s in node["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(ok(s) for s in node[key]):
            return False
    if "const" in node or "enum" in node:
        return True  # literal values (whether they also fit the rest is the compiler's to judge)
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    return any(_type_productive(t, node, ok) for t in types)


def _type_productive(t: object, node: dict, ok) -> bool:
    if t == "array":
        return _array_productive(node, ok)
    if t == "object":
        return _object_productive(node, ok)
    return True  # scalars, or no type given (a scalar instance may do)


def _array_productive(node: dict, ok) -> bool:
    need = node.get("minItems", 0)
    need = need if isinstance(need, int) and not isinstance(need, bool) else 0
    prefix: list = node["prefixItems"] if isinstance(node.get("prefixItems"), list) else []
    if not all(ok(s) for s in prefix[:need]):
        return False
    rest = node.get("items", True)
    return need <= len(prefix) or not isinstance(rest, (dict, bool)) or ok(rest)


def _object_productive(node: dict, ok) -> bool:
    required: list = node["required"] if isinstance(node.get("required"), list) else []
    props: dict = node["properties"] if isinstance(node.get("properties"), dict) else {}
    extra = node.get("additionalProperties", True)
    for name in required:
        sub = props.get(name, extra) if isinstance(name, str) else True
        if not ok(sub):
            return False
    return True
