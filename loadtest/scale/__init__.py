"""Scale benchmarks: how fleetroute's costs grow with fleet size and request rate (issue 9).

    python -m loadtest.scale [--quick] [--parts micro,ingest,fleet] [--json PATH] [--markdown PATH] [--plots DIR]

Full run about 12 minutes on a quiet 2-core machine; `--quick` about 3 minutes (short rounds, fewer cases:
numbers are indicative only); `--parts` runs some of it. Raw results go to
loadtest/results/scale-<UTC time>.json (or `--json`); `python -m loadtest.scale.report RESULT.json
--markdown OUT.md --plots DIR` re-renders a saved run.

Three parts, one module each:

- `micro` (in this process, pinned to one core): what one `picker.pick`, one `Balancer.pick`, one
  `Balancer.rebuild()` and one telemetry refresh cost, per registered strategy, at 10, 100 and 1,000
  endpoints, on realistic inputs (`inputs`); and that a burst of n reports collapses into one rebuild.
- `ingest`: 1,000 simulated agents (`agents`) publishing at 1 Hz through our own Redis, one real router
  reading them: its CPU, Redis's CPU, rebuilds per second, telemetry age, staleness.
- `fleet`: a real router pinned to one core in front of zero-latency backends under open-loop load: CPU
  against request rate (10 endpoints) and against fleet size (10, 100, 1,000 endpoints), with telemetry
  off, embedded (the router scrapes every engine) and through Redis.

The router ships with hiredis (a base dependency), so redis-py parses replies in C; the ingestion table
says which parser the router found. `--hiredis-path DIR` (after `pip install --target DIR hiredis`) runs the
ingestion a second time with that directory on the router's path, for an environment without it.

`report` renders the JSON as Markdown tables (for docs/benchmarks.md) and PNG plots; `services` starts
and stops the processes. Every process started is stopped by PID in a `finally`; everything binds
127.0.0.1. On a shared machine each measurement records the CPU that other tenants took meanwhile
(`foreign_cpu_util`); the numbers are only as quiet as the machine.
"""
