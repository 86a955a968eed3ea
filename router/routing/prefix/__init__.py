"""Prefix routing's state, beside the prefix-aware policy (router/routing/policies/prefix_aware.py):
`index` (which endpoint holds which prompt blocks), `tuning`, `sharing` (the index across replicas through
Redis), `upkeep` (its periodic trimming), `prompt` (a request's prompt as block hashes), `kv_block_index` and
`kv_events` (the engines' own KV-cache events)."""
