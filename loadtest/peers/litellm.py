"""LiteLLM's proxy (`litellm[proxy]` on PyPI), one deployment per backend under one model group.

Configuration (`litellm-config.yaml` in the work directory, `render_config`): every backend is a deployment
of the same `model_name` with `litellm_params: {model: hosted_vllm/<model>, api_base: <url>/v1, api_key:
none}` (LiteLLM's provider for vLLM servers: it sends `model: <model>` upstream) and `model_info.id` = the
endpoint id (LiteLLM answers it in the `x-litellm-model-id` response header, so the harness can attribute a
request to a backend). `router_settings.routing_strategy` is the policy; `general_settings.master_key` a
random key the clients must send as `Authorization: Bearer ...` (`StartedPeer.headers`): a proxy without
one serves anybody, and a deployment that people compare against checks keys. No database, so no spend
logs or virtual keys.

Command line: `litellm --config FILE --host 127.0.0.1 --port P --num_workers N` (uvicorn, uvloop; one
worker process unless pinned to more cores). Environment: `LITELLM_LOCAL_MODEL_COST_MAP=True` (else start-up
tries to fetch the model price map from the internet, three attempts with back-off) and `HF_HUB_OFFLINE=1`:
to count a stream's tokens LiteLLM loads a Hugging Face tokenizer chosen from the model name (`llama-3...`
-> Xenova/llama-3-tokenizer) on the first stream through each deployment; offline, huggingface_hub retries
for 25 s, holding that stream, before LiteLLM falls back to tiktoken. With HF_HUB_OFFLINE it falls back at
once, so here LiteLLM counts with tiktoken (a connected deployment would download the tokenizer once and
count with it: a little more CPU per stream than here).

Quirks: start-up takes about 12 s on this machine; LiteLLM re-serialises every SSE event (it parses each
upstream chunk into its own types and writes a new one: vLLM's `logprobs: null` disappear, streamed text
completions gain a `usage` object of zeros in every event); `/v1/models` lists the model group from the
configuration, without asking a backend.

Strategies (`litellm.types.router.RoutingStrategy` and `router_strategy/` in the installed package):
simple-shuffle is the default; usage-based-routing(-v2) and cost-based-routing also exist but route on
TPM/RPM limits and prices the simulated fleet does not have.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from loadtest.peers.base import (
    LaunchPlan,
    PeerInfo,
    PipInstall,
    ReadyProbe,
    check_backends,
    lists_model,
)

INFO = PeerInfo(
    name="litellm",
    policies=("simple-shuffle", "least-busy", "latency-based-routing"),
    summary="LiteLLM proxy (PyPI litellm[proxy]), one model group with a deployment per backend",
    install="loadtest/peers/install-litellm.sh",
    policy_notes={
        "simple-shuffle": "a random deployment (weighted by rpm/tpm/weight when set; none are here)",
        "least-busy": "the deployment with the fewest requests this proxy has in flight",
        "latency-based-routing": "the deployment with the lowest mean latency of recent requests (time to "
                                 "first token for streams), random among ties; unseen ones count as 0",
    },
)
INSTALL = PipInstall(INFO, dist="litellm", program="litellm")
CONFIG_FILE = "litellm-config.yaml"
unavailable_reason = INSTALL.unavailable_reason
version = INSTALL.version
executable = INSTALL.executable


def render_config(policy: str, backends: Sequence[tuple[str, str]], model: str, master_key: str) -> dict[str, Any]:
    return {
        "model_list": [
            {
                "model_name": model,
                "litellm_params": {"model": f"hosted_vllm/{model}", "api_base": url.rstrip("/") + "/v1",
                                   "api_key": "none"},
                "model_info": {"id": endpoint_id},
            }
            for endpoint_id, url in backends
        ],
        "router_settings": {"routing_strategy": policy},
        "general_settings": {"master_key": master_key},
    }


def plan(policy: str, backends: Sequence[tuple[str, str]], model: str, *, port: int, root: Path,
         workdir: Path, workers: int | None = None, master_key: str | None = None) -> LaunchPlan:
    check_backends(INFO, policy, backends)
    key = master_key or f"sk-fleetroute-{secrets.token_hex(8)}"
    config = workdir / CONFIG_FILE
    argv = (str(executable(root)), "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
            "--num_workers", str(workers or 1))
    auth = {"Authorization": f"Bearer {key}"}
    return LaunchPlan(
        argv=argv, port=port,
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "HF_HUB_OFFLINE": "1"},
        files={CONFIG_FILE: yaml.safe_dump(render_config(policy, backends, model, key), sort_keys=False)},
        probe=ReadyProbe("/v1/models", lists_model(model), headers=auth),
        client_headers=auth,
    )
