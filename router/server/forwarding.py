"""Who the client is, and the forwarding headers an engine receives: the trusted-proxy rule.

A forwarding header is only as trustworthy as whoever wrote it. The router believes `X-Forwarded-*` only
from peers listed in `listen.trustedProxies` (an ingress controller, a cloud load balancer), as nginx's
`set_real_ip_from` + `real_ip_recursive` and Envoy's `xff_num_trusted_hops` do:

- From any other peer (and from every peer when the list is empty, the default), every forwarding header
  the client sent (`X-Forwarded-For`, `-Proto`, `-Host`, `-Port`, `Forwarded`, `X-Real-IP`) is dropped, and
  the engine receives `X-Forwarded-For: <peer>` and `X-Forwarded-Proto: <the router's own scheme>`.
- From a trusted peer its headers are kept: `X-Forwarded-For` gets the peer appended (what every proxy
  does), `X-Forwarded-Proto` stays (the proxy terminated TLS) or is set when absent.
- The client (the access log's `client`) is the peer, or, behind trusted proxies, the right-most
  `X-Forwarded-For` address that is not itself a trusted proxy: the addresses left of it were written by the
  client and prove nothing. A malformed entry ends the walk at the last trusted hop.

Routing never depends on these headers (the upstream URL is always the endpoint's own).
"""

from __future__ import annotations

import ipaddress

from aiohttp import web
from multidict import CIMultiDict

from router.config.settings import IPNetwork

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
FORWARDING_HEADERS = ("X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host", "X-Forwarded-Port", "Forwarded",
                      "X-Real-IP")
MAX_HOPS = 32  # X-Forwarded-For entries walked: the chain is client-supplied and could be huge


def parse_ip(text: str) -> IPAddress | None:
    """An address as peers and X-Forwarded-For write it (`192.0.2.7`, `2001:db8::1`, `[2001:db8::1]:443`,
    `192.0.2.7:5678`), IPv4-mapped IPv6 as IPv4; None if it is not one."""
    text = text.strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class Forwarding:
    def __init__(self, trusted: tuple[IPNetwork, ...] = ()) -> None:
        self._trusted = trusted

    def trusts(self, address: IPAddress | str | None) -> bool:
        if not self._trusted or address is None:
            return False
        if isinstance(address, str):
            address = parse_ip(address)
            if address is None:
                return False
        return any(address in network for network in self._trusted)

    def client(self, request: web.BaseRequest) -> str:
        """The client's address: the peer, or behind trusted proxies the nearest untrusted X-Forwarded-For hop."""
        peer = request.remote or ""
        if not self._trusted or not self.trusts(peer):
            return peer
        hops = [hop for value in request.headers.getall("X-Forwarded-For", ()) for hop in value.split(",")]
        nearest = peer
        for hop in reversed(hops[-MAX_HOPS:]):
            address = parse_ip(hop)
            if address is None:
                break  # malformed: what lies left of it cannot be attributed to anyone
            nearest = str(address)
            if not self.trusts(address):
                break
        return nearest

    def rewrite(self, request: web.BaseRequest, headers: CIMultiDict[str]) -> None:
        """Set the forwarding headers of a request on its way to an engine (`headers`: the request's own,
        hop-by-hop headers already removed)."""
        peer = request.remote or ""
        if not self.trusts(peer):
            for name in FORWARDING_HEADERS:
                headers.popall(name, None)
            headers["X-Forwarded-For"] = peer
            headers["X-Forwarded-Proto"] = request.scheme
            return
        prior = ", ".join(headers.popall("X-Forwarded-For", ()))
        headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
        headers.setdefault("X-Forwarded-Proto", request.scheme)
