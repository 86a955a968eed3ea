"""The workers' reports: `feed` reads GPU and engine telemetry from Redis (or collects it in-process) and hands
it to the balancer."""
