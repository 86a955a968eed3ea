"""fleetroute router: a stateless, OpenAI-compatible routing proxy for GPU inference fleets."""

__version__ = "0.1.0"
