"""What tests/fake_kube.py checks before it writes, as the API server does: authorization (RBAC), strict field
validation of built-in objects, the OpenAPI v3 documents kubectl reads to learn that, and the eviction API's
PodDisruptionBudget check.

- **RBAC** (`authorize`): the rules of the Roles and ClusterRoles bound to a user (RoleBindings in the request's
  namespace, ClusterRoleBindings everywhere), matched on apiGroups, resources (`plural` or `plural/subresource`),
  verbs and resourceNames with `*` wildcards, as the RBAC authorizer does
  (https://kubernetes.io/docs/reference/access-authn-authz/rbac/). Discovery (`/api`, `/apis`, `/version`,
  `/openapi`) is open to every authenticated user (the `system:discovery` ClusterRole). The refusal is the API
  server's 403 text: `pods "x" is forbidden: User "system:serviceaccount:ns:sa" cannot get resource "pods" in
  API group "" in the namespace "ns"`.
- **Strict field validation** (`builtin_problems`): with `fieldValidation=Strict` (kubectl apply's default
  since 1.27 when the server advertises it), an unknown field is a 400 `strict decoding error: unknown field
  "spec.x"`; other schema errors are a 422 naming the field. The schemas are Kubernetes' own OpenAPI schemas
  as `kubernetes-validate` ships them (strict variants: no additional properties).
- **OpenAPI v3** (`openapi_root`, `openapi_group_version`): the index and, per group/version, the POST and
  PATCH paths with the `x-kubernetes-group-version-kind` extension and the `fieldValidation`, `dryRun`,
  `fieldManager` and `force` query parameters: what kubectl's query-parameter verifier looks for (cli-runtime
  `query_param_verifier_v3.go`). No schemas: kubectl then computes apply patches from its compiled-in types.
- **Evictions** (`eviction_refusal`): the disruption controller's arithmetic, done at eviction time instead of
  kept in PDB status: healthy pods (Ready, not terminating) minus the pods the budget needs
  (`minAvailable`, or the owner's replicas minus `maxUnavailable`; percentages rounded up as Kubernetes
  does); an eviction that would leave fewer is a 429 with the API server's message.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

USER_PREFIX = "system:serviceaccount:"


# ---- RBAC ----------------------------------------------------------------------------------------------


def _subject_is(subject: dict[str, Any], user: str) -> bool:
    kind, name = subject.get("kind"), subject.get("name")
    if kind == "User":
        return name == user
    if kind == "ServiceAccount":
        return user == f"{USER_PREFIX}{subject.get('namespace')}:{name}"
    if kind == "Group":
        namespace = user[len(USER_PREFIX):].split(":")[0] if user.startswith(USER_PREFIX) else None
        return name in ("system:authenticated", "system:serviceaccounts") or (
            namespace is not None and name == f"system:serviceaccounts:{namespace}")
    return False


def _rule_allows(rule: dict[str, Any], verb: str, group: str, resource: str, name: str | None) -> bool:
    def has(values: list[str] | None, wanted: str) -> bool:
        return bool(values) and ("*" in values or wanted in values)  # type: ignore[operator]

    plural = resource.split("/")[0]
    resources = rule.get("resources") or []
    resource_ok = "*" in resources or resource in resources or (
        "/" in resource and f"{plural}/*" in resources)
    names = rule.get("resourceNames") or []
    return (has(rule.get("verbs"), verb) and has(rule.get("apiGroups"), group) and resource_ok
            and (not names or (name is not None and name in names)))


def authorize(objects: dict[tuple[str, str, str], dict[str, Any]], user: str, *, verb: str, group: str,
              resource: str, namespace: str | None, name: str | None) -> str | None:
    """None when RBAC allows the request, else the API server's refusal message."""
    rules: list[dict[str, Any]] = []
    for (plural, ns, _), binding in objects.items():
        if plural not in ("rolebindings", "clusterrolebindings"):
            continue
        if plural == "rolebindings" and ns != namespace:
            continue
        if not any(_subject_is(s, user) for s in binding.get("subjects") or ()):
            continue
        ref = binding.get("roleRef") or {}
        role = objects.get(("roles", ns, ref.get("name", ""))) if ref.get("kind") == "Role" \
            else objects.get(("clusterroles", "", ref.get("name", "")))
        rules += (role or {}).get("rules") or []
    if any(_rule_allows(rule, verb, group, resource, name) for rule in rules):
        return None
    qualified = resource.split("/")[0] + (f".{group}" if group else "")  # `deployments.apps "x" is forbidden`
    head = f'{qualified} "{name}" is forbidden' if name else f"{qualified} is forbidden"
    where = f' in the namespace "{namespace}"' if namespace else " at the cluster scope"
    return f'{head}: User "{user}" cannot {verb} resource "{resource}" in API group "{group}"{where}'


# ---- strict field validation of built-in objects ---------------------------------------------------


@functools.cache
def _validator(kind: str, api_version: str, version: str) -> Any:
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    directory = f"v{version}-local-strict"
    schema = utils.schema_contents(f"kubernetes-json-schema/{directory}/{kind.lower()}-{group_version}.json",
                                   version)
    definitions = utils.schema_contents(f"kubernetes-json-schema/{directory}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out.lstrip(".")


def builtin_problems(obj: dict[str, Any], version: str = "1.37.0") -> tuple[list[str], list[str]]:
    """(unknown fields, other schema errors) of a built-in object against Kubernetes' strict schemas."""
    try:
        validator = _validator(obj["kind"], obj["apiVersion"], version)
    except FileNotFoundError:
        return [], []
    unknown, invalid = [], []
    for error in validator.iter_errors(obj):
        for leaf in _leaves(error):
            where = _path(leaf.absolute_path)
            if leaf.validator == "additionalProperties":
                extra = set(leaf.instance) - set(leaf.schema.get("properties") or {})
                unknown += [f'unknown field "{where + "." if where else ""}{key}"' for key in sorted(extra)]
            else:
                invalid.append(f"{where or '<root>'}: Invalid value: {leaf.message}")
    return sorted(set(unknown)), invalid


def _leaves(error: Any) -> list[Any]:
    """The innermost errors: an `anyOf` over a nullable type reports the real problem in its context."""
    if not error.context:
        return [error]
    best = [e for e in error.context if e.validator != "type"] or list(error.context)
    return [leaf for e in best for leaf in _leaves(e)]


# ---- OpenAPI v3, as far as kubectl reads it ---------------------------------------------------------------


def _gv_path(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def openapi_root(group_versions: list[tuple[str, str]]) -> dict[str, Any]:
    return {"paths": {_gv_path(g, v): {"serverRelativeURL": f"/openapi/v3/{_gv_path(g, v)}?hash={abs(hash((g, v)))}"}
                      for g, v in group_versions}}


WRITE_PARAMETERS = [{"name": name, "in": "query", "schema": {"type": "string"}}
                    for name in ("dryRun", "fieldManager", "fieldValidation", "force")]


def openapi_group_version(group: str, version: str, resources: list[Any]) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for r in resources:
        gvk = {"x-kubernetes-group-version-kind": {"group": group, "version": version, "kind": r.kind}}
        base = f"/{_gv_path(group, version)}/" + ("namespaces/{namespace}/" if r.namespaced else "") + r.plural
        op = {"parameters": WRITE_PARAMETERS, "responses": {"200": {"description": "OK"}}, **gvk}
        paths[base] = {"post": op}
        paths[base + "/{name}"] = {"patch": op, "put": op}
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.37.0"}, "paths": paths,
            "components": {"schemas": {}}}


# ---- evictions and PodDisruptionBudgets ------------------------------------------------------------------


def pod_healthy(pod: dict[str, Any]) -> bool:
    if pod["metadata"].get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _scaled(value: Any, total: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.ceil(total * int(value[:-1]) / 100)  # the disruption controller rounds up
    return int(value)


def eviction_refusal(pdb: dict[str, Any], pods: list[dict[str, Any]], evicted: dict[str, Any],
                     expected: int) -> str | None:
    """The API server's 429 message when evicting `evicted` would break `pdb`, else None. `pods` are the pods
    the budget selects; `expected` the replicas of their controller (for maxUnavailable and percentages)."""
    spec = pdb.get("spec") or {}
    healthy = sum(1 for p in pods if pod_healthy(p))
    if "minAvailable" in spec:
        desired = _scaled(spec["minAvailable"], expected)
    else:
        desired = expected - _scaled(spec.get("maxUnavailable", 1), expected)
    if not pod_healthy(evicted) and healthy >= desired:  # unhealthyPodEvictionPolicy: IfHealthyBudget
        return None
    if healthy - 1 >= desired:
        return None
    return (f"Cannot evict pod as it would violate the pod's disruption budget. "
            f"The disruption budget {pdb['metadata']['name']} needs {desired} healthy pods and has {healthy} "
            "currently")
