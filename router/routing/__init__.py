"""How an endpoint is chosen, and nothing about how bytes move: pure of the serving layer.

`balancer` owns the immutable snapshot and pickers per policy and rebuilds them on change; `policies/` are
the strategies (one module each, registered in `policies/registry.py`); `loads` and `shared_loads` count
in-flight work (locally, and across router replicas through Redis); `cost`, `output_tokens` and `prefill`
predict what a request costs; `sticky` pins sessions; `departures` frees what was kept for an endpoint that
left; `prefix/` is prefix-aware routing's state (the block index, its tuning, sharing and upkeep, prompt
hashing and the engines' KV events).
"""
