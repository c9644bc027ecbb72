"""A route's JSON body in /openapi.json, for routes that parse their body themselves (so that a body FastAPI would
refuse is answered in the route's own error shape, or in its turn) and so would be documented as a bare object."""

from pydantic import BaseModel


def json_body(model: type[BaseModel]) -> dict:
    """The route's `openapi_extra`: `model` as its JSON body, definitions inlined (they would dangle outside the
    model's own schema)."""
    schema = model.model_json_schema()
    definitions = schema.pop("$defs", {})

    def inline(node: object) -> object:
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(definitions[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
