"""Wedged engines: find them, eject them, and take the requests waiting on them elsewhere.

Every second, the stall detector (router/health/stall.py) names the endpoints that have requests outstanding
and have sent no response head or body chunk for longer than their stall threshold. Each such suspect gets one
probe, a 1-token completion with `stallDetection.probeTimeout`, sent like the active health checks' (with the
engines' API key when one is configured). An answer below 500 clears it: the engine is busy, not stalled, and
the answer counts as progress (the next probe comes only after another threshold of silence). A failed probe
(no answer in time, no connection, a 5xx), with no progress from the endpoint meanwhile, is the verdict:

1. every request waiting there that has sent nothing to its client is released: the proxy raises
   `UpstreamRescued` and the handler sends it to another endpoint, as a retry (within `retries.attempts` and
   the retry budget; else the client gets 504 `upstream_timeout` at once rather than after `firstByte`);
2. every stream already started there ends with the usual error event (`upstream_stream_interrupted`): it
   cannot be resumed elsewhere, and ending it now beats leaving the client hanging for `timeouts.idle`;
3. the endpoint is ejected (reason `stalled`) from each policy's pool, with outlier detection's ejection times
   and within its `maxEjectionPercent` (the requests are released even when the cap keeps it in).

Independently, when a snapshot build finds an endpoint newly out of a pool because it was ejected (any reason),
failed its active health checks or lost its GPU, `release_excluded` releases that policy's requests waiting
there (not its started streams: an engine failing `/health` may still be streaming fine).
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from multidict import CIMultiDict

from router.health.active import describe, probe_completion
from router.health.stall import Suspect
from router.model import EndpointState
from router.runtime.background import contained
from router.server import auth
from router.server.context import RouterContext

log = logging.getLogger("fleetroute.rescue")

CHECK_INTERVAL = 1.0  # seconds between two looks for silent endpoints


async def run_stall_checks(ctx: RouterContext) -> None:
    while True:
        await asyncio.sleep(CHECK_INTERVAL)
        with contained("stall_checks", ctx.metrics):
            await stall_round(ctx)


async def stall_round(ctx: RouterContext) -> list[str]:
    """Probe every current suspect (at once) and act on the verdicts; returns the endpoints found stalled."""
    settings = ctx.settings.stall
    if not settings.enabled or ctx.http is None:
        return []
    suspects = ctx.stalls.suspects(settings, ctx.balancer.peers)
    if not suspects:
        return []
    verdicts = await asyncio.gather(*(_probe(ctx, suspect) for suspect in suspects))
    return [suspect.endpoint_id for suspect, stalled in zip(suspects, verdicts, strict=True) if stalled]


async def _probe(ctx: RouterContext, suspect: Suspect) -> bool:
    endpoint_id = suspect.endpoint_id
    endpoint = ctx.balancer.endpoint(endpoint_id)
    activity = ctx.stalls.activity(endpoint_id)
    view = ctx.balancer.snapshot.by_id.get(endpoint_id)
    if endpoint is None or activity is None or view is None or view.state is not EndpointState.SERVING:
        # It left meanwhile, or is leaving (drained, or a pod terminating, whose address may already be gone or
        # reused): no probe; its requests end with it, or break and are retried elsewhere.
        return False
    assert ctx.http is not None
    timeout = ctx.settings.stall.probe_timeout
    log.info("endpoint silent past its stall threshold; probing it",
             extra={"endpoint": endpoint_id, "silence_s": round(suspect.silence, 3),
                    "threshold_s": round(suspect.threshold, 3), "waiting": len(activity.waiters)})
    headers: CIMultiDict[str] = CIMultiDict()
    credentials = auth.upstream_credentials(ctx.settings.auth)
    if credentials is not None:
        credentials(headers)  # the engines' own API key, when one is configured
    activity.probing = True
    try:
        status = await probe_completion(ctx.http, endpoint, timeout, headers)
        ok, error = status < 500, f"probe completion answered {status}"
    except (TimeoutError, aiohttp.ClientError) as exc:
        ok, error = False, describe(exc) if not isinstance(exc, TimeoutError) else f"no answer within {timeout:g}s"
    finally:
        activity.probing = False
    if not ctx.balancer.is_member(endpoint_id):
        return False  # it left while the probe ran: no series or state may name it any more
    ctx.metrics.stall_probes.labels(endpoint_id, "pass" if ok else "fail").inc()
    if ok:
        activity.quiet_since = max(activity.quiet_since, ctx.clock())  # it answered: that is progress
        log.info("endpoint answered the stall probe: busy, not stalled", extra={"endpoint": endpoint_id})
        return False
    if activity.quiet_since != suspect.quiet_since:
        return False  # it made progress on a request while the probe waited: slow, not stalled
    _stalled(ctx, suspect, error)
    return True


def _stalled(ctx: RouterContext, suspect: Suspect, error: str) -> None:
    endpoint_id = suspect.endpoint_id
    # Released before the ejection, whose rebuild would otherwise release the waiting ones as merely "ejected".
    waiting, streaming = ctx.stalls.release(endpoint_id, "stalled", streams=True)
    ctx.metrics.stalls.labels(endpoint_id).inc()
    policies = ctx.balancer.eject(endpoint_id, "stalled")
    log.warning("endpoint stalled: its waiting requests go elsewhere, its started streams end",
                extra={"endpoint": endpoint_id, "silence_s": round(ctx.stalls.silence(endpoint_id), 3),
                       "threshold_s": round(suspect.threshold, 3), "probe_error": error, "waiting": waiting,
                       "streaming": streaming, "ejected_by": policies,
                       "not_ejected": "maxEjectionPercent" if not policies else None})


def release_excluded(ctx: RouterContext, policy: str, endpoint_id: str, reason: str) -> None:
    """The balancer's `on_excluded`: a build left the endpoint out of the policy's pool for `reason`."""
    waiting, _ = ctx.stalls.release(endpoint_id, reason, policy=policy)
    if waiting:
        log.warning("endpoint left the pool: the requests waiting there go elsewhere",
                    extra={"policy": policy, "endpoint": endpoint_id, "reason": reason, "waiting": waiting})
