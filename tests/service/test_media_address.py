"""The public-address check of remote image fetches (docs/images.md, "Remote images"): an IPv6 address that carries
an IPv4 one (IPv4-mapped, IPv4-compatible, NAT64, 6to4, Teredo) is judged by that IPv4 too, so a host of an
allowed domain resolving to one that reaches loopback or a private network is refused."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from dgserve.media.images import ImageError
from dgserve.service import media_fetch
from dgserve.service.media_fetch import FetchPolicy, fetch, public_address

REACHES_INSIDE = [
    "64:ff9b::7f00:1",  # NAT64 well-known prefix → 127.0.0.1
    "64:ff9b::a00:1",  # → 10.0.0.1
    "64:ff9b::c0a8:101",  # → 192.168.1.1
    "64:ff9b::a9fe:a9fe",  # → 169.254.169.254 (cloud metadata)
    "64:ff9b:1::7f00:1",  # local-use NAT64 (never public)
    "64:ff9b:1::808:808",
    "2002:7f00:1::1",  # 6to4 → 127.0.0.1
    "2002:a00:1::1",  # → 10.0.0.1
    "2002:ac10:1:1::1",  # → 172.16.0.1
    "::ffff:127.0.0.1",  # IPv4-mapped
    "::ffff:10.1.2.3",
    "::127.0.0.1",  # IPv4-compatible
    "::10.0.0.1",
    "2001:0:4136:e378:8000:63bf:f5ff:fffe",  # Teredo: client 10.0.0.1 (inverted)
    "2001:0:7f00:1:8000:63bf:f7f7:f7f7",  # Teredo: server 127.0.0.1, client 8.8.8.8
    "::1",
    "fe80::1%eth0",
    "127.0.0.1",
    "10.0.0.1",
]
PUBLIC = ["8.8.8.8", "2606:4700:4700::1111", "64:ff9b::808:808", "2002:808:808::1", "::ffff:8.8.8.8"]


@pytest.mark.parametrize("address", REACHES_INSIDE)
def test_an_address_that_reaches_loopback_or_a_private_network_is_not_public(address):
    assert not public_address(address)


@pytest.mark.parametrize("address", PUBLIC)
def test_a_global_address_and_one_carrying_a_global_ipv4_are_public(address):
    assert public_address(address)


@pytest.mark.parametrize("address", ["64:ff9b::7f00:1", "2002:a00:1::1", "64:ff9b:1::a00:1", "::ffff:127.0.0.1"])
def test_a_star_policy_never_fetches_from_a_host_resolving_to_an_embedded_private_ipv4(monkeypatch, address):
    infos = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, 80, 0, 0))]
    monkeypatch.setattr(media_fetch.socket, "getaddrinfo", lambda *a, **k: infos)
    with pytest.raises(ImageError, match=r"^x: 'evil\.example' resolves to a non-public address"):
        fetch("http://evil.example/a.png", FetchPolicy(("*",)), 1 << 20, "x")


def test_the_embedded_ipv4_of_each_kind():
    v6, v4 = ipaddress.IPv6Address, ipaddress.IPv4Address
    assert media_fetch.embedded_ipv4(v6("64:ff9b::c0a8:101")) == [v4("192.168.1.1")]
    assert media_fetch.embedded_ipv4(v6("2002:c0a8:101::1")) == [v4("192.168.1.1")]
    assert media_fetch.embedded_ipv4(v6("2001:0:4136:e378:8000:63bf:3fff:fdd2")) == [
        v4("65.54.227.120"),
        v4("192.0.2.45"),
    ]  # RFC 4380's example
    assert media_fetch.embedded_ipv4(v6("2606:4700::1")) == []
