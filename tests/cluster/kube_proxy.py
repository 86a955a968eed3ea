"""kube-proxy for the test: each Service port on its ClusterIP forwards each TCP connection to one endpoint of
the Service's EndpointSlices, chosen at random (iptables mode's per-connection pick), as a byte pipe.

NetworkPolicies (tests/cluster/policies.py): the connection from the client's address to the endpoint picked
must be allowed, else it is reset; the connection to the endpoint is made from the client's address, as
iptables' translation keeps the source of a connection from a pod.

Endpoints are those with `ready` true; when a Service has none, the `serving` and `terminating` ones (the
fallback of KEP-1669, GA in 1.28). A connection stays on its endpoint for its lifetime, as conntrack keeps
it, even after the endpoint leaves the slice; with no endpoint at all the connection is reset, where
iptables would reject it. Ports resolve by the slice port's name (the Service port's). A Service port below
1024 that this process may not bind (not root) is bound on a free port instead, logged; the tests reach
Services through `address()`, never a fixed port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
from typing import Any

from tests.cluster.policies import PolicyTable
from tests.fake_kube import FakeKube

log = logging.getLogger("tests.cluster.kube_proxy")


class KubeProxy:
    def __init__(self, kube: FakeKube, policies: PolicyTable, *, seed: int = 0) -> None:
        self.kube, self.policies = kube, policies
        self.rng = random.Random(seed)
        self.servers: dict[tuple[str, str, str], tuple[asyncio.AbstractServer, int]] = {}  # (ns, svc, port name)
        self._pipes: set[asyncio.Task[None]] = set()
        self.connections: dict[str, int] = {}  # endpoint address -> connections forwarded

    async def sync(self) -> None:
        wanted = {}
        for svc in self.kube.list("services"):
            ip = svc["spec"].get("clusterIP")
            if not ip or ip == "None":
                continue
            for port in svc["spec"].get("ports") or ():
                wanted[(svc["metadata"]["namespace"], svc["metadata"]["name"], port.get("name", ""))] = (ip, port["port"])
        for key in [k for k in self.servers if k not in wanted]:
            server, _ = self.servers.pop(key)
            server.close()
        for key, (ip, port) in wanted.items():
            if key not in self.servers:
                self.servers[key] = await self._listen(key, ip, port)

    async def _listen(self, key: tuple[str, str, str], ip: str, port: int) -> tuple[asyncio.AbstractServer, int]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._pipes.add(task)
            try:
                await self._forward(key, reader, writer)
            finally:
                self._pipes.discard(task)
        try:
            server = await asyncio.start_server(handle, ip, port)
        except PermissionError:
            server = await asyncio.start_server(handle, ip, 0)
            log.warning("service %s/%s port %s: cannot bind %s:%s here; serving it on port %s", key[0], key[1],
                        key[2], ip, port, server.sockets[0].getsockname()[1])
        return server, server.sockets[0].getsockname()[1]

    def address(self, namespace: str, service: str, port_name: str = "") -> tuple[str, int]:
        server, port = self.servers[(namespace, service, port_name)]
        return server.sockets[0].getsockname()[0], port

    def endpoints(self, namespace: str, service: str, port_name: str) -> list[tuple[str, int]]:
        ready, fallback = [], []
        for s in self.kube.list("endpointslices", namespace, f"kubernetes.io/service-name={service}"):
            port = next((p["port"] for p in s.get("ports") or () if p.get("name", "") == port_name), None)
            if port is None:
                continue
            for e in s.get("endpoints") or ():
                c = e.get("conditions") or {}
                target = [(a, port) for a in e["addresses"]]
                if c.get("ready") is not False:
                    ready += target
                elif c.get("serving") and c.get("terminating"):
                    fallback += target
        return ready or fallback

    async def _forward(self, key: tuple[str, str, str], reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> None:
        endpoints = self.endpoints(*key)
        upstream_writer = None
        try:
            if not endpoints:
                _reset(writer)
                return
            ip, port = self.rng.choice(endpoints)
            source = writer.get_extra_info("peername")[0]
            why = self.policies.refusal(source, ip, port)
            if why is not None:
                log.warning("service %s/%s port %s: %s; connection reset", key[0], key[1], key[2], why)
                _reset(writer)
                return
            self.connections[ip] = self.connections.get(ip, 0) + 1
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(ip, port, local_addr=(source, 0))
            except OSError:
                _reset(writer)
                return
            await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
        finally:
            for w in (writer, upstream_writer):
                if w is not None:
                    w.close()

    async def close(self) -> None:
        for server, _ in self.servers.values():
            server.close()
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        for server, _ in self.servers.values():
            with contextlib.suppress(Exception):
                await server.wait_closed()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # a half-close passes through, as it does through NAT
    except (ConnectionError, OSError):
        _reset(writer)


def _reset(writer: asyncio.StreamWriter) -> None:
    sock: Any = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
    writer.close()
