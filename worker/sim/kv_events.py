"""The simulator's KV-cache event publisher: vLLM's `ZmqEventPublisher`, same wire, same socket rules.

After each engine step that changed the paged KV cache (worker/sim/kv_cache.py), one `EventBatch` goes out
as three frames: the topic, the sequence number (8 bytes big-endian, from 0 at start-up) and the msgpack
payload `[ts, [event, ...], data_parallel_rank]`, each event a map tagged by `"type"` (`BlockStored` with
block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium "GPU", lora_name; `BlockRemoved` with
block_hashes and medium; `AllBlocksCleared`), exactly as msgspec encodes vLLM's structs. Hashes are the
simulator's chained ints (vLLM's `builtin` hash kind publishes ints too).

Sockets, as vLLM: the PUB socket binds for a wildcard (`tcp://*:PORT`), ipc or inproc endpoint and connects
for any other (`tcp://127.0.0.1:PORT`: then the subscriber binds). With a replay endpoint, a ROUTER socket
bound there answers (b"", start seq) with every buffered batch from that sequence on, each as (b"", topic,
seq, payload), then (b"", b"", seq -1, b""); the last `buffer` batches are kept.

Sends never block the engine loop: PUB drops messages to a slow subscriber at its high-water mark, which the
subscriber sees as a sequence gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    endpoint: str  # vLLM's `endpoint`
    topic: str = ""
    replay_endpoint: str | None = None
    buffer: int = 10000  # vLLM's `buffer_steps`


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return endpoint.startswith(("ipc://", "inproc://")) or endpoint.startswith("tcp://*")


def encode_events(events: list[tuple[Any, ...]], block_size: int, ts: float) -> bytes:
    out: list[dict[str, Any]] = []
    for event in events:
        if event[0] == "stored":
            _, hashes, parent, tokens = event
            out.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                        "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": "GPU",
                        "lora_name": None})
        elif event[0] == "removed":
            out.append({"type": "BlockRemoved", "block_hashes": event[1], "medium": "GPU"})
        else:
            out.append({"type": "AllBlocksCleared"})
    return msgspec.msgpack.encode([ts, out, 0])


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        (self.pub.bind if is_bind_endpoint(config.endpoint) else self.pub.connect)(config.endpoint)
        self.replay = None
        if config.replay_endpoint is not None:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(config.replay_endpoint)
        self.topic = config.topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer)
        self.skip = 0  # tests: drop the next n batches unsent (they stay numbered and replayable), a lost message
        self._task = asyncio.create_task(self._serve_replay(), name="sim-kv-replay") if self.replay else None

    def publish(self, events: list[tuple[Any, ...]], block_size: int) -> None:
        if not events:
            return
        payload = encode_events(events, block_size, time.time())
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if self.skip:
            self.skip -= 1
            return
        with contextlib.suppress(zmq.Again):
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self.replay is not None
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
            await self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
        self.ctx.term()
