"""Endpoint health: three independent inputs and a floor (STYLE.md rule 7).

- `active`: probes each endpoint's `/health` (and optionally a 1-token completion) on an interval;
- `gpu`: the agent's GPU telemetry (lost GPU, new XID or ECC errors, thermal throttling);
- `outlier`: passive ejection after consecutive failures of real requests, for a time that grows with
  repeated ejections, never more than `maxEjectionPercent` of a pool;
- `breaker`: a per-endpoint circuit breaker on the failure ratio (closed / open / half-open probes);
- `slow_start`: endpoints that join or come back ramp from a minimum weight to full over a window.

Each has a disabled form and they meet only in `pool.PoolHealth`, at snapshot build, which also applies
the floor: panic mode routes to every endpoint when too few are healthy (Envoy's panic threshold).

`stall` is the router's, not a policy's: each endpoint's requests in flight and their progress, which name
the engines silent past their stall threshold (router/server/rescue.py probes them, ejects the stalled ones
through each pool's outlier detector, and takes their requests elsewhere).
"""
