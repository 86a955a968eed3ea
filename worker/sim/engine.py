"""The simulated engine's core: vLLM's scheduler over a paged KV cache, priced by a GPU profile.

`EngineCore.step(now)` plans one iteration, applies it and returns how long it took; it owns no clock
(the caller advances time by `duration`: the virtual driver instantly, the HTTP server by sleeping), so
the same code serves benchmarks in virtual time and live servers. No I/O, no asyncio; randomness (the
per-step jitter) comes from the injected `random.Random`, so a seed makes a run repeatable.

Continuous batching (the default) follows vLLM V1's scheduler:

1. a token budget of `max_num_batched_tokens` per step;
2. running requests that are decoding get one token each, first, so a long prompt never stalls them;
   a decode that crosses into a new KV block takes a fresh one, and when none is free the most recently
   admitted running request is preempted (recompute: its blocks are freed and it goes back to the front
   of the waiting queue, to be prefilled again, prompt and generated tokens, when readmitted);
3. running requests part-way through their prefill get the next chunk that fits the remaining budget
   (chunked prefill: a long prompt is prefilled over several steps, interleaved with decodes);
4. then waiting requests are admitted first-come-first-served while the budget lasts and fewer than
   `max_num_seqs` run: admission needs ceil((tokens + 1) / block_size) blocks after counting prefix-cache
   hits, and the head of the queue blocks the rest (no skipping). A request preempted in this step is
   that head and cannot fit again at once (the preemptor took one of its blocks), so vLLM's rule of not
   admitting in a step that preempted holds without being written down.

A request whose prefill completes in a step emits its first token at the end of that step; every later
step emits one token, until exactly `max_tokens` (ignore_eos: the caller picks the output length).

LoRA adapters (`max_loras` > 0) follow vLLM too: a step's batch holds requests of at most `max_loras`
distinct adapters (a waiting request whose adapter would exceed that is skipped, and the queue behind it is
still considered; it goes back to the front), each adapter in one of `max_loras` GPU slots, and a step that
activates an adapter not already in a slot pays `lora_load_s` for it (evicting the least recently used).

"dynamic" and "static" are the older request-level modes the field moved away from: a batch is formed
only when the previous one has completely finished, and it then runs to completion with no admissions.
Dynamic takes whatever is waiting (up to `dynamic_max_batch`) as soon as the engine is free; static also
waits until `static_batch_size` requests are queued or the oldest has waited `static_window_s`. Within a
batch, steps are scheduled exactly as above, and finished sequences cost nothing (no padding), so the
comparison with continuous batching isolates scheduling and flatters the older modes slightly.
"""

from __future__ import annotations

import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from worker.sim.kv_cache import KVCache
from worker.sim.profiles import GpuProfile

BATCHING_MODES = ("continuous", "dynamic", "static")


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    batching: str = "continuous"
    static_batch_size: int = 32
    static_window_s: float = 0.05
    dynamic_max_batch: int | None = None  # None: max_num_seqs
    enable_prefix_caching: bool = True
    # LoRA (vLLM's --enable-lora): at most `max_loras` distinct adapters in one batch, each held in one of
    # `max_loras` GPU slots; activating an adapter that is not in a slot (evicting the least recently used)
    # adds `lora_load_s` to that step. 0 = LoRA off.
    max_loras: int = 0
    lora_load_s: float = 0.02

    def __post_init__(self) -> None:
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching: must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "static_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.dynamic_max_batch is not None and (
            isinstance(self.dynamic_max_batch, bool) or not isinstance(self.dynamic_max_batch, int)
            or self.dynamic_max_batch < 1
        ):
            raise ValueError(f"dynamic_max_batch: must be an integer >= 1 or null, got {self.dynamic_max_batch!r}")
        if not isinstance(self.static_window_s, int | float) or self.static_window_s < 0:
            raise ValueError(f"static_window_s: must be a number >= 0, got {self.static_window_s!r}")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras: must be an integer >= 0, got {self.max_loras!r}")
        if not isinstance(self.lora_load_s, int | float) or self.lora_load_s < 0:
            raise ValueError(f"lora_load_s: must be a number >= 0, got {self.lora_load_s!r}")

    @property
    def batch_limit(self) -> int:
        """The most requests one batch takes in the dynamic and static modes."""
        limit = self.static_batch_size if self.batching == "static" else (self.dynamic_max_batch or self.max_num_seqs)
        return min(limit, self.max_num_seqs)


@dataclass(eq=False, slots=True)
class SimRequest:
    """One generation request; the engine fills in the fields below `arrival` as it runs."""

    request_id: str
    prompt_tokens: list[int] = field(repr=False)
    max_tokens: int
    arrival: float
    lora: str | None = None  # the LoRA adapter the request names, None for the base model
    first_token_at: float | None = field(default=None, init=False)
    token_times: list[float] = field(default_factory=list, init=False, repr=False)
    num_generated: int = field(default=0, init=False)
    cached_tokens: int = field(default=0, init=False)  # prompt tokens served from the prefix cache, last admission
    preemptions: int = field(default=0, init=False)
    finished_at: float | None = field(default=None, init=False)
    aborted: bool = field(default=False, init=False)
    # Engine-private state (vLLM keeps the same on its Request).
    _computed: int = field(default=0, init=False, repr=False)  # tokens whose KV is computed
    _blocks: list[int] = field(default_factory=list, init=False, repr=False)
    _hashes: list[int] | None = field(default=None, init=False, repr=False)  # prompt block hashes
    _registered: int = field(default=0, init=False, repr=False)  # leading blocks registered in the cache

    def __post_init__(self) -> None:
        if not self.prompt_tokens:
            raise ValueError(f"request {self.request_id}: the prompt must have at least one token")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens must be an integer >= 1, got {self.max_tokens!r}")

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def _pending(self) -> int:
        """Tokens still to compute before the next output token: the (re)prefill, or 1 when decoding."""
        return len(self.prompt_tokens) + self.num_generated - self._computed

    @property
    def _decoding(self) -> bool:
        return self.num_generated > 0 and self._pending == 1


@dataclass
class StepResult:
    start: float
    duration: float  # simulated seconds, jitter included; for an idle step, how long to wait
    emitted: list[SimRequest]  # each produced one token at start + duration
    finished: list[SimRequest]
    num_prefill_tokens: int
    num_decode_seqs: int
    idle: bool


class EngineCore:
    def __init__(self, profile: GpuProfile, config: EngineConfig, rng: random.Random) -> None:
        self.profile = profile
        self.config = config
        self._rng = rng
        num_blocks = profile.kv_pool_tokens // config.block_size
        self._kv = KVCache(num_blocks, config.block_size, config.enable_prefix_caching)
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []  # in admission order: the last is the first to be preempted
        self._live: dict[str, SimRequest] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.busy_time = 0.0
        self.step_count = 0
        self._lora_slots: OrderedDict[str, None] = OrderedDict()  # GPU-resident adapters, least recent first
        self.lora_loads = 0

    # -- read-only state ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache(self) -> KVCache:
        return self._kv

    @property
    def kv_usage(self) -> float:
        return self._kv.usage

    @property
    def num_gpu_blocks(self) -> int:
        return self._kv.num_blocks

    @property
    def max_model_len(self) -> int:
        """The longest prompt + max_tokens a request may ask for: what the whole KV pool holds."""
        return self._kv.num_blocks * self._kv.block_size

    def lora_requests(self) -> tuple[Counter[str], Counter[str]]:
        """Requests per adapter, running and waiting: what vLLM's `vllm:lora_requests_info` names."""
        return (Counter(r.lora for r in self._running if r.lora is not None),
                Counter(r.lora for r in self._waiting if r.lora is not None))

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    # -- requests -------------------------------------------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        if req.request_id in self._live:
            raise ValueError(f"request {req.request_id}: already in the engine")
        total = len(req.prompt_tokens) + req.max_tokens
        if total > self.max_model_len:
            # It could never be admitted, or would preempt itself forever: vLLM rejects it up front too.
            raise ValueError(
                f"request {req.request_id}: prompt ({len(req.prompt_tokens)}) + max_tokens ({req.max_tokens}) "
                f"= {total} tokens exceeds the KV cache ({self.max_model_len} tokens)"
            )
        if req.lora is not None and self.config.max_loras == 0:
            raise ValueError(f"request {req.request_id}: LoRA adapter {req.lora!r} asked of an engine without LoRA")
        self._live[req.request_id] = req
        self._waiting.append(req)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks; unknown or finished ids are ignored."""
        req = self._live.pop(request_id, None)
        if req is None:
            return
        req.aborted = True
        if req._blocks:
            self._running.remove(req)
            self._release(req)
        else:
            self._waiting.remove(req)

    # -- one iteration -------------------------------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        if not self.has_work():
            return StepResult(now, 0.0, [], [], 0, 0, idle=True)
        budget = self.config.max_num_batched_tokens
        decodes: list[SimRequest] = []
        prefills: list[tuple[SimRequest, int]] = []

        # Decodes first. Victims are taken from the tail, after the current index, or the request itself.
        i = 0
        while i < len(self._running) and budget > 0:
            req = self._running[i]
            if req._decoding:
                if len(req._blocks) * self._kv.block_size <= req._computed and not self._grow_or_preempt(req):
                    break
                decodes.append(req)
                budget -= 1
            i += 1

        # Then the next chunk of prefills already under way, then admissions.
        budget = self._schedule_prefills(self._running, budget, prefills)
        wait = self._admit(now, budget, prefills)
        if wait is not None:
            return StepResult(now, wait, [], [], 0, 0, idle=True)
        if not decodes and not prefills:
            return StepResult(now, 0.0, [], [], 0, 0, idle=True)
        return self._execute(now, decodes, prefills)

    def _schedule_prefills(self, reqs: list[SimRequest], budget: int, out: list[tuple[SimRequest, int]]) -> int:
        for req in reqs:
            if budget <= 0:
                break
            if req._decoding:
                continue  # decoding: scheduled (or not) by the decode pass
            n = min(req._pending, budget)
            out.append((req, n))
            budget -= n
        return budget

    def _admit(self, now: float, budget: int, prefills: list[tuple[SimRequest, int]]) -> float | None:
        """Admit waiting requests per the batching mode; returns the time to wait, when the mode says wait."""
        cfg = self.config
        if cfg.batching == "continuous":
            loras = {r.lora for r in self._running if r.lora is not None}
            skipped: list[SimRequest] = []
            while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
                req = self._waiting[0]
                if req.lora is not None and req.lora not in loras and len(loras) >= cfg.max_loras:
                    skipped.append(self._waiting.popleft())  # its adapter would exceed max_loras: not now
                    continue
                if not self._try_allocate(req):
                    break
                self._waiting.popleft()
                self._running.append(req)
                if req.lora is not None:
                    loras.add(req.lora)
                n = min(req._pending, budget)
                prefills.append((req, n))
                budget -= n
            self._waiting.extendleft(reversed(skipped))
            return None
        if self._running or not self._waiting:
            return None  # the current batch runs to completion
        limit = cfg.batch_limit
        if cfg.batching == "static" and len(self._waiting) < limit:
            deadline = self._waiting[0].arrival + cfg.static_window_s
            if now < deadline:
                return deadline - now
        batch: list[SimRequest] = []
        loras: set[str] = set()
        while self._waiting and len(batch) < limit:
            head = self._waiting[0]
            if head.lora is not None and head.lora not in loras and len(loras) >= cfg.max_loras:
                break  # the batch has its adapters: the rest waits for the next one
            if not self._try_allocate(head):
                break
            batch.append(self._waiting.popleft())
            if head.lora is not None:
                loras.add(head.lora)
        self._running.extend(batch)
        self._schedule_prefills(batch, budget, prefills)
        return None

    def _try_allocate(self, req: SimRequest) -> bool:
        """Give `req` its blocks for admission, reusing prefix-cache hits; False if they do not fit."""
        kv = self._kv
        bs = kv.block_size
        num_tokens = len(req.prompt_tokens) + req.num_generated
        cached: list[int] = []
        if kv.prefix_caching:
            if req._hashes is None:
                req._hashes = kv.block_hashes(req.prompt_tokens)
            # Only prompt tokens have ids to hash, and at least one token must be computed to sample from.
            max_hit = min(len(req.prompt_tokens), num_tokens - 1) // bs
            cached = kv.find_cached(req._hashes[:max_hit])
        blocks = kv.allocate(cached, -(-(num_tokens + 1) // bs) - len(cached))
        if blocks is None:
            return False
        req._blocks = blocks
        req._computed = len(cached) * bs
        req._registered = len(cached)
        req.cached_tokens = req._computed
        if kv.prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += req.cached_tokens
        return True

    def _grow_or_preempt(self, req: SimRequest) -> bool:
        """One more block for decoding `req`, preempting from the tail until one is free; False if `req` went."""
        while not self._kv.grow(req._blocks):
            victim = self._running.pop()
            self._release(victim)  # recompute: readmission resets its progress (`_try_allocate`)
            victim.preemptions += 1
            self.num_preemptions += 1
            self._waiting.appendleft(victim)
            if victim is req:
                return False
        return True

    def _activate_loras(self, wanted: set[str | None]) -> float:
        """Put the step's adapters in GPU slots; the time it takes to load those that were not there. The step's
        adapters already in a slot are marked used first, so loading another never evicts one the step needs;
        the rest load in name order (a seeded run does not depend on set order)."""
        needed = sorted(name for name in wanted if name is not None)
        for name in needed:
            if name in self._lora_slots:
                self._lora_slots.move_to_end(name)
        missing = [name for name in needed if name not in self._lora_slots]
        for name in missing:
            if len(self._lora_slots) >= self.config.max_loras:
                self._lora_slots.popitem(last=False)  # least recently used: never one of this step's
            self._lora_slots[name] = None
        self.lora_loads += len(missing)
        return len(missing) * self.config.lora_load_s

    def _release(self, req: SimRequest) -> None:
        self._kv.free(req._blocks)
        req._blocks = []

    def _execute(self, now: float, decodes: list[SimRequest], prefills: list[tuple[SimRequest, int]]) -> StepResult:
        prefill_tokens = sum(n for _, n in prefills)
        decode_ctx = sum(r._computed + 1 for r in decodes)
        pairs = sum(n * (r._computed + n / 2) for r, n in prefills)
        ms = self.profile.step_time_ms(prefill_tokens + len(decodes), len(decodes) + len(prefills), decode_ctx, pairs)
        sigma = self.profile.jitter
        duration = ms / 1000.0 * (self._rng.lognormvariate(0.0, sigma) if sigma else 1.0)
        duration += self._activate_loras({r.lora for r in decodes} | {r.lora for r, _ in prefills})
        end = now + duration

        emitted: list[SimRequest] = []
        bs = self._kv.block_size
        for req in decodes:
            req._computed += 1
            emitted.append(req)
        for req, n in prefills:
            req._computed += n
            if req._hashes is not None:
                full = min(req._computed, len(req.prompt_tokens)) // bs
                if full > req._registered:
                    self._kv.register(req._blocks, req._hashes, req._registered, full, req.prompt_tokens)
                    req._registered = full
            if req._pending == 0:
                emitted.append(req)

        finished: list[SimRequest] = []
        for req in emitted:
            if req.first_token_at is None:
                req.first_token_at = end
                self.prompt_tokens_total += len(req.prompt_tokens)
            req.num_generated += 1
            req.token_times.append(end)
            if req.num_generated == req.max_tokens:
                req.finished_at = end
                self._release(req)
                del self._live[req.request_id]
                finished.append(req)
        if finished:
            self._running = [r for r in self._running if r.finished_at is None]
        self.generation_tokens_total += len(emitted)
        self.busy_time += duration
        self.step_count += 1
        return StepResult(now, duration, emitted, finished, prefill_tokens, len(decodes), idle=False)
