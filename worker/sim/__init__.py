"""A calibrated simulated vLLM engine, so routing can be evaluated on machines with no GPU.

The core is pure Python with no I/O and no asyncio, and it runs in virtual time: `engine.EngineCore.step(now)`
schedules one engine iteration and says how long it took, and the caller owns the clock. The same core is
driven by `virtual.run_virtual` (a discrete-event loop for benchmarks and tests, thousands of simulated
seconds per real second) and by the HTTP server (real time, one asyncio task stepping the engine).

- `profiles`  per-GPU constants of the step-time model (shared/calibration/README.md), custom YAML profiles;
- `tokenizer` a deterministic stand-in tokenizer and chat template (shared text prefix = shared token prefix);
- `kv_cache`  the paged KV-cache block pool with automatic prefix caching (chained block hashes, LRU);
- `engine`    the scheduler: continuous batching with chunked prefill and preemption, or the older
              dynamic and static batching modes;
- `virtual`   the discrete-event driver.

docs/simulator.md describes the model, its sources and what it leaves out.
"""
