"""What every layer runs on, and what worker/ may share: Prometheus collectors (`metrics`), structured logs
(`logs`), Redis (`redis_client`, `redis_input`), background tasks (`background`), the event loop (`loop`),
progress lines (`progress`) and the OpenAI error shape (`errors`). It imports nothing of the router above
router.config."""
