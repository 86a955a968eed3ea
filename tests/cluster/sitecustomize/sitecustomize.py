"""Cluster DNS for the processes that tests/cluster/ runs as pods (on their PYTHONPATH, so Python imports this
module at start-up). A pod's resolver asks the cluster DNS with the search list of its namespace
(`<ns>.svc.cluster.local svc.cluster.local cluster.local`, ndots 5); /etc/hosts is the machine's, so the
names are mapped here instead, from the JSON table of FQDNs -> ClusterIPs at $FLEETROUTE_TEST_CLUSTER_DNS
(re-read when it changes), in every resolver a Python process uses: `socket.getaddrinfo` (asyncio,
aiohttp's threaded resolver, redis-py), `socket.gethostbyname`, and uvloop's loop, whose resolver is libuv's
own C code (`getaddrinfo` and `create_connection` are resolved first). Names the table does not know go to
the machine's resolver unchanged.
"""

import json
import os
import socket

_TABLE = os.environ.get("FLEETROUTE_TEST_CLUSTER_DNS")
_SEARCH = os.environ.get("FLEETROUTE_TEST_CLUSTER_SEARCH", "").split()
_cache = {"mtime": None, "table": {}}


def _table():
    try:
        mtime = os.stat(_TABLE).st_mtime_ns
        if mtime != _cache["mtime"]:
            with open(_TABLE, encoding="utf-8") as fh:
                _cache["table"], _cache["mtime"] = json.load(fh), mtime
    except (OSError, ValueError):
        pass
    return _cache["table"]


def cluster_ip(host):
    """The address of a Service name as the pod's resolver finds it (search list first: ndots 5), or None."""
    if not isinstance(host, str) or not host:
        return None
    table, name = _table(), host.rstrip(".")
    if host.endswith("."):
        return table.get(name)
    candidates = [f"{name}.{suffix}" for suffix in _SEARCH] if name.count(".") < 5 else []
    for candidate in (*candidates, name):
        if candidate in table:
            return table[candidate]
    return None


if _TABLE:
    _getaddrinfo, _gethostbyname = socket.getaddrinfo, socket.gethostbyname

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):  # noqa: A002 - socket's own names
        return _getaddrinfo(cluster_ip(host) or host, port, family, type, proto, flags)

    def gethostbyname(host):
        return cluster_ip(host) or _gethostbyname(host)

    socket.getaddrinfo, socket.gethostbyname = getaddrinfo, gethostbyname

    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        class _ClusterDnsLoop(uvloop.Loop):
            async def getaddrinfo(self, host, *args, **kwargs):
                return await super().getaddrinfo(cluster_ip(host) or host, *args, **kwargs)

            async def create_connection(self, protocol_factory, host=None, *args, **kwargs):
                return await super().create_connection(protocol_factory, cluster_ip(host) or host, *args, **kwargs)

        uvloop.Loop = _ClusterDnsLoop  # uvloop.new_event_loop() builds `Loop()`, looked up when called
