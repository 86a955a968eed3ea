"""What the fake API server (tests/fake_kube.py) does with a CustomResourceDefinition: apply its schema's
defaults, validate objects against its `openAPIV3Schema` with `jsonschema` and evaluate its
`x-kubernetes-validations` CEL rules with `cel-python`, answering 422 as the API server does, and render its
printer columns for `kubectl get` (`as=Table`).

The OpenAPI v3 schema is turned into JSON Schema the way the API server reads it: `nullable` allows null,
`x-kubernetes-int-or-string` is an integer or a string, and an object schema with `properties` and no
`additionalProperties` accepts no other fields (the API server prunes unknown fields, or with
`fieldValidation=Strict`, the default of kubectl apply, refuses them: refusing is what the tests check).
CEL sees `number` fields as doubles, as Kubernetes does.
"""

from __future__ import annotations

import copy
import datetime
import re
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
CRD_PATH = ROOT / "manifests" / "crd" / "routingpolicies.fleetroute.io.yaml"


def _to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key.startswith("x-kubernetes") or key in ("nullable", "default", "description", "format"):
            continue
        if key == "properties":
            out[key] = {k: _to_json_schema(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _to_json_schema(value)
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if schema.get("nullable") and "type" in out:
        out["type"] = [*([out["type"]] if isinstance(out["type"], str) else out["type"]), "null"]
    return out


class FakeCRD:
    def __init__(self, path: Path = CRD_PATH, *, crd: dict[str, Any] | None = None) -> None:
        self.crd = crd if crd is not None else yaml.safe_load(path.read_text())
        version = next((v for v in self.crd["spec"]["versions"] if v.get("storage")), self.crd["spec"]["versions"][0])
        self.schema = version["schema"]["openAPIV3Schema"]
        self.columns = version.get("additionalPrinterColumns", [])
        self.plural = self.crd["spec"]["names"]["plural"]
        validator = jsonschema.Draft4Validator  # OpenAPI 3.0's boolean exclusiveMinimum
        converted = _to_json_schema(self.schema)
        converted["properties"]["metadata"]["additionalProperties"] = True  # ObjectMeta: the API server's own
        self.validator = validator(converted)
        self.cel = celpy.Environment()

    @classmethod
    def from_object(cls, crd: dict[str, Any]) -> FakeCRD:
        """From a CustomResourceDefinition created through the API (tests/fake_kube.py serves it then)."""
        return cls(crd=copy.deepcopy(crd))

    # ---- admission ---------------------------------------------------------------------------------

    def default(self, obj: dict[str, Any]) -> None:
        _default(self.schema, obj)

    @staticmethod
    def stored(obj: Any) -> Any:
        """`obj` as the API server keeps a custom resource: unstructured JSON, which comes back with every
        object's keys in alphabetical order (Go's encoding/json sorts map keys). Order that was meaning, such
        as the rank of `admission.classes`, is lost."""
        if isinstance(obj, dict):
            return {k: FakeCRD.stored(obj[k]) for k in sorted(obj)}
        if isinstance(obj, list):
            return [FakeCRD.stored(v) for v in obj]
        return obj

    def admit(self, obj: dict[str, Any]) -> list[str]:
        """Default `obj` in place; the API server's field errors (`spec.x: Invalid value: ...`), or none."""
        _default(self.schema, obj)
        errors = []
        for error in sorted(self.validator.iter_errors(obj), key=lambda e: list(e.absolute_path)):
            where = ".".join(str(p) for p in error.absolute_path) or "<root>"
            errors.append(f"{where}: Invalid value: {error.message}")
        if not errors:
            errors = self._cel(self.schema, obj, "")
        return errors

    def _cel(self, schema: dict[str, Any], value: Any, path: str) -> list[str]:
        errors = []
        for rule in schema.get("x-kubernetes-validations", ()):
            if schema.get("properties") and _COMPREHENSION_ON_SELF.search(rule["rule"]):
                # Typed CEL: an object with properties is a message type, which no macro may range over;
                # the API server refuses such a CRD outright ("cannot be range of a comprehension").
                raise ValueError(f"{path or '<root>'}: rule {rule['rule']!r} ranges over an object with "
                                 "properties, which Kubernetes' typed CEL refuses")
            program = self.cel.program(self.cel.compile(rule["rule"]))
            try:
                ok = program.evaluate({"self": celpy.json_to_cel(_as_cel(schema, value))})
            except Exception as exc:  # an evaluation error is a failed rule, as in the API server
                ok, rule = False, {**rule, "message": f"{rule.get('message')} (evaluation error: {exc})"}
            if not bool(ok):
                errors.append(f"{path or '<root>'}: Invalid value: \"object\": {rule.get('message', rule['rule'])}")
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value and value[key] is not None:
                    errors += self._cel(sub, value[key], f"{path}.{key}".lstrip("."))
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict):  # a map's values (admission.classes.<name>)
                for key, sub_value in value.items():
                    if sub_value is not None:
                        errors += self._cel(extra, sub_value, f"{path}[{key}]")
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                if item is not None:
                    errors += self._cel(schema["items"], item, f"{path}[{i}]")
        return errors

    # ---- kubectl get -----------------------------------------------------------------------------------

    def table(self, objects: list[dict[str, Any]], resource_version: int | None) -> dict[str, Any]:
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0},
                   *({"name": c["name"], "type": c["type"], "format": "", "description": c.get("description", ""),
                      "priority": 0} for c in self.columns)]
        rows = [{"cells": [o["metadata"]["name"], *(_cell(o, c) for c in self.columns)],
                 "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                            "metadata": o["metadata"]}} for o in objects]
        meta = {"resourceVersion": str(resource_version)} if resource_version is not None else {}
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta, "columnDefinitions": columns,
                "rows": rows}


def _default(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _default(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for v in value.values():
                _default(extra, v)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(schema["items"], item)


# JSONSchemaProps fields a v1 CRD may not use (apiextensions validation), and the structural-schema rules.
_FORBIDDEN_IN_V1 = ("$ref", "definitions", "dependencies", "id", "patternProperties", "additionalItems")


def crd_problems(crd: dict[str, Any]) -> list[str]:
    """What the API server refuses in a CustomResourceDefinition beyond its OpenAPI schema: a schema that is not
    structural (a field without a type; properties beside additionalProperties; fields v1 forbids), a default
    its own schema rejects, and an x-kubernetes-validations rule that does not compile or that ranges over an
    object with properties (https://kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
    custom-resource-definitions/#specifying-a-structural-schema)."""
    problems: list[str] = []
    cel = celpy.Environment()
    for i, version in enumerate(crd.get("spec", {}).get("versions") or ()):
        schema = (version.get("schema") or {}).get("openAPIV3Schema")
        if schema is None:
            continue
        _structural(schema, f"spec.versions[{i}].schema.openAPIV3Schema", problems, cel, root=True)
    return problems


def _structural(schema: dict[str, Any], where: str, problems: list[str], cel: Any, *, root: bool = False) -> None:
    typed = "type" in schema or schema.get("x-kubernetes-int-or-string") or \
        schema.get("x-kubernetes-preserve-unknown-fields")
    if not typed:
        problems.append(f"{where}.type: Required value: must not be empty for specified object fields")
    for key in _FORBIDDEN_IN_V1:
        if key in schema:
            problems.append(f"{where}.{key}: Forbidden: {key} is not supported in v1 CustomResourceDefinitions")
    if schema.get("uniqueItems") is True:
        problems.append(f"{where}.uniqueItems: Forbidden: uniqueItems cannot be set to true since the runtime "
                        "complexity becomes quadratic")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{where}.additionalProperties: Forbidden: additionalProperties and properties are "
                        "mutual exclusive")
    if "default" in schema and not root:
        errors = list(jsonschema.Draft4Validator(_to_json_schema(schema)).iter_errors(schema["default"]))
        problems += [f"{where}.default: Invalid value: {e.message}" for e in errors[:3]]
    for j, rule in enumerate(schema.get("x-kubernetes-validations") or ()):
        text = rule.get("rule", "") if isinstance(rule, dict) else ""
        unknown = set(rule) - {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"} \
            if isinstance(rule, dict) else set()
        if unknown:
            problems.append(f"{where}.x-kubernetes-validations[{j}]: unknown fields {sorted(unknown)}")
        try:
            cel.compile(text)
        except Exception as exc:  # celpy's CELParseError and friends
            problems.append(f"{where}.x-kubernetes-validations[{j}].rule: Invalid value: {text!r}: compilation "
                            f"failed: {str(exc).splitlines()[0]}")
        if schema.get("properties") and _COMPREHENSION_ON_SELF.search(text):
            problems.append(f"{where}.x-kubernetes-validations[{j}].rule: Invalid value: {text!r}: cannot be "
                            "range of a comprehension (an object with properties)")
    for key, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, dict):
            _structural(sub, f"{where}.properties[{key}]", problems, cel)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            _structural(schema[key], f"{where}.{key}", problems, cel)


_COMPREHENSION_ON_SELF = re.compile(r"\bself\.(all|exists|exists_one|map|filter)\(")


def _as_cel(schema: dict[str, Any], value: Any) -> Any:
    """Numbers of `number` fields as floats (CEL's double), recursively; null-valued fields left out, since
    Kubernetes CEL treats them as absent (`has(self.x)` is false for a nullable `x` set to null)."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties") if isinstance(schema.get("additionalProperties"), dict) else {}
        return {k: _as_cel(props.get(k, extra), v) for k, v in value.items() if v is not None}
    return value


def _cell(obj: dict[str, Any], column: dict[str, Any]) -> Any:
    """A printer column's cell; a `date` column as an age (`5m`, `3d`), as the API server renders it."""
    value = _json_path(obj, column["jsonPath"])
    if column["type"] != "date" or not isinstance(value, str):
        return value
    then = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _json_path(obj: dict[str, Any], path: str) -> Any:
    """The few JSONPath forms printer columns use: `.a.b` and `.a.list[?(@.k=="v")].field`."""
    value: Any = obj
    for part in re.findall(r'\.(\w+)(?:\[\?\(@\.(\w+)=="([^"]*)"\)\])?', path):
        key, fkey, fval = part
        value = value.get(key) if isinstance(value, dict) else None
        if fkey:
            value = next((i for i in value or () if i.get(fkey) == fval), None)
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return value if value is not None else None
