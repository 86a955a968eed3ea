"""What became of one inference request (`Served`), filled in as the request path progresses
(router/server/handlers.py and the retry layer, attempts.py) and read by metrics and the access log."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from router.routing.aliases import Choice
from router.routing.cost import CostEstimate, CostSettings
from router.routing.output_tokens import OutputCounter
from router.server.explain import Decision
from router.server.proxy import Outcome
from router.server.tracing import NO_TRACE, RequestTrace
from router.traffic.budgets import Verdict
from router.traffic.tenants import Tenant


@dataclass
class Served:
    """What became of one inference request, filled in as it progresses (for metrics and the access log)."""

    response: web.StreamResponse | None = None
    model: str = ""  # a model the fleet serves (metric label: never arbitrary client input)
    requested_model: str = ""
    endpoint: str = ""  # the endpoint of the latest attempt
    outcome: Outcome | None = None  # set once an endpoint answered
    attempts: int = 0
    failure: BaseException | None = None  # what interrupted the handler, if anything
    estimate: CostEstimate | None = None  # policies that estimate request costs (router/routing/cost.py)
    cost_settings: CostSettings | None = None
    decision: Decision | None = None  # an explained request's routing record (router/server/explain.py)
    tenant: Tenant | None = None  # with a `tenancy:` block: the request's tenant (router/traffic/tenants.py)
    budget: Verdict | None = None  # its budget check, for a budgeted tenant (router/traffic/budgets.py)
    counter: OutputCounter | None = None  # counts the answer's output tokens (requests with a cost estimate)
    trace: RequestTrace = NO_TRACE  # its spans, with tracing on (router/server/tracing.py); NO_TRACE does nothing
    alias: Choice | None = None  # a request for a model alias: its target (router/routing/aliases.py)

    @property
    def status(self) -> int:
        # 499 (nginx's "client closed request") when the client left before the end of the answer.
        if isinstance(self.failure, asyncio.CancelledError):
            return 499
        if self.failure is not None:
            return 500
        if self.outcome is not None:
            return 499 if self.outcome.error == "client_disconnect" else self.outcome.status
        return self.response.status if self.response is not None else 500
