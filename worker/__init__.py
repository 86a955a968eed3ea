"""fleetroute worker side: the telemetry agent that runs beside each engine (arrives with the agent issue)."""
