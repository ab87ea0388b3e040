"""Safe fetching of remote (http/https) images, in the front-end process.

Every hop (the URL and each redirect, at most `FetchPolicy.max_redirects`) is resolved with
`getaddrinfo`; every address it gives must be public (not loopback, private, link-local,
multicast, reserved, unspecified, shared; IPv4 inside IPv6 checked as IPv4) unless
`FetchPolicy.allowed_hosts` names the host or holds the address. The connection then goes
to that same checked address (the URL's host sent as Host header and TLS server name), so a
second DNS answer cannot move it. One deadline bounds the whole fetch (DNS, connects,
redirects, body), and a byte cap is checked against Content-Length and while reading.

Every failure gives the client the same message (`could not fetch image N: URL`), so the
server cannot be used to tell closed ports, filtered hosts and missing files apart; the real
reason is logged at debug level. `RemoteImageFetcher` bounds how many fetches run at once;
name lookups run in its own small thread pool, never in the event loop's default executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
import ssl
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import certifi
import httpx

from vlmserve.errors import InvalidImageError

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_REDIRECTS = (301, 302, 303, 307, 308)
T = TypeVar("T")


class _Refused(Exception):
    """Why a fetch failed (logged, never shown to the client)."""


@dataclass(frozen=True)
class FetchPolicy:
    """What a remote image fetch may reach and spend."""

    timeout: float = 10.0  # seconds for the whole fetch, redirects included
    max_bytes: int = 32 << 20
    allowed_hosts: tuple[str, ...] = ()  # host names, IP addresses, CIDR networks
    max_redirects: int = 5

    @staticmethod
    def parse_hosts(spec: str | Iterable[str] | None) -> tuple[str, ...]:
        """`"a.example, 10.0.0.0/8"` -> `("a.example", "10.0.0.0/8")`."""
        if spec is None:
            return ()
        items = spec.split(",") if isinstance(spec, str) else spec
        return tuple(s.strip() for s in items if s.strip())


def _normalize_name(host: str) -> str:
    return host.strip().strip("[]").rstrip(".").lower()


class _Allowlist:
    def __init__(self, entries: Iterable[str]) -> None:
        self.names: set[str] = set()
        self.networks: list[IPNetwork] = []
        for entry in entries:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.names.add(_normalize_name(entry))

    def allows(self, host: str, ip: IPAddress) -> bool:
        if _normalize_name(host) in self.names:
            return True
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self.networks)


def is_public(ip: IPAddress) -> bool:
    """True for an address on the public internet; IPv4 embedded in IPv6 (mapped, 6to4,
    Teredo, NAT64) must be public too."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public(ip.ipv4_mapped)
        embedded = [ip.sixtofour, ip.teredo[1] if ip.teredo else None]
        if ip in _NAT64:
            embedded.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
        if ip.is_site_local or any(e is not None and not is_public(e) for e in embedded):
            return False
    return ip.is_global and not (
        ip.is_multicast or ip.is_private or ip.is_loopback or ip.is_link_local
        or ip.is_reserved or ip.is_unspecified)


def _short(url: str, limit: int = 200) -> str:
    return url if len(url) <= limit else url[:limit] + "..."


class RemoteImageFetcher:
    """Fetches remote images under a `FetchPolicy`, at most `workers` at a time (the rest
    wait for a slot; the deadline starts when a fetch gets its slot). Use from one event
    loop (the front end's); `fetch_sync` for code without one."""

    def __init__(self, policy: FetchPolicy | None = None, workers: int = 8) -> None:
        if workers < 1:
            raise ValueError("remote image fetch workers must be at least 1")
        self.policy = policy or FetchPolicy()
        self.allowlist = _Allowlist(self.policy.allowed_hosts)
        self.workers = workers
        self._slots: asyncio.Semaphore | None = None
        self._resolver = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="vlmserve-dns")
        # once: loading the CA certificates takes time (certifi's, as httpx uses)
        self._ssl = ssl.create_default_context(cafile=certifi.where())

    def close(self) -> None:
        self._resolver.shutdown(wait=False, cancel_futures=True)

    async def fetch(self, url: str, index: int | None = None, kind: str = "image") -> bytes:
        """The body of `url`; any failure raises `InvalidImageError("could not fetch image
        N: URL")` (``kind`` N: a video's says video), the same for every cause (logged at
        debug level)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            try:
                async with asyncio.timeout(self.policy.timeout):
                    return await self._fetch(url)
            except Exception as e:  # noqa: BLE001 - one answer for all causes, timeouts too
                reason = (f"no answer within {self.policy.timeout} s"
                          if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}")
                logger.debug("could not fetch %s %s (%s): %s", kind, index, _short(url), reason)
        what = kind if index is None else f"{kind} {index}"
        raise InvalidImageError(f"could not fetch {what}: {_short(url)}")

    async def fetch_all(self, sources: list, kinds: list[str]) -> list:
        """`sources` (of ``kinds``: image or video) with each http(s) URL replaced by its
        fetched bytes, numbered per kind from 1 in errors. The first failure (in request
        order) raises and cancels the other fetches."""
        remote = {i: s for i, s in enumerate(sources) if isinstance(s, str)
                  and s[:8].lower().startswith(("http://", "https://"))}
        if not remote:
            return sources
        tasks = {i: asyncio.create_task(self.fetch(
            url, kinds[:i + 1].count(kinds[i]), kinds[i])) for i, url in remote.items()}
        try:
            done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks.values():  # the first image's failure, in request order
                if task in done and task.exception() is not None:
                    raise task.exception()
        finally:
            for task in tasks.values():
                if task.done() and not task.cancelled():
                    task.exception()  # seen: no "exception never retrieved" for the others
                task.cancel()
        return [tasks[i].result() if i in tasks else s for i, s in enumerate(sources)]

    def fetch_all_sync(self, requests: list[tuple[list, list[str]]]) -> list[list]:
        """`fetch_all` of each request's (sources, kinds), all at once, for code without an
        event loop (the offline API's chats)."""
        self._slots = None  # the semaphore of this call's own loop

        async def run() -> list[list]:
            return list(await asyncio.gather(*(self.fetch_all(s, k) for s, k in requests)))

        return run_sync(run())

    async def _fetch(self, url: str) -> bytes:
        current = httpx.URL(url)
        for _ in range(self.policy.max_redirects + 1):
            if current.scheme not in ("http", "https"):
                raise _Refused(f"scheme {current.scheme!r}")
            if current.userinfo:
                raise _Refused("credentials in the URL")
            host = current.host
            if not host:
                raise _Refused("no host")
            port = current.port or (443 if current.scheme == "https" else 80)
            addresses = await self._resolve(host, port)
            response_or_data = await self._get(current, addresses)
            if isinstance(response_or_data, bytes):
                return response_or_data
            current = current.join(response_or_data)  # a redirect's Location
        raise _Refused(f"more than {self.policy.max_redirects} redirects")

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        loop = asyncio.get_running_loop()
        infos = await loop.run_in_executor(
            self._resolver, lambda: socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        addresses: list[IPAddress] = []
        for info in infos:
            ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
            if not (is_public(ip) or self.allowlist.allows(host, ip)):
                raise _Refused(f"{host} resolves to {ip}, which is not public")
            if ip not in addresses:
                addresses.append(ip)
        if not addresses:
            raise _Refused(f"{host} does not resolve")
        return addresses

    async def _get(self, url: httpx.URL, addresses: list[IPAddress]) -> bytes | str:
        """GET `url` from the first of `addresses` that connects: the body, or a redirect's
        Location."""
        headers = {"Host": url.netloc.decode("ascii"), "Accept": "image/*",
                   "Accept-Encoding": "identity", "User-Agent": "vlmserve"}
        last: Exception | None = None
        for ip in addresses:
            pinned = url.copy_with(host=str(ip))
            try:
                async with httpx.AsyncClient(verify=self._ssl, trust_env=False,
                                             follow_redirects=False, timeout=None) as client:
                    async with client.stream("GET", pinned, headers=headers,
                                             extensions={"sni_hostname": url.host}) as resp:
                        return await self._body(resp)
            except httpx.ConnectError as e:  # this address does not answer: try the next
                last = e
        assert last is not None
        raise last

    async def _body(self, resp: httpx.Response) -> bytes | str:
        if resp.status_code in _REDIRECTS:
            location = resp.headers.get("location")
            if not location:
                raise _Refused(f"HTTP {resp.status_code} without a Location")
            return location
        if resp.status_code != 200:
            raise _Refused(f"HTTP {resp.status_code}")
        limit = self.policy.max_bytes
        size = resp.headers.get("content-length", "")
        if size.strip().isdigit() and int(size) > limit:
            raise _Refused(f"Content-Length {size} is above {limit} bytes")
        body = bytearray()
        async for chunk in resp.aiter_raw():  # raw: no decompression of a gzip bomb
            body += chunk
            if len(body) > limit:
                raise _Refused(f"body is above {limit} bytes")
        return bytes(body)


def fetch_sync(url: str, policy: FetchPolicy | None = None, index: int | None = None) -> bytes:
    """`RemoteImageFetcher.fetch` for code without an event loop (the offline API)."""
    fetcher = RemoteImageFetcher(policy, 1)
    try:
        return run_sync(fetcher.fetch(url, index))
    finally:
        fetcher.close()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end from code without an event loop, or on a thread of its own
    where a loop already runs in this one (a notebook's)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
