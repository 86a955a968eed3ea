"""Token budgets per tenant: requests per minute and tokens per minute, shared by every router replica
through Redis, answered in OpenAI's rate-limit style.

What counts. A request of a tenant with a budget is checked before it queues or routes
(router/server/handlers.py): one request against `requestsPerMinute`, its prompt tokens (the estimate of
router/routing/cost.py) against `tokensPerMinute`. If both fit, both are charged in the same atomic step; if not,
nothing is charged and the client gets 429. Completion tokens are only known at the end of the answer (as
router/routing/output_tokens.py counts them from the stream; a cut stream is charged the tokens it carried): they
are charged then (`charge`), so a tenant can overshoot its token budget by the answers it has in flight,
and its next requests wait until the overshoot has left the window. A request that passed the check but was
then shed by the admission queue gets its charges back (`refund`): a full fleet is not the tenant's
spending.

The window. A sliding window log, one per tenant and kind (the Redis sorted sets below, scored by
millisecond time): an entry stops counting exactly `window` (60 s) after it was charged. That makes the
limit exact: within any 60 s, at most `requestsPerMinute` requests pass, however many replicas share the
budget, and the one after the limit passes at the first millisecond an old entry leaves the window. (GCRA
would need one key instead of a log, but it refills continuously, so "N per minute" would let N through
in a burst and then one every 60/N s: a different promise from the one the header and the docs make.)
Memory is bounded by the limits: at most `requestsPerMinute` request entries, and for tokens one entry per
admitted request and per completion in the window, plus a running sum, so a check is O(entries leaving the
window), not O(entries).

Atomic across replicas. Each check is one Lua script (EVALSHA) over the tenant's three keys, which share
the hash tag `{<tenant>}` so they sit in one Redis Cluster slot: `fleetroute:v1:budget:{<tenant>}:requests`
(members: entry ids), `...:tokens` (members `<id>:<tokens>`) and `...:tokens-sum`. Redis runs a script
alone, so two replicas can never both take the last unit. Time is the Redis server's (`TIME`), one clock
for every replica; tests pass their own.

While Redis is unreachable (or slower than `tenancy.budgetTimeout`, or its answer is malformed),
`tenancy.budgetFailMode` decides: `open` (the default) lets the request through uncharged, `closed`
answers 503 `budget_unavailable`. Open by default because budgets meter a shared resource, they do not
guard it: an outage of Redis, which the router otherwise survives (telemetry, pins and loads fall back to
local state), should not also stop every budgeted tenant's traffic; operators who sell budgets as hard
caps choose `closed`. Both count in `fleetroute_tenant_budget_errors_total{outcome}`, and one log line marks
each outage's start and end.

Headers, as OpenAI sends them: `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
`x-ratelimit-reset-requests` (the time until the window holds none of this tenant's requests: when the
limit is whole again), and the same three for `-tokens`, on every answer to a budgeted tenant (each kind
only if it has that budget); a refusal adds `Retry-After` (whole seconds until the request would fit).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from router.runtime.errors import error_response
from router.runtime.logs import RateLimitedLog
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import RedisClient
from router.runtime.redis_input import Rejected, RejectionLog
from router.traffic.tenants import TenancySettings, Tenant

log = logging.getLogger("fleetroute.budgets")

WINDOW = 60.0  # seconds: budgets are per minute
MAX_PENDING = 10_000  # completion charges and refunds waiting to be sent; beyond, they are dropped and counted
FLUSH_BATCH = 256  # operations sent at once by one flush
MAX_WALK = 1000  # token entries a refused check reads to find when enough will have left the window

# (reason label, what the OpenAI-shaped error's `type` says) by the script's reason code.
REASONS = {1: "requests", 2: "tokens", 3: "too_large"}

_NOW = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local window = tonumber(ARGV[2])
local edge = now - window
"""

# Drop the token entries that left the window and return the tokens still in it. The sum is kept beside the
# log so a check costs what leaves, not what stays; it is healed to 0 whenever the log is empty, and a member
# that is not `<id>:<tokens>` (not ours) counts as 0.
_TRIM_TOKENS = """
local function trim_tokens(log_key, sum_key)
  local sum = tonumber(redis.call('GET', sum_key)) or 0
  local gone = redis.call('ZRANGEBYSCORE', log_key, '-inf', edge)
  if #gone > 0 then
    for _, member in ipairs(gone) do
      sum = sum - (tonumber(string.match(member, ':(%d+)$')) or 0)
    end
    redis.call('ZREMRANGEBYSCORE', log_key, '-inf', edge)
  end
  if sum < 0 or redis.call('ZCARD', log_key) == 0 then sum = 0 end
  return sum
end
local function reset_in(log_key)
  local newest = redis.call('ZRANGE', log_key, -1, -1, 'WITHSCORES')
  if #newest == 0 then return 0 end
  return math.min(window, math.max(0, tonumber(newest[2]) + window - now))
end
"""

# KEYS: requests log, tokens log, tokens sum. ARGV: now ms (or ""), window ms, requests per minute (0: no
# budget), tokens per minute (0: none), prompt tokens, entry id.
# Returns {allowed, requests used, tokens used, retry ms, requests reset ms, tokens reset ms, reason}; the
# reason is 0 (allowed), 1 (requests), 2 (tokens), 3 (the prompt alone exceeds the tokens per minute).
CHECK = _NOW + _TRIM_TOKENS + f"""
local rpm, tpm, cost, id = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local used_r, used_t, retry, reason = 0, 0, 0, 0
if rpm > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', edge)
  used_r = redis.call('ZCARD', KEYS[1])
end
if tpm > 0 then used_t = trim_tokens(KEYS[2], KEYS[3]) end
if rpm > 0 and used_r + 1 > rpm then
  reason = 1
  local leaving = redis.call('ZRANGE', KEYS[1], used_r - rpm, used_r - rpm, 'WITHSCORES')
  retry = window
  if #leaving > 0 then retry = tonumber(leaving[2]) + window - now end
elseif tpm > 0 and cost > tpm then
  reason = 3
elseif tpm > 0 and used_t + cost > tpm then
  reason = 2
  local need = used_t + cost - tpm
  local freed = 0
  retry = window
  local entries = redis.call('ZRANGE', KEYS[2], 0, {MAX_WALK - 1}, 'WITHSCORES')
  for i = 1, #entries, 2 do
    freed = freed + (tonumber(string.match(entries[i], ':(%d+)$')) or 0)
    if freed >= need then
      retry = tonumber(entries[i + 1]) + window - now
      break
    end
  end
end
if reason == 0 then
  if rpm > 0 then
    redis.call('ZADD', KEYS[1], now, id)
    redis.call('PEXPIRE', KEYS[1], window)
    used_r = used_r + 1
  end
  if tpm > 0 and cost > 0 then
    redis.call('ZADD', KEYS[2], now, id .. ':' .. cost)
    redis.call('PEXPIRE', KEYS[2], window)
    used_t = used_t + cost
  end
end
if tpm > 0 then redis.call('SET', KEYS[3], used_t, 'PX', window) end
local reset_r, reset_t = 0, 0
if rpm > 0 then reset_r = reset_in(KEYS[1]) end
if tpm > 0 then reset_t = reset_in(KEYS[2]) end
return {{reason == 0 and 1 or 0, used_r, used_t, math.min(window, math.max(0, retry)), reset_r, reset_t, reason}}
"""

# KEYS: tokens log, tokens sum. ARGV: now ms (or ""), window ms, tokens, entry id. Returns the tokens used.
CHARGE = _NOW + _TRIM_TOKENS + """
local used = trim_tokens(KEYS[1], KEYS[2]) + tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now, ARGV[4] .. ':' .. ARGV[3])
redis.call('PEXPIRE', KEYS[1], window)
redis.call('SET', KEYS[2], used, 'PX', window)
return used
"""

# KEYS: requests log, tokens log, tokens sum. ARGV: entry id, prompt tokens. What a check charged, taken back
# (if it is still in the window).
REFUND = """
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('ZREM', KEYS[2], ARGV[1] .. ':' .. ARGV[2]) == 1 then
  local sum = (tonumber(redis.call('GET', KEYS[3])) or 0) - tonumber(ARGV[2])
  if sum < 0 then sum = 0 end
  redis.call('SET', KEYS[3], sum, 'KEEPTTL')
end
return 1
"""


def budget_keys(tenant: str) -> tuple[str, str, str]:
    """A tenant's keys; the hash tag keeps them in one Redis Cluster slot (one script uses all three). Tenant
    names come from the configuration (router/traffic/tenants.py), so they are safe in a key."""
    prefix = f"fleetroute:v1:budget:{{{tenant}}}:"
    return prefix + "requests", prefix + "tokens", prefix + "tokens-sum"


@dataclass(frozen=True)
class Reply:
    """A check's answer from Redis, validated (`check_reply`)."""

    allowed: bool
    requests_used: int
    tokens_used: int
    retry: float  # seconds until a refused request would fit
    requests_reset: float  # seconds until no request of the tenant is left in the window
    tokens_reset: float
    reason: str | None  # requests, tokens, too_large; None when allowed


def check_reply(raw: Any, window: float) -> Reply:
    """The script's reply, checked: seven integers in range (whoever can write Redis can make the script
    compute anything from what it stored; the reply still only ever becomes headers and a yes or no)."""
    if not isinstance(raw, list) or len(raw) != 7 or not all(isinstance(v, int) and not isinstance(v, bool)
                                                             for v in raw):
        raise Rejected("malformed", f"a budget check answered {str(raw)[:80]!r}, not seven integers")
    allowed, used_r, used_t, retry, reset_r, reset_t, reason = raw
    window_ms = window * 1000
    if allowed not in (0, 1) or reason not in (0, *REASONS) or (allowed == 1) != (reason == 0) or used_r < 0 \
            or used_t < 0 or not all(0 <= v <= window_ms for v in (retry, reset_r, reset_t)):
        raise Rejected("out_of_range", f"a budget check answered {raw!r}")
    return Reply(bool(allowed), used_r, used_t, retry / 1000, reset_r / 1000, reset_t / 1000, REASONS.get(reason))


def openai_duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: `20ms`, `1.5s`, `6m0s`."""
    ms = max(0, math.ceil(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:g}s"
    minutes, rest = divmod(ms, 60_000)
    return f"{minutes}m{rest / 1000:g}s"


@dataclass
class Verdict:
    """What a budget check decided for one request."""

    response: web.Response | None = None  # the refusal to send; None: go on
    headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-* for the answer
    entry: str | None = None  # the charge's entry id (a refund takes it back); None: nothing was charged
    prompt_tokens: int = 0
    reason: str | None = None  # the tenant_shed reason of a refusal


class Budgets:
    """The budget checks of one router process, and the task that sends completion charges and refunds."""

    def __init__(self, *, redis: RedisClient, tenancy: TenancySettings, metrics: RouterMetrics,
                 clock: Callable[[], float] | None = None, window: float = WINDOW) -> None:
        self._redis = redis
        self._tenancy = tenancy
        self._metrics = metrics
        self._clock = clock  # wall-clock seconds; None: the Redis server's TIME (one clock for all replicas)
        self._window = window
        self._check = redis.register_script(CHECK)
        self._charge = redis.register_script(CHARGE)
        self._refund = redis.register_script(REFUND)
        self._ids = (f"{os.getpid():x}.{os.urandom(4).hex()}.{n:x}" for n in itertools.count())
        self._pending: list[tuple[str, Tenant, tuple[Any, ...]]] = []
        self._wake = asyncio.Event()
        self._flushing = asyncio.Lock()  # one flush at a time: a caller of flush() waits for the one under way
        self._down = False
        self._refusals = RateLimitedLog(log)
        self._rejected = RejectionLog(what="budget reply", logger=log,
                                      count=lambda reason: metrics.redis_rejected.labels("budget", reason).inc())
        for tenant in tenancy.tenants:
            for kind, limit in (("requests", tenant.requests_per_minute), ("tokens", tenant.tokens_per_minute)):
                if limit is not None:
                    metrics.tenant_budget_limit.labels(tenant.name, kind).set(limit)

    def _now(self) -> str:
        return "" if self._clock is None else str(int(self._clock() * 1000))

    # ---- the request path --------------------------------------------------------------------------------

    async def check(self, tenant: Tenant, prompt_tokens: int, model: str) -> Verdict:
        """Check and charge one request of `tenant` (which has a budget) with `prompt_tokens`."""
        rpm, tpm = tenant.requests_per_minute or 0, tenant.tokens_per_minute or 0
        cost = max(0, int(prompt_tokens)) if tpm else 0
        entry = next(self._ids)
        args = (self._now(), int(self._window * 1000), rpm, tpm, cost, entry)
        try:
            async with asyncio.timeout(self._tenancy.budget_timeout):
                raw = await self._check(keys=budget_keys(tenant.name), args=args)
            reply = check_reply(raw, self._window)
        except Rejected as exc:
            self._rejected(exc)
            return self._unavailable(tenant, exc)
        except (RedisError, OSError, TimeoutError) as exc:
            return self._unavailable(tenant, exc)
        self._up()
        headers = self._headers(tenant, reply)
        if reply.allowed:
            return Verdict(headers=headers, entry=entry, prompt_tokens=cost)
        return Verdict(self._refusal(tenant, reply, cost, headers, model), headers, reason=reply.reason)

    def _headers(self, tenant: Tenant, reply: Reply) -> dict[str, str]:
        headers = {}
        gauge = self._metrics.tenant_budget_remaining
        for kind, limit, used, reset in (("requests", tenant.requests_per_minute, reply.requests_used,
                                          reply.requests_reset),
                                         ("tokens", tenant.tokens_per_minute, reply.tokens_used, reply.tokens_reset)):
            if limit is None:
                continue
            remaining = max(0, limit - used)
            gauge.labels(tenant.name, kind).set(remaining)
            headers[f"x-ratelimit-limit-{kind}"] = str(limit)
            headers[f"x-ratelimit-remaining-{kind}"] = str(remaining)
            headers[f"x-ratelimit-reset-{kind}"] = openai_duration(reset)
        return headers

    def _refusal(self, tenant: Tenant, reply: Reply, cost: int, headers: dict[str, str],
                 model: str) -> web.Response:
        name = tenant.name
        self._refusals.warning((name, reply.reason), "request over its tenant's budget", tenant=name, model=model,
                               reason=reply.reason, requests_used=reply.requests_used,
                               tokens_used=reply.tokens_used, prompt_tokens=cost)
        if reply.reason == "too_large":
            message = (f"Request too large for tenant `{name}` on tokens per minute (TPM): limit "
                       f"{tenant.tokens_per_minute}, requested {cost}. Send a shorter prompt.")
            return error_response(429, message, code="rate_limit_exceeded", type_="tokens", headers=headers)
        if reply.reason == "requests":
            what, limit, used = "requests per minute (RPM)", tenant.requests_per_minute, reply.requests_used
        else:
            what, limit, used = "tokens per minute (TPM)", tenant.tokens_per_minute, reply.tokens_used
        message = (f"Rate limit reached for tenant `{name}` on {what}: limit {limit}, used {used}"
                   + (f", requested {cost}" if reply.reason == "tokens" else "")
                   + f". Please try again in {openai_duration(reply.retry)}.")
        return error_response(429, message, code="rate_limit_exceeded", type_=reply.reason,
                              headers={**headers, "Retry-After": str(max(1, math.ceil(reply.retry)))})

    def _unavailable(self, tenant: Tenant, exc: BaseException) -> Verdict:
        closed = self._tenancy.budget_fail_mode == "closed"
        self._metrics.budget_errors.labels("refused" if closed else "allowed").inc()
        if not self._down:
            self._down = True
            log.warning("tenant budgets unavailable; " + ("refusing" if closed else "letting through") +
                        " budgeted tenants' requests until Redis answers again",
                        extra={"error": f"{type(exc).__name__}: {exc}"[:300], "fail_mode":
                               self._tenancy.budget_fail_mode, "tenant": tenant.name})
        if not closed:
            return Verdict()
        response = error_response(503, f"the budgets of tenant `{tenant.name}` cannot be checked right now; "
                                       "retry later", code="budget_unavailable", headers={"Retry-After": "1"})
        return Verdict(response, reason="budget_unavailable")

    def _up(self) -> None:
        if self._down:
            self._down = False
            log.info("tenant budgets available again")

    # ---- after the request: completion tokens and refunds (sent in the background) -----------------------

    def charge(self, tenant: Tenant, tokens: int) -> None:
        """Charge `tokens` completion tokens to `tenant`'s token budget (sent by the flusher)."""
        if tenant.tokens_per_minute is not None and tokens > 0:
            self._queue("charge", tenant, (int(tokens), next(self._ids)))

    def refund(self, tenant: Tenant, verdict: Verdict) -> None:
        """Take back what `verdict`'s check charged (the request never went to an engine)."""
        if verdict.entry is not None:
            self._queue("refund", tenant, (verdict.entry, verdict.prompt_tokens))

    def _queue(self, kind: str, tenant: Tenant, args: tuple[Any, ...]) -> None:
        if len(self._pending) >= MAX_PENDING:  # Redis far behind: memory stays bounded, the loss is counted
            self._metrics.budget_errors.labels("charge_lost").inc()
            return
        self._pending.append((kind, tenant, args))
        self._wake.set()

    async def flush(self) -> None:
        """Send the charges and refunds queued so far (in batches); failures are counted, not retried. Returns
        once they are all answered, the ones another flush had already taken included."""
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending[:FLUSH_BATCH], self._pending[FLUSH_BATCH:]
            results = await asyncio.gather(*(self._send(*op) for op in batch), return_exceptions=True)
            lost = sum(1 for r in results if isinstance(r, BaseException))
            if lost:
                self._metrics.budget_errors.labels("charge_lost").inc(lost)
                error = next(r for r in results if isinstance(r, BaseException))
                log.warning("tenant budget charges not recorded", extra={"lost": lost,
                                                                       "error": f"{type(error).__name__}: {error}"})

    async def _send(self, kind: str, tenant: Tenant, args: Sequence[Any]) -> None:
        requests, tokens, total = budget_keys(tenant.name)
        async with asyncio.timeout(max(self._tenancy.budget_timeout, 1.0)):  # off the request path: more slack
            if kind == "charge":
                count, entry = args
                await self._charge(keys=(tokens, total), args=(self._now(), int(self._window * 1000), count, entry))
            else:
                entry, prompt = args
                await self._refund(keys=(requests, tokens, total), args=(entry, prompt))

    async def run(self) -> None:
        """The flusher: sends whatever is queued, as soon as it is (one round at a time)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
