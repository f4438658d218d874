"""Remote media URLs: http(s) fetches under an allow-list of domains, off by default.

`RemoteFetcher` fetches for `media.load_url_bytes` when a server is started with allowed
media domains (`RemotePolicy`). Every hop is checked before anything is sent:

- the scheme is http or https, the URL carries no credentials, and its host is one of the
  allowed domains (exact names, case-insensitive; an IP literal only when listed itself);
- the name is resolved once and every address it resolves to must be public: loopback, private,
  link-local, multicast, reserved and other non-global addresses are refused (loopback only
  passes with the test-only `RemotePolicy.allow_loopback`);
- the connection goes to the address that was checked (the request URL carries the IP, the
  Host header and the TLS server name carry the domain, and certificates are verified against
  the domain), so a second DNS answer cannot redirect it; proxies from the environment are
  ignored and no connection is reused across fetches;
- redirects are followed here, hop by hop (at most `max_redirects`), each target checked as
  above; a redirect off the allow-list is refused.

The body is streamed under the byte limit of the media kind (a declared Content-Length over it
is refused before reading), with connect and read timeouts and a deadline for the whole fetch.
`fetch_media` also gives the answer's Content-Type (None when generic), which the decoders check
against the bytes as they check a ``data:`` URL's type.
Fetches run on the fetcher's own threads, `max_concurrent` at a time per server, never on an
event loop or the engine's step thread; `batch` starts a request's fetches together. Every
failure is an `InputError`: ``not_allowed`` (policy), ``too_large``, ``unsupported`` (a
Content-Type of another kind), ``fetch_failed`` (connection, timeout, HTTP status).
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from spaceserve.checks import require_int
from spaceserve.runtime.inputs.errors import InputError, safe_detail

# Content-Types accepted beside "<media>/*" (servers often label media generically)
GENERIC_TYPES = frozenset({"", "application/octet-stream", "binary/octet-stream"})
VIDEO_TYPES = frozenset({"application/mp4", "application/ogg", "application/x-matroska",
                         "image/gif"})  # an animated GIF is a clip
REDIRECTS = (301, 302, 303, 307, 308)

Resolver = Callable[[str, int], Sequence[str]]


def _norm_host(host: str) -> str:
    """An allow-list entry or URL host as compared: IDNA (punycode), lowercase, no final dot,
    an IPv6 literal without brackets."""
    import httpx

    host = host.strip().strip("[]") if ":" in host.strip("[]") else host.strip()
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        raw = httpx.URL(f"http://{host}/").raw_host.decode("ascii")
    except Exception as exc:  # httpx.InvalidURL and IDNA errors
        raise ValueError(f"allowed media domain {host!r} is not a host name ({exc})") from None
    return raw.lower().rstrip(".")


@dataclass(frozen=True)
class RemotePolicy:
    """Where and how remote media may be fetched (times in seconds)."""

    allowed_domains: tuple[str, ...]
    connect_timeout: float = 5.0
    read_timeout: float = 10.0
    total_timeout: float = 30.0
    max_redirects: int = 5
    max_concurrent: int = 8
    allow_loopback: bool = False  # for tests against a local server only: never in production
    resolver: Resolver | None = field(default=None, compare=False)  # default: getaddrinfo

    def __post_init__(self) -> None:
        if isinstance(self.allowed_domains, str):
            raise ValueError("allowed_domains must be a sequence of host names, not a string")
        domains = tuple(dict.fromkeys(_norm_host(d) for d in self.allowed_domains if d.strip()))
        if not domains:
            raise ValueError("allowed_domains is empty: leave remote fetching off instead")
        object.__setattr__(self, "allowed_domains", domains)
        for name in ("connect_timeout", "read_timeout", "total_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v <= 0:
                raise ValueError(f"{name}={v!r} must be a positive number of seconds")
        for name, low in (("max_redirects", 0), ("max_concurrent", 1)):
            v = getattr(self, name)
            require_int(name, v, low)


def address_problem(ip: str, allow_loopback: bool = False) -> str | None:
    """Why `ip` may not be fetched from (e.g. "private"), or None for a public address."""
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return None if allow_loopback else "loopback"
    for attr, what in (("is_link_local", "link-local"), ("is_multicast", "multicast"),
                       ("is_unspecified", "unspecified"), ("is_private", "private"),
                       ("is_reserved", "reserved")):
        if getattr(addr, attr):
            return what
    return None if addr.is_global else "non-public"


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class _Hop(Exception):
    """A redirect: the next URL (internal to `_fetch`)."""

    def __init__(self, location: str) -> None:
        super().__init__(location)
        self.location = location


class RemoteFetcher:
    """Fetches http(s) media under a `RemotePolicy` on a bounded pool of its own threads.

    `fetch` blocks its caller (a preparation worker) until the bytes arrive or the deadline
    passes. `ssl_context` replaces the default one (the system's CA bundle, via httpx);
    `transport` replaces the network in tests (an ``httpx`` transport).
    """

    def __init__(self, policy: RemotePolicy, *, ssl_context: Any = None,
                 transport: Any = None) -> None:
        self.policy = policy
        self.transport = transport
        self._pool = ThreadPoolExecutor(max_workers=policy.max_concurrent,
                                        thread_name_prefix="spaceserve-fetch")
        self._ssl: Any = ssl_context
        self._lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- public --------------------------------------------------------------------------
    def start(self, url: str, *, where: str, media: str, max_bytes: int) -> Future:
        """Start fetching `url` (its first hop is checked here, at once); a Future of bytes."""
        self._check_url(url, where, media)
        deadline = time.monotonic() + self.policy.total_timeout
        return self._pool.submit(self._fetch, url, where, media, max_bytes, deadline)

    def fetch(self, url: str, *, where: str, media: str, max_bytes: int) -> bytes:
        """The bytes at `url` (at most `max_bytes`); InputError otherwise."""
        return self.fetch_media(url, where=where, media=media, max_bytes=max_bytes)[0]

    def fetch_media(self, url: str, *, where: str, media: str, max_bytes: int
                    ) -> tuple[bytes, str | None]:
        """(the bytes at `url`, the media type its Content-Type declares: None when absent or
        generic); InputError otherwise."""
        return self.wait_media(self.start(url, where=where, media=media, max_bytes=max_bytes),
                               where, media, url)

    def wait(self, future: Future, where: str, media: str, url: str) -> bytes:
        """The bytes of a started fetch (`start`); InputError otherwise."""
        return self.wait_media(future, where, media, url)[0]

    def wait_media(self, future: Future, where: str, media: str, url: str
                   ) -> tuple[bytes, str | None]:
        """(bytes, declared media type) of a started fetch; InputError otherwise."""
        try:
            return future.result(timeout=self.policy.total_timeout + 1.0)
        except FutureTimeout:
            future.cancel()
            raise self._failed(where, media, url, f"no answer within "
                               f"{self.policy.total_timeout:g} s") from None

    def batch(self, items: Sequence[tuple[str, str, str, int]]) -> FetchBatch:
        """Start the fetches of one request together: (url, where, media, max_bytes) each."""
        return FetchBatch(self, items)

    # -- checks --------------------------------------------------------------------------
    def _check_url(self, url: str, where: str, media: str) -> Any:
        import httpx

        try:
            u = httpx.URL(url)
        except Exception as exc:  # httpx.InvalidURL and IDNA errors
            raise InputError(f"{where}: invalid URL ({safe_detail(exc)})", param=where) from None
        if u.scheme not in ("http", "https") or not u.host:
            raise InputError(f"{where}: only http(s) URLs with a host are fetched",
                             kind="unsupported", param=where)
        if u.userinfo:
            raise InputError(f"{where}: credentials in media URLs are not accepted",
                             param=where)
        host = _norm_host(u.raw_host.decode("ascii"))
        if host not in self.policy.allowed_domains:
            raise InputError(f"{where}: {media} URLs from {host!r} are not allowed (not one of "
                             "the server's allowed media domains)", kind="not_allowed",
                             param=where)
        return u

    def _addresses(self, host: str, port: int, where: str, media: str, url: str) -> list[str]:
        resolve = self.policy.resolver or _resolve
        try:
            ips = list(resolve(host, port))
        except (OSError, UnicodeError) as exc:
            raise self._failed(where, media, url,
                               f"cannot resolve {host!r} ({safe_detail(exc)})") from None
        if not ips:
            raise self._failed(where, media, url, f"{host!r} resolves to no address")
        for ip in ips:
            why = address_problem(ip, self.policy.allow_loopback)
            if why is not None:
                raise InputError(f"{where}: {host!r} resolves to {ip}, a {why} address; "
                                 "remote media are fetched from public addresses only",
                                 kind="not_allowed", param=where)
        return ips

    def _failed(self, where: str, media: str, url: str, why: str) -> InputError:
        return InputError(f"{where}: fetching the {media} failed: {why}", kind="fetch_failed",
                          param=where)

    # -- the fetch (on a pool thread) ------------------------------------------------------
    def _fetch(self, url: str, where: str, media: str, max_bytes: int, deadline: float
               ) -> tuple[bytes, str | None]:
        import httpx

        current = url
        for _ in range(self.policy.max_redirects + 1):
            if time.monotonic() > deadline:
                raise self._failed(where, media, url, "took longer than "
                                   f"{self.policy.total_timeout:g} s")
            u = self._check_url(current, where, media)
            host = u.raw_host.decode("ascii")
            port = u.port or (443 if u.scheme == "https" else 80)
            last: Exception | None = None
            for ip in self._addresses(host, port, where, media, url):
                try:
                    return self._get(u, ip, where, media, max_bytes, deadline)
                except _Hop as redirect:
                    current = str(u.join(redirect.location))
                    break
                except httpx.ConnectError as exc:  # try the name's next (checked) address
                    last = exc
                    continue
                except httpx.TimeoutException:
                    raise self._failed(where, media, url, "timed out") from None
                except httpx.HTTPError as exc:
                    raise self._failed(where, media, url,
                                       f"{type(exc).__name__}: {safe_detail(exc)}") from None
            else:
                raise self._failed(where, media, url, f"cannot connect to {host!r} "
                                   f"({safe_detail(last) if last else 'no address'})")
        raise self._failed(where, media, url,
                           f"more than {self.policy.max_redirects} redirects")

    def _client(self) -> Any:
        import httpx

        p = self.policy
        timeout = httpx.Timeout(connect=p.connect_timeout, read=p.read_timeout,
                                write=p.read_timeout, pool=p.connect_timeout)
        if self.transport is not None:
            return httpx.Client(transport=self.transport, timeout=timeout, trust_env=False,
                                follow_redirects=False)
        with self._lock:
            if self._ssl is None:  # one TLS context (CA bundle loaded once)
                self._ssl = httpx.create_ssl_context()
        # one connection per fetch: a connection is never reused for another name
        return httpx.Client(verify=self._ssl, timeout=timeout, trust_env=False,
                            follow_redirects=False,
                            limits=httpx.Limits(max_keepalive_connections=0))

    def _get(self, u: Any, ip: str, where: str, media: str, max_bytes: int,
             deadline: float) -> tuple[bytes, str | None]:
        host = u.raw_host.decode("ascii")
        headers = {"Host": u.netloc.decode("ascii"), "Accept": f"{media}/*",
                   "User-Agent": "SpaceServe media fetcher"}
        ext = {"sni_hostname": host} if u.scheme == "https" else {}
        target = u.copy_with(host=ip, fragment=None)
        with self._client() as client, client.stream("GET", target, headers=headers,
                                                     extensions=ext) as resp:
            if resp.status_code in REDIRECTS and resp.headers.get("location"):
                raise _Hop(resp.headers["location"])
            if resp.status_code != 200:
                raise self._failed(where, media, str(u), f"HTTP {resp.status_code}")
            ctype = resp.headers.get("content-type", "").split(";")[0].strip().lower()
            if not (ctype.startswith(f"{media}/") or ctype in GENERIC_TYPES
                    or (media == "video" and ctype in VIDEO_TYPES)):
                raise InputError(f"{where}: the server sent Content-Type {ctype!r}, not "
                                 f"{'an' if media == 'image' else 'a'} {media}",
                                 kind="unsupported", param=where)
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise InputError(f"{where}: {media} larger than {max_bytes} bytes",
                                 kind="too_large", param=where)
            parts, size = [], 0
            for part in resp.iter_bytes():
                size += len(part)
                if size > max_bytes:
                    raise InputError(f"{where}: {media} larger than {max_bytes} bytes",
                                     kind="too_large", param=where)
                if time.monotonic() > deadline:
                    raise self._failed(where, media, str(u), "took longer than "
                                       f"{self.policy.total_timeout:g} s")
                parts.append(part)
            return b"".join(parts), None if ctype in GENERIC_TYPES else ctype


class FetchBatch:
    """The fetches of one request, started together; `fetch` (the fetcher interface) hands
    out each result by (url, where). Leaving the ``with`` block cancels what is left."""

    def __init__(self, fetcher: RemoteFetcher, items: Sequence[tuple[str, str, str, int]]
                 ) -> None:
        self.fetcher = fetcher
        self.futures: dict[tuple[str, str], Future] = {}
        self.errors: dict[tuple[str, str], InputError] = {}
        for url, where, media, max_bytes in items:
            try:
                self.futures[url, where] = fetcher.start(url, where=where, media=media,
                                                         max_bytes=max_bytes)
            except InputError as exc:  # refused at once: reported when its turn comes
                self.errors[url, where] = exc

    def fetch(self, url: str, *, where: str, media: str, max_bytes: int) -> bytes:
        return self.fetch_media(url, where=where, media=media, max_bytes=max_bytes)[0]

    def fetch_media(self, url: str, *, where: str, media: str, max_bytes: int
                    ) -> tuple[bytes, str | None]:
        if (url, where) in self.errors:
            raise self.errors[url, where]
        fut = self.futures.get((url, where))
        if fut is None:
            return self.fetcher.fetch_media(url, where=where, media=media, max_bytes=max_bytes)
        return self.fetcher.wait_media(fut, where, media, url)

    def pending(self) -> list[Future]:
        """The fetches not finished yet (a caller may wait for them off its thread)."""
        return [f for f in self.futures.values() if not f.done()]

    def __enter__(self) -> FetchBatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        for fut in self.futures.values():
            fut.cancel()


__all__ = ["FetchBatch", "RemoteFetcher", "RemotePolicy", "address_problem"]
