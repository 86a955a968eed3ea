"""Weighted fair queueing between tenants inside one admission class, measured in predicted tokens.

Why. Admission (router/traffic/admission.py) orders a saturated pool's queue by class, then by arrival (or predicted
cost). Inside a class that is first come, first served across tenants: a tenant that floods the queue puts
every other tenant of the class behind its backlog, and fills the queue so that their requests are shed.
With fairness on, each class is split into one flow per tenant, and the class serves its flows in
proportion to the tenants' weights, counted in tokens rather than requests (a 30k-token request is not one
unit of service like a 20-token one).

How: start-time fair queueing (SFQ; Goyal, Vin and Cheng, SIGCOMM 1996), per class, over flows whose own
order is the class's usual one (FIFO, or shortest-expected-first: each flow is a `_Fifo` or `_ByKey` of
router/traffic/admission.py):

- each tenant t has a finish tag F_t, the virtual time at which its last served request ends;
- the class has a virtual time V, the start tag of the last request it served;
- a flow's start tag is S_t = max(V, F_t); the class serves the head of the flow with the lowest S_t (ties:
  the head with the older admission key, so arrival order between tenants that are even);
- serving a request of predicted cost C (router/routing/cost.py, at least 1 token) sets V = S_t and
  F_t = S_t + C / weight_t.

What that guarantees. Two tenants with requests waiting receive service in proportion to their weights,
within one request's cost over weight of each other at any moment (SFQ's fairness bound). A tenant that
asks for less than its share is served as soon as a slot frees, with at most one request of each other
tenant ahead of it (its S_t is V: nobody is ahead in virtual time). A tenant that was idle earns no credit
(its S_t is V when it comes back, not its old F_t), so it cannot burst past the others afterwards. When the
class empties, V and every F_t start again from 0, so the tags stay small and nothing is kept for tenants
that have gone quiet.

Across classes nothing changes: a class competes with the admission key of its oldest request (its
`lead_key`: rank and ageing, router/traffic/admission.py), and when it wins it serves its fair head. Ageing,
deadlines and the eviction of lower classes work as before; when the queue is full, a newcomer may also
evict the newest request of the tenant of its own class with the largest backlog per weight, if that
backlog exceeds the newcomer's tenant's own (with the newcomer) — longest-queue drop, so a flooding tenant
loses its own requests rather than shutting the others out of the queue (`heavier_than`).

Cost per operation: O(tenants with requests waiting in the class) for `head` and `lead_key`, O(1) else (plus
the flow's own cost). Pure: no I/O, no clock (import-linter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

MIN_CHARGE = 1.0  # tokens: a request without an estimate still takes its turn


class FairWaiter(Protocol):
    tenant: str
    cost: float
    key: tuple[float, ...]


class Flow(Protocol):
    """One tenant's queue in the class's own order (router/traffic/admission.py's `_Fifo` or `_ByKey`)."""

    def push(self, waiter: Any, front: bool) -> None: ...
    def remove(self, waiter: Any) -> None: ...
    def head(self) -> Any: ...
    def last(self) -> Any: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Any]: ...


def charge(waiter: FairWaiter) -> float:
    return max(waiter.cost, MIN_CHARGE)


class FairClass:
    """One admission class as one flow per tenant, served by start-time fair queueing."""

    __slots__ = ("_make", "_weights", "_flows", "_finish", "_backlog", "vtime", "_len")

    def __init__(self, make_flow: Callable[[], Flow], weights: Mapping[str, float]) -> None:
        self._make = make_flow
        self._weights = weights  # tenant -> weight (> 0); a tenant not listed weighs 1
        self._flows: dict[str, Flow] = {}  # tenants with requests waiting
        self._finish: dict[str, float] = {}  # F_t
        self._backlog: dict[str, float] = {}  # tokens waiting, per tenant with a flow
        self.vtime = 0.0  # V
        self._len = 0

    def _weight(self, tenant: str) -> float:
        return self._weights.get(tenant, 1.0)

    def start_tag(self, tenant: str) -> float:
        return max(self.vtime, self._finish.get(tenant, 0.0))

    # ---- the queue interface admission uses -----------------------------------------------------------------

    def push(self, waiter: FairWaiter, front: bool) -> None:
        tenant = waiter.tenant
        flow = self._flows.get(tenant)
        if flow is None:
            flow = self._flows[tenant] = self._make()
            self._backlog[tenant] = 0.0
        flow.push(waiter, front)
        self._backlog[tenant] += charge(waiter)
        self._len += 1

    def remove(self, waiter: FairWaiter) -> None:
        tenant = waiter.tenant
        flow = self._flows[tenant]
        flow.remove(waiter)
        self._len -= 1
        if len(flow):
            self._backlog[tenant] -= charge(waiter)
        else:
            del self._flows[tenant], self._backlog[tenant]
        if not self._len:  # idle: start virtual time again (bounded numbers, nothing kept per tenant)
            self.vtime = 0.0
            self._finish.clear()

    def head(self) -> Any:
        """The request to serve next: the head of the flow with the lowest start tag."""
        best, best_rank = None, None
        for tenant, flow in self._flows.items():
            waiter = flow.head()
            rank = (self.start_tag(tenant), waiter.key)
            if best_rank is None or rank < best_rank:
                best, best_rank = waiter, rank
        assert best is not None, "head() of an empty class"
        return best

    def lead_key(self) -> tuple[float, ...]:
        """The class's place among the classes: its oldest request's admission key (rank and ageing)."""
        return min(flow.head().key for flow in self._flows.values())

    def served(self, waiter: FairWaiter) -> None:
        """`waiter` (already removed) goes to an endpoint: advance the virtual clocks by its cost."""
        tenant = waiter.tenant
        start = self.start_tag(tenant)
        self.vtime = start
        self._finish[tenant] = start + charge(waiter) / self._weight(tenant)

    def unserved(self, waiter: FairWaiter) -> None:
        """`waiter` was served but came back (its slot was taken): give its tenant the cost back."""
        tenant = waiter.tenant
        if tenant in self._finish:
            self._finish[tenant] -= charge(waiter) / self._weight(tenant)

    def last(self) -> Any:
        """The eviction victim of this class: the newest (or last in order) request of the tenant with the
        largest backlog per weight."""
        return self._flows[self._heaviest()].last()

    def heavier_than(self, tenant: str, cost: float) -> Any | None:
        """With the queue full, the request a newcomer of `tenant` (predicted cost `cost`) may evict from its own
        class: the last of the heaviest tenant's, if that tenant has more tokens waiting per weight than
        `tenant` would with the newcomer. None: the newcomer is the one to shed."""
        if not self._flows:
            return None
        heaviest = self._heaviest()
        if heaviest == tenant:
            return None
        mine = (self._backlog.get(tenant, 0.0) + max(cost, MIN_CHARGE)) / self._weight(tenant)
        if self._backlog[heaviest] / self._weight(heaviest) <= mine:
            return None
        return self._flows[heaviest].last()

    def _heaviest(self) -> str:
        return max(self._flows, key=lambda t: (self._backlog[t] / self._weight(t), self.start_tag(t)))

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Any]:
        for flow in list(self._flows.values()):
            yield from flow

    def tenants(self) -> dict[str, int]:
        """Requests waiting per tenant (the status page, tests)."""
        return {tenant: len(flow) for tenant, flow in self._flows.items()}
