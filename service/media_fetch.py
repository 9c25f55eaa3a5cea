"""Remote images, fetched only where the operator allows (docs/images.md, "Remote images").

Public contract:
    policy = FetchPolicy(("images.example.com", "*.cdn.example"))   # --allowed-media-domains
    data = fetch("https://images.example.com/a.png", policy, max_bytes, where="messages[0].content[1]")

``fetch`` is blocking (callers run it in a worker thread). Every hop (the URL, then each redirect, at most
``max_redirects``, the server's ``--media-fetch-max-redirects``) must be http(s) to an allowed host; the host's
addresses are resolved once and must all be global (no loopback, private, link-local, ...; an IPv6 address
that carries an IPv4 one, NAT64, 6to4, IPv4-mapped and the like, judged by that IPv4 too) unless the host is named
literally in the policy (a pattern or ``*`` never allows them); the connection goes to the address that was
checked (no second lookup to rebind). The whole fetch has one deadline (``timeout_s``, ``--media-fetch-timeout``):
at it the connection is shut, so a server that stalls or trickles its headers or body cannot hold the worker past
it. The body has a byte cap. Every failure is an ImageError naming ``where``.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

from dgserve.media.images import ImageError

REDIRECTS = (301, 302, 303, 307, 308)


@dataclass(frozen=True)
class FetchPolicy:
    """Where remote images may come from: host names, ``*.domain`` patterns or ``*`` (any host); a host named
    literally (a name or an IP literal) may also resolve to a non-global address."""

    domains: tuple[str, ...] = ()
    timeout_s: float = 10.0
    max_redirects: int = 3

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for d in self.domains:
            d = d.lower()
            if d == "*" or d == host or (d.startswith("*.") and host.endswith(d[1:])):
                return True
        return False

    def named(self, host: str) -> bool:
        return host.lower().rstrip(".") in (d.lower() for d in self.domains)


def fetch(url: str, policy: FetchPolicy, max_bytes: int, where: str) -> bytes:
    """The body of ``url`` (module docstring: the rules); ImageError naming ``where``."""
    deadline = time.monotonic() + policy.timeout_s
    late = ImageError(f"{where}: fetching the image took longer than the timeout ({policy.timeout_s:g} s)")
    for _ in range(policy.max_redirects + 1):
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme not in ("http", "https") or not host:
            raise ImageError(f"{where}: only http(s) URLs are fetched (got {parts.scheme or 'no scheme'!r})")
        if not policy.allows(host):
            raise ImageError(f"{where}: {host!r} is not an allowed media domain (--allowed-media-domains)")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        address = _address(host, port, policy.named(host), where)
        left = deadline - time.monotonic()
        if left <= 0:
            raise late
        conn = _connection(parts.scheme, host, address, port, left)
        cut = _Cutoff(left)
        try:
            conn.connect()
            cut.arm(conn.sock)  # the response keeps reading this socket after the connection lets it go
            if cut.fired.is_set():  # the deadline passed while connecting (no socket to shut then)
                raise late
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"Host": parts.netloc.rpartition("@")[2], "Accept": "image/*"})
            resp = conn.getresponse()
            if resp.status in REDIRECTS and resp.getheader("Location"):
                url = urllib.parse.urljoin(url, resp.getheader("Location"))
                continue
            if resp.status != 200:
                raise ImageError(f"{where}: fetching the image answered HTTP {resp.status}")
            body = _body(resp, max_bytes, where)
            if cut.fired.is_set():  # the cut may end a body without a length like a server's close
                raise late
            return body
        except (OSError, http.client.HTTPException) as e:
            if cut.fired.is_set() or isinstance(e, TimeoutError):
                raise late from None
            raise ImageError(f"{where}: fetching the image failed ({type(e).__name__})") from None
        finally:
            cut.cancel()
            conn.close()
    raise ImageError(f"{where}: more than {policy.max_redirects} redirects")


# IPv6 blocks that carry an IPv4 address, where a packet sent to them ends up (``embedded_ipv4``)
_V6 = ipaddress.IPv6Network
_NAT64 = _V6("64:ff9b::/96")  # RFC 6052's well-known prefix: the IPv4 in the last 32 bits
_NAT64_LOCAL = _V6("64:ff9b:1::/48")  # RFC 8215's local-use prefixes: the layout is the site's (never public)
_COMPATIBLE = _V6("::/96")  # IPv4-compatible (deprecated): the IPv4 in the last 32 bits
_SIX_TO_FOUR = _V6("2002::/16")  # 6to4: the IPv4 in bits 16-47
_TEREDO = _V6("2001::/32")  # Teredo: the server's IPv4 in bits 32-63, the client's inverted in the last 32


def embedded_ipv4(ip: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo); [] for none."""
    n, v4 = int(ip), ipaddress.IPv4Address
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    if ip in _NAT64 or ip in _COMPATIBLE:
        return [v4(n & 0xFFFFFFFF)]
    if ip in _SIX_TO_FOUR:
        return [v4((n >> 80) & 0xFFFFFFFF)]
    if ip in _TEREDO:
        return [v4((n >> 64) & 0xFFFFFFFF), v4(~n & 0xFFFFFFFF)]
    return []


def public_address(address: str) -> bool:
    """Whether ``address`` (an IP literal, an IPv6 zone allowed) is public: global, and so is every IPv4 address it
    carries (an IPv6 address that translates or tunnels to 127.0.0.1 or 10.0.0.1 reaches them). The local-use
    NAT64 prefixes (64:ff9b:1::/48) are never public: their layout is the site's, not readable from the address."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _NAT64_LOCAL:
            return False
        if not all(inner.is_global for inner in embedded_ipv4(ip)):
            return False
    return ip.is_global


def _address(host: str, port: int, named: bool, where: str) -> str:
    """The address to connect to: every address of ``host`` must be global unless ``named``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise ImageError(f"{where}: the host {host!r} does not resolve") from None
    addresses = [str(info[4][0]) for info in infos]
    if not named:
        for a in addresses:
            if not public_address(a):
                raise ImageError(
                    f"{where}: {host!r} resolves to a non-public address ({a}): not fetched unless the host is named "
                    "in --allowed-media-domains"
                )
    return addresses[0]


def _connection(scheme: str, host: str, address: str, port: int, timeout: float) -> http.client.HTTPConnection:
    if scheme == "http":
        return http.client.HTTPConnection(address, port, timeout=timeout)
    return _PinnedHTTPS(host, address, port, timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    """HTTPS to a checked address, verifying the certificate for the host name."""

    def __init__(self, host: str, address: str, port: int, timeout: float):
        super().__init__(address, port, timeout=timeout, context=ssl.create_default_context())
        self._name = host

    def connect(self) -> None:
        sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self._name)  # type: ignore[attr-defined]


class _Cutoff:
    """After ``seconds`` sets ``fired`` and shuts the socket given to ``arm``: a blocking read there returns or
    raises at once, however the server paces its bytes (the socket's own timeout bounds each read, not their sum)."""

    def __init__(self, seconds: float):
        self.fired, self.sock = threading.Event(), None
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def arm(self, sock) -> None:
        self.sock = sock

    def _cut(self) -> None:
        self.fired.set()
        sock = self.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed

    def cancel(self) -> None:
        self._timer.cancel()


def _body(resp: http.client.HTTPResponse, max_bytes: int, where: str) -> bytes:
    length = resp.getheader("Content-Length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ImageError(f"{where}: the image has {length} bytes, more than the limit of {max_bytes}")
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = resp.read1(min(65536, max_bytes + 1 - got))  # what one receive gives: the cap is checked as it grows
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > max_bytes:
            raise ImageError(f"{where}: the image has more than {max_bytes} bytes, the limit")
