"""The examples of docs/gateway*.md work as written: every fenced YAML block parses; Kubernetes objects of the
kinds we vendor CRDs for (tests/data/crds/: GIE's InferencePool, unchanged, and the HTTPRoute fields we use) pass
the CRD's openAPIV3Schema and CEL rules as the API server would (tests/fake_crd.py), built-in kinds pass the
Kubernetes OpenAPI schemas (kubernetes-validate, strict), other projects' kinds (a Gateway, Istio's
DestinationRule, Envoy Gateway's policies) have the shape of an object; a Helm values block passes the chart's
values.schema.json merged over its defaults; a picker config block passes the router's own settings parser.

A reader copies these into a cluster; an example that the API server, Helm or `fleetroute epp` would refuse is a
bug in the docs.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from router.config.settings import ConfigError, parse_settings
from tests.fake_crd import FakeCRD

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("gateway*.md"))
CRDS = sorted((ROOT / "tests" / "data" / "crds").glob("*.yaml"))
CHART = ROOT / "helm" / "fleetroute"
KUBE_VERSION = "1.30"  # the oldest the chart supports is checked in tests/test_helm.py; one is enough here
YAML_BLOCK = re.compile(r"^```ya?ml\n(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[str, str]]:
    """(where, text) of every fenced YAML block of the gateway pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in YAML_BLOCK.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{page.name}:{line}", m.group(1)))
    return found


BLOCKS = blocks()


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(where, doc) for where, text in BLOCKS for doc in yaml.safe_load_all(text) if isinstance(doc, dict)]


def kube_objects() -> list[tuple[str, dict[str, Any]]]:
    return [(where, doc) for where, doc in documents() if "apiVersion" in doc and "kind" in doc]


@pytest.fixture(scope="module")
def crds() -> dict[tuple[str, str], FakeCRD]:
    found = {}
    for path in CRDS:
        crd = FakeCRD(path)
        spec = crd.crd["spec"]
        for version in spec["versions"]:
            found[(f"{spec['group']}/{version['name']}", spec["names"]["kind"])] = crd
    return found


def crd_errors(crd: FakeCRD, obj: dict[str, Any]) -> list[str]:
    """The API server's answer to creating `obj`: schema and CEL rules, array items' rules included (as
    tests/test_helm.py checks the chart's objects)."""
    def items_rules(schema: dict[str, Any], value: Any, path: str) -> list[str]:
        errors = []
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if value.get(key) is not None:
                    errors += items_rules(sub, value[key], f"{path}.{key}".lstrip("."))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += crd._cel(schema["items"], item, f"{path}[{i}]") + items_rules(schema["items"], item,
                                                                                         f"{path}[{i}]")
        return errors

    obj = copy.deepcopy(obj)
    return crd.admit(obj) or items_rules(crd.schema, obj, "")


def test_the_pages_have_examples_for_each_gateway() -> None:
    """The blocks below are what the page promises: a pool, a route, and each gateway's own objects."""
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in kube_objects()}
    assert ("inference.networking.k8s.io/v1", "InferencePool") in kinds
    assert ("gateway.networking.k8s.io/v1", "HTTPRoute") in kinds
    classes = {doc["spec"]["gatewayClassName"] for _, doc in kube_objects() if doc["kind"] == "Gateway"}
    assert {"envoy-gateway", "kgateway", "istio"} <= classes


@pytest.mark.parametrize("where,text", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_every_yaml_block_parses(where: str, text: str) -> None:
    docs = list(yaml.safe_load_all(text))
    assert any(d is not None for d in docs), f"{where}: an empty YAML block"


def test_objects_of_vendored_crds_are_accepted_by_them(crds) -> None:
    checked = 0
    for where, obj in kube_objects():
        crd = crds.get((obj["apiVersion"], obj["kind"]))
        if crd is None:
            continue
        assert crd_errors(crd, obj) == [], f"{where}: {obj['kind']}/{obj['metadata']['name']} is refused by its CRD"
        checked += 1
    assert checked >= 2


def test_the_inference_pool_names_the_pickers_service_and_port() -> None:
    """The pool's endpointPickerRef reaches the Service the page runs `fleetroute epp` behind, on its port."""
    objects = [obj for _, obj in kube_objects()]
    pools = [o for o in objects if o["kind"] == "InferencePool"]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for pool in pools:
        ref = pool["spec"]["endpointPickerRef"]
        service = services[ref["name"]]
        assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
        assert ref["failureMode"] in ("FailOpen", "FailClose")


def test_built_in_kinds_pass_the_kubernetes_schemas() -> None:
    for where, obj in kube_objects():
        if "/" in obj["apiVersion"] and not obj["apiVersion"].startswith(("apps/", "rbac.authorization.k8s.io/")):
            continue  # not a built-in group
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} at "
                        f"{'.'.join(map(str, exc.path))}")


def test_other_kinds_have_the_shape_of_an_object(crds) -> None:
    """No schema here for a Gateway, Istio's or Envoy Gateway's kinds: at least a named object with a spec."""
    for where, obj in kube_objects():
        assert re.fullmatch(r"([a-z0-9.-]+/)?v\d+((alpha|beta)\d+)?", obj["apiVersion"]), where
        assert obj["metadata"].get("name"), f"{where}: no metadata.name"
        if (obj["apiVersion"], obj["kind"]) not in crds:
            assert isinstance(obj.get("spec"), dict) and obj["spec"], f"{where}: {obj['kind']} without a spec"


def _merge(base: Any, over: Any) -> Any:
    """Helm's values merge: maps merge key by key, anything else replaces."""
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: _merge(base.get(k), v) for k, v in over.items()}}
    return copy.deepcopy(over)


def test_helm_values_blocks_pass_the_charts_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    checked = 0
    for where, text in BLOCKS:
        if "helm install fleetroute" not in text.split("\n", 1)[0]:
            continue
        values = _merge(defaults, yaml.safe_load(text))
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(values), key=lambda e: list(e.path))
        assert not errors, f"{where}: {errors[0].message} at {'.'.join(map(str, errors[0].path))}"
        checked += 1
    assert checked >= 2


def test_picker_config_blocks_pass_the_routers_parser() -> None:
    checked = 0
    for where, text in BLOCKS:
        if "router.yaml of `fleetroute epp`" not in text.split("\n", 1)[0]:
            continue
        try:
            parse_settings(yaml.safe_load(text))
        except ConfigError as exc:
            pytest.fail(f"{where}: the picker would refuse this config: {exc}")
        checked += 1
    assert checked >= 1, "no picker config block found"
