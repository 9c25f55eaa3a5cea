"""Who may reach the HTTP door from a browser: the ``Host`` and ``Origin`` checks (docs/deployment.md, "Browsers
and Host names").

A web page the user visits can make the user's browser send requests to this port: a POST of a "simple" content
type (text/plain, a form) goes out with no CORS preflight, and with DNS rebinding (an attacker's name that
resolves to this machine) the page can even read the answer. So, before any work:

* ``Host`` must name this server: ``localhost``, an IP literal (v4 or v6, any port: what kubelet probes and a
  picker scraping a pod IP send), the bound address, the machine's own hostname or FQDN, or a name the operator
  allows (``--allowed-hosts``: exact names, ``*.suffix`` patterns, or ``*`` for any). Else 400 naming ``Host``
  (Starlette's TrustedHostMiddleware's rule, with those defaults).
* a request that carries ``Origin`` (every browser POST, every cross-origin fetch) must come from the same origin
  (the Origin's host and port are the Host it was sent to) or from an origin the operator allows
  (``--allowed-origins``: ``scheme://host[:port]`` each, or ``*``). Else 403, with no CORS headers. Allowed
  origins get Starlette's CORSMiddleware (preflights answered, ``Access-Control-Allow-Origin`` on answers).

A refusal is the door's own error object: Anthropic's on the Messages routes, OpenAI's elsewhere
(``errors.error_response_for``).

JSON routes also take only ``application/json`` bodies (``body.check_content_type``), so a form or text/plain
POST is a 415 even from a page whose origin is allowed.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware

from .errors import HttpError, error_response_for

ANY = "*"
LOCAL_NAMES = ("localhost",)
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class HostPolicy:
    """The Host names this door answers (module doc). ``names`` lower-case, without a trailing dot; ``suffixes``
    from ``*.example.com`` patterns (``.example.com``); ``any`` from ``*``."""

    names: frozenset[str]
    suffixes: tuple[str, ...] = ()
    any: bool = False

    @classmethod
    def build(cls, allowed: tuple[str, ...], own: tuple[str, ...]) -> HostPolicy:
        """The policy of ``allowed`` (the operator's list) on top of the defaults: LOCAL_NAMES and ``own`` (the
        bound address and the machine's names; IP literals are always accepted)."""
        names = {_name(n) for n in (*LOCAL_NAMES, *own, *allowed) if n and not n.startswith("*")}
        suffixes = tuple(_name(n[1:]) for n in allowed if n.startswith("*."))
        return cls(frozenset(names), suffixes, ANY in allowed)

    def allows(self, host: str | None) -> bool:
        if self.any:
            return True
        name = split_host(host)[0] if host else None
        if not name:
            return False
        return name in self.names or _is_ip(name) or name.endswith(self.suffixes)


@dataclass(frozen=True)
class OriginPolicy:
    """The origins whose requests this door serves besides its own: ``scheme://host[:port]`` strings, or any."""

    origins: frozenset[str]
    any: bool = False

    @classmethod
    def build(cls, allowed: tuple[str, ...]) -> OriginPolicy:
        return cls(frozenset(o.lower().rstrip("/") for o in allowed if o != ANY), ANY in allowed)

    def allows(self, origin: str, host: str | None) -> bool:
        """Whether a request carrying ``Origin: origin`` that was sent to ``host`` may be served."""
        return self.any or origin.lower().rstrip("/") in self.origins or same_origin(origin, host)


def same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` (``scheme://host[:port]``) is the site ``host`` (the Host header) names: the same name
    and port, a port absent from Host being the origin scheme's default (a proxy may have terminated TLS)."""
    scheme, sep, rest = origin.lower().partition("://")
    if not sep or scheme not in DEFAULT_PORTS or not host or "/" in rest:
        return False  # "null" (a sandboxed page, a file), or not an origin at all
    o_name, o_port = split_host(rest)
    h_name, h_port = split_host(host)
    if o_name is None or o_name != h_name:
        return False
    return (o_port or DEFAULT_PORTS[scheme]) == (h_port or DEFAULT_PORTS[scheme])


def split_host(value: str) -> tuple[str | None, int | None]:
    """(name, port) of ``host[:port]`` / ``[v6]:port``: the name lower-case without a trailing dot, the port None
    when absent; (None, None) when the value is malformed."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None, None
        port = rest[1:]
    elif value.count(":") > 1:  # a bare IPv6 literal (not valid in Host, but unambiguous)
        name, port = value, ""
    else:
        name, _, port = value.partition(":")
    if port and not (port.isdigit() and len(port) <= 5):
        return None, None
    return _name(name) or None, int(port) if port else None


class SiteGuard:
    """ASGI middleware: the Host and Origin checks (module doc) in front of ``app``; with allowed origins, ``app``
    is wrapped in Starlette's CORSMiddleware for them."""

    def __init__(self, app, hosts: HostPolicy, origins: OriginPolicy):
        self.hosts, self.origins = hosts, origins
        if origins.any or origins.origins:
            app = CORSMiddleware(
                app,
                allow_origins=[ANY] if origins.any else sorted(origins.origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                expose_headers=["X-Request-Id", "X-Dgserve-Seed"],
                max_age=600,
            )
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        refusal = None
        if not self.hosts.allows(host):
            refusal = HttpError(
                "HOST_NOT_ALLOWED",
                f"Host: {_clip(host)} is not a name of this server (the operator allows more with --allowed-hosts)",
                param="Host",
            )
        elif origin is not None and not self.origins.allows(origin, host):
            refusal = HttpError(
                "ORIGIN_NOT_ALLOWED",
                f"Origin: {_clip(origin)} may not call this server (the operator allows origins with "
                "--allowed-origins)",
                param="Origin",
            )
        if refusal is not None:
            response = error_response_for(scope["path"], refusal)  # the door's own error shape
            if refusal.reason == "HOST_NOT_ALLOWED":  # (a missing Host too): not our client; no keep-alive
                response.headers["Connection"] = "close"
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


def _name(value: str) -> str:
    return value.strip().lower().rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.partition("%")[0])  # (a v6 zone id: fe80::1%eth0)
    except ValueError:
        return False
    return True


def _clip(value: str | None, limit: int = 80) -> str:
    if value is None:
        return "(none)"
    return repr(value) if len(value) <= limit else f"{value[:limit]!r}… ({len(value)} characters)"
