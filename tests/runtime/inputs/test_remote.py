"""Remote media URLs (spaceserve.runtime.inputs.media.remote) against a local HTTP server on
127.0.0.1: an allowed domain is fetched (loopback let through only by the test-only opt-in),
every other host, oversize body, slow or trickling answer, redirect off the allow-list,
redirect loop, HTML page and HTTP error is refused with its kind; names resolving to
non-public addresses are refused; the connection goes to the address that was checked (no
second lookup, Host header and TLS name carry the domain); fetches run at most
`max_concurrent` at a time; proxies from the environment are ignored."""

from __future__ import annotations

import io
import time

import numpy as np
import pytest

from spaceserve.runtime.inputs import (
    ImageLimits,
    InputError,
    RemoteFetcher,
    RemotePolicy,
    address_problem,
    load_image_url,
)
from tests.media_server import MediaServer


def png_bytes() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 255, (20, 30, 3), dtype=np.uint8)).save(
        buf, format="PNG")
    return buf.getvalue()


PNG = png_bytes()
LIMIT = 100_000


def policy(**kw) -> RemotePolicy:
    base = dict(allowed_domains=("localhost",), allow_loopback=True, connect_timeout=1.0,
                read_timeout=0.5, total_timeout=1.5, max_redirects=3)
    return RemotePolicy(**(base | kw))


@pytest.fixture(scope="module")
def server():
    with MediaServer(PNG) as s:
        yield s


@pytest.fixture(scope="module")
def fetcher():
    f = RemoteFetcher(policy())
    yield f
    f.close()


def fails(kind: str, fn, *args, **kw) -> InputError:
    with pytest.raises(InputError) as info:
        fn(*args, **kw)
    assert info.value.kind == kind, (info.value.kind, str(info.value))
    return info.value


def get(f: RemoteFetcher, url: str, max_bytes: int = LIMIT, media: str = "image") -> bytes:
    return f.fetch(url, where="m[0].image_url", media=media, max_bytes=max_bytes)


def test_an_allowed_domain_is_fetched(server, fetcher) -> None:
    assert get(fetcher, server.url("/img.png")) == PNG
    assert server.hosts[-1] == f"localhost:{server.port}"  # the name, not the address
    assert get(fetcher, server.url("/octet")) == PNG  # a generic Content-Type is fine
    img = load_image_url(server.url("/img.png"), ImageLimits(), "m[0]", fetcher=fetcher)
    assert img.size == (30, 20)
    assert get(fetcher, server.url("/redirect-in")) == PNG  # a redirect inside the list


def test_other_hosts_are_refused_before_any_request(server, fetcher) -> None:
    seen = len(server.hosts)
    for url in (server.url("/img.png", host="127.0.0.1"), "https://example.org/a.png",
                "http://LOCALHOST.evil.test/a.png"):
        err = fails("not_allowed", get, fetcher, url)
        assert "not allowed" in str(err) and err.param == "m[0].image_url"
    assert len(server.hosts) == seen
    fails("invalid", get, fetcher, f"http://user:pw@localhost:{server.port}/img.png")
    fails("unsupported", get, fetcher, "ftp://localhost/img.png")


def test_oversize_slow_and_bad_answers_are_refused(server, fetcher) -> None:
    err = fails("too_large", get, fetcher, server.url("/big.png"))
    assert str(err) == f"m[0].image_url: image larger than {LIMIT} bytes"
    fails("too_large", get, fetcher, server.url("/stream-big.png"))  # no declared length
    t0 = time.monotonic()
    err = fails("fetch_failed", get, fetcher, server.url("/slow.png"))
    assert "timed out" in str(err) and time.monotonic() - t0 < 1.5  # the read timeout
    t0 = time.monotonic()
    err = fails("fetch_failed", get, fetcher, server.url("/trickle.png"))
    assert "longer than 1.5 s" in str(err) and time.monotonic() - t0 < 2.5  # the deadline
    err = fails("not_allowed", get, fetcher, server.url("/redirect-out"))
    assert "'127.0.0.1'" in str(err)
    err = fails("fetch_failed", get, fetcher, server.url("/loop"))
    assert "more than 3 redirects" in str(err)
    err = fails("unsupported", get, fetcher, server.url("/page.html"))
    assert "'text/html'" in str(err)
    fails("unsupported", get, fetcher, server.url("/img.png"), media="video")
    err = fails("fetch_failed", get, fetcher, server.url("/nothing"))
    assert "HTTP 404" in str(err)


def test_loopback_needs_the_test_only_opt_in(server) -> None:
    f = RemoteFetcher(policy(allow_loopback=False))
    try:
        seen = len(server.hosts)
        err = fails("not_allowed", get, f, server.url("/img.png"))
        assert "resolves to" in str(err) and "a loopback address" in str(err)
        assert len(server.hosts) == seen
    finally:
        f.close()


@pytest.mark.parametrize("ip, why", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("::ffff:127.0.0.1", "loopback"),
    ("10.1.2.3", "private"), ("172.16.0.1", "private"), ("192.168.1.1", "private"),
    ("fd00::1", "private"), ("169.254.169.254", "link-local"), ("fe80::1%eth0", "link-local"),
    ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("100.64.0.1", "non-public"),
    ("93.184.216.34", None), ("2606:4700::1111", None),
])
def test_address_classes(ip, why) -> None:
    assert address_problem(ip) == why
    assert address_problem(ip, allow_loopback=True) == (None if why == "loopback" else why)


def test_names_resolving_to_private_addresses_are_refused() -> None:
    for ips in (["10.0.0.5"], ["93.184.216.34", "169.254.169.254"]):
        f = RemoteFetcher(policy(allowed_domains=("media.example.com",),
                                 resolver=lambda host, port, ips=ips: ips))
        try:
            err = fails("not_allowed", get, f, "https://media.example.com/a.png")
            assert "public addresses only" in str(err)
        finally:
            f.close()


def test_the_connection_goes_to_the_checked_address() -> None:
    """A name answering a public address first and loopback after (DNS rebinding): it is
    looked up once per hop and the request goes to the address that was checked, the Host
    header and the TLS server name carrying the name."""
    import httpx

    lookups: list[str] = []
    seen: list[httpx.Request] = []

    def resolver(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["93.184.216.34"] if len(lookups) == 1 else ["127.0.0.1"]

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/first":
            return httpx.Response(302, headers={"Location": "/a.png"})
        return httpx.Response(200, content=PNG, headers={"Content-Type": "image/png"})

    f = RemoteFetcher(policy(allowed_domains=("media.example.com",), allow_loopback=False,
                             resolver=resolver), transport=httpx.MockTransport(answer))
    try:
        assert get(f, "https://media.example.com/a.png") == PNG
        req = seen[-1]
        assert req.url.host == "93.184.216.34" and req.url.scheme == "https"
        assert req.headers["host"] == "media.example.com"
        assert req.extensions["sni_hostname"] == "media.example.com"
        assert lookups == ["media.example.com"]
        # a redirect's hop is looked up again: now loopback, refused before any request
        lookups.clear()
        n = len(seen)
        err = fails("not_allowed", get, f, "https://media.example.com/first")
        assert "a loopback address" in str(err) and lookups == ["media.example.com"] * 2
        assert len(seen) == n + 1 and seen[-1].url.host == "93.184.216.34"
    finally:
        f.close()


def test_fetches_are_bounded_per_server_and_a_request_starts_them_together(server) -> None:
    f = RemoteFetcher(policy(max_concurrent=2, total_timeout=5.0))
    try:
        items = [(server.url(f"/count?{i}"), f"m[{i}]", "image", LIMIT) for i in range(5)]
        server.max_active = 0
        with f.batch(items) as batch:
            got = [batch.fetch(u, where=w, media=m, max_bytes=b) for u, w, m, b in items]
        assert got == [PNG] * 5 and server.max_active == 2
        # a refused URL of a batch is reported when its turn comes, in content-part order
        mixed = [items[0], ("https://example.org/x.png", "m[1]", "image", LIMIT)]
        with f.batch(mixed) as batch:
            assert batch.fetch(*mixed[0][:1], where="m[0]", media="image", max_bytes=LIMIT) == PNG
            fails("not_allowed", batch.fetch, mixed[1][0], where="m[1]", media="image",
                  max_bytes=LIMIT)
    finally:
        f.close()


def test_proxies_from_the_environment_are_ignored(server, fetcher, monkeypatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
    assert get(fetcher, server.url("/img.png")) == PNG


def test_policy_validation() -> None:
    p = RemotePolicy(("Media.Example.COM.", "[::1]", "bücher.example"))
    assert p.allowed_domains == ("media.example.com", "::1", "xn--bcher-kva.example")
    for bad in [dict(allowed_domains=()), dict(allowed_domains="a.com"),
                dict(allowed_domains=("a.com",), read_timeout=0),
                dict(allowed_domains=("a.com",), max_concurrent=0)]:
        with pytest.raises(ValueError):
            RemotePolicy(**bad)


@pytest.mark.parametrize("cert_name, ok", [("localhost", True), ("other.test", False)])
def test_https_verifies_the_name_while_connecting_to_the_address(tmp_path, cert_name, ok
                                                                  ) -> None:
    """TLS to 127.0.0.1 with the name as server name: a certificate for the name passes, one for
    another name fails (the address alone is never what is verified)."""
    import ssl

    from tests.media_server import serve_tls, tls_files

    pytest.importorskip("cryptography")
    ca, cert, key = tls_files(tmp_path, cert_name)
    ctx = ssl.create_default_context(cafile=ca)
    with serve_tls(MediaServer(PNG), cert, key) as s:
        f = RemoteFetcher(policy(), ssl_context=ctx)
        try:
            url = f"https://localhost:{s.port}/img.png"
            if ok:
                assert get(f, url) == PNG and s.hosts[-1] == f"localhost:{s.port}"
            else:
                err = fails("fetch_failed", get, f, url)
                assert "CERTIFICATE_VERIFY_FAILED" in str(err) or "certificate" in str(err)
        finally:
            f.close()
