"""Cluster DNS for the processes that tests/cluster/ runs as pods (on their PYTHONPATH, so Python imports this
module at start-up). A pod's resolver asks the cluster DNS with the search list of its namespace
(`<ns>.svc.cluster.local svc.cluster.local cluster.local`, ndots 5); /etc/hosts is the machine's, so the
names are mapped here instead, from the JSON table of FQDNs -> ClusterIPs at $FLEETROUTE_TEST_CLUSTER_DNS
(re-read when it changes), in every resolver a Python process uses: `socket.getaddrinfo` (asyncio,
aiohttp's threaded resolver, redis-py), `socket.gethostbyname`, and uvloop's loop, whose resolver is libuv's
own C code (`getaddrinfo` and `create_connection` are resolved first). Names the table does not know go to
the machine's resolver unchanged.

And the pod's network identity (tests/cluster/policies.py): with $FLEETROUTE_TEST_POD_IP set, every outgoing
TCP socket is bound to the pod's address before it connects (a pod's connections come from its own address),
and a connection the NetworkPolicies at $FLEETROUTE_TEST_CLUSTER_NETPOL do not allow is refused
(ECONNREFUSED, the reason appended to the table's `.denied` file) before it is made: in `socket.connect`
(the standard event loop, redis-py, anything synchronous) and uvloop's `create_connection`.
"""

import errno
import ipaddress
import json
import os
import socket

try:
    import uvloop
except ImportError:
    uvloop = None

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

    if uvloop is not None:
        class _ClusterDnsLoop(uvloop.Loop):
            async def getaddrinfo(self, host, *args, **kwargs):
                return await super().getaddrinfo(cluster_ip(host) or host, *args, **kwargs)

            async def create_connection(self, protocol_factory, host=None, *args, **kwargs):
                return await super().create_connection(protocol_factory, cluster_ip(host) or host, *args, **kwargs)

        uvloop.Loop = _ClusterDnsLoop  # uvloop.new_event_loop() builds `Loop()`, looked up when called


_POD_IP = os.environ.get("FLEETROUTE_TEST_POD_IP")
_POLICIES = os.environ.get("FLEETROUTE_TEST_CLUSTER_NETPOL")
_policy_cache = {"mtime": None, "table": None}


def _policy_table():
    try:
        mtime = os.stat(_POLICIES).st_mtime_ns
        if mtime != _policy_cache["mtime"]:
            with open(_POLICIES, encoding="utf-8") as fh:
                _policy_cache["table"], _policy_cache["mtime"] = json.load(fh), mtime
    except (OSError, ValueError):
        pass
    return _policy_cache["table"]


def _ipv4(host):
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv4Address)
    except ValueError:
        return False


def police(host, port):
    """Refuse a connection to host:port that no NetworkPolicy allows from this pod."""
    table = _policy_table()
    if table is None or not _ipv4(host):
        return
    from tests.cluster.policies import refusal  # here: only pods that connect somewhere pay for the import

    why = refusal(table, _POD_IP, host, int(port))
    if why is not None:
        try:
            with open(_POLICIES[:-len(".json")] + ".denied", "a", encoding="utf-8") as fh:
                fh.write(why + "\n")
        except OSError:
            pass
        raise ConnectionRefusedError(errno.ECONNREFUSED, why)


if _POD_IP:
    _connect, _connect_ex = socket.socket.connect, socket.socket.connect_ex

    def _as_the_pod(sock, address):
        if sock.family != socket.AF_INET or sock.type != socket.SOCK_STREAM or not isinstance(address, tuple):
            return
        if sock.getsockname()[0] == "0.0.0.0" and _ipv4(address[0]) and address[0].startswith("127."):
            sock.bind((_POD_IP, 0))
        police(address[0], address[1])

    def connect(self, address):
        _as_the_pod(self, address)
        return _connect(self, address)

    def connect_ex(self, address):
        try:
            _as_the_pod(self, address)
        except ConnectionRefusedError:
            return errno.ECONNREFUSED
        return _connect_ex(self, address)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex

    if uvloop is not None:
        class _PodLoop(uvloop.Loop):
            async def create_connection(self, protocol_factory, host=None, port=None, *args, **kwargs):
                address = cluster_ip(host) or host
                if kwargs.get("sock") is None and _ipv4(address) and address.startswith("127."):
                    kwargs.setdefault("local_addr", (_POD_IP, 0))
                    police(address, port)
                return await super().create_connection(protocol_factory, host, port, *args, **kwargs)

        uvloop.Loop = _PodLoop
