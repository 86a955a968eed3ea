"""The KV-event ingestion benchmark (loadtest/kv_ingest.py), run tiny: real ZMQ sockets on 127.0.0.1, the
router's subscriber in its own process, every event sent applied and accounted for."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import kv_ingest
from router.routing.prefix.kv_block_index import KVBlockIndex
from router.routing.prefix.kv_events import decode_batch
from worker.sim.kv_events import encode_events


def test_a_quick_run_applies_every_event_the_engines_sent_and_reports_its_cost(tmp_path: Path) -> None:
    out = tmp_path / "kv-ingest.json"
    assert kv_ingest.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["benchmark"] == "kv-ingest" and result["sizes"] == [3]
    (run,) = result["runs"]
    offered, ingest = run["offered"], run["ingest"]
    assert run["engines"] == 3 and offered["stored_blocks"] > 0 and offered["removed_blocks"] > 0
    # Everything the engines sent was applied: the same block counts, no gap, no orphan, every engine precise.
    assert ingest["batches_applied"] == offered["batches"] > 0
    assert ingest["stored_applied"] == offered["stored_blocks"]
    assert ingest["removed_applied"] == offered["removed_blocks"]
    assert ingest["all_applied"] is True and ingest["precise_engines"] == 3
    # Each engine holds its last `cache_blocks` blocks, as the publisher evicted the rest.
    assert ingest["blocks_held"] == 3 * result["settings"]["cache_blocks"]
    assert ingest["cpu_s"] > 0 and ingest["cpu_us_per_block_event"] > 0 and ingest["lag_s"]["samples"] > 0
    assert 50 < result["memory"]["index_bytes_per_block"] < 5000
    table = kv_ingest.render_markdown(result)
    assert "| 3 |" in table and "| all |" in table


def test_the_engine_model_sends_chained_runs_whose_blocks_the_index_keys_and_evicts() -> None:
    load = kv_ingest.Load(engines=1, tokens_per_s=16 * 50, step=1.0, cache_blocks=120, prompt_blocks=64)
    gen = kv_ingest.EngineEvents(5, load)
    index = KVBlockIndex()
    for _ in range(4):  # 200 blocks made, the oldest 80 evicted
        index.apply("e", decode_batch(encode_events(gen.step(), 16, 0.0)))
    assert (gen.stored, gen.removed) == (200, 80)
    assert index.size("e") == 120 and index.engines["e"].orphans == 0
