"""The remote tier's read path on the Redis wire protocol (RESP2), with the standard library only.

A first call served from the remote tier asks the server three things (``GET`` a manifest,
``SMEMBERS`` of a spec, ``MGET`` of its blobs). The ``redis`` package costs 40-200 ms to import
(it pulls in ``asyncio`` and ``importlib.metadata``), more than the whole remote hit; so those
reads go through this client, and everything else (pushes, leases, the CLI) through ``redis``.
``redis://`` and ``unix://`` URLs with a user, a password and a database number are read here;
any other scheme (``rediss://``) is left to the ``redis`` package.

One connection, one command at a time (a lock), connect and socket timeouts on every call, no
retry: any socket error, timeout or malformed reply closes the connection and raises
:class:`RespConnectionError`, so a reply cut half-way is never parsed further or reused.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import parse_qs, unquote, urlsplit

_CRLF = b"\r\n"
_CHUNK = 1 << 16


class RespConnectionError(ConnectionError):
    """The server could not be reached, timed out, closed the connection or sent garbage."""


class RespError(Exception):
    """The server answered with an error reply (``-ERR ...``)."""


def supported(url: str) -> bool:
    """Whether :class:`RespClient` reads this URL (``redis://`` or ``unix://``)."""
    return urlsplit(url).scheme in ("redis", "unix")


class RespClient:
    """``GET``, ``MGET`` and ``SMEMBERS`` against one Redis server."""

    def __init__(self, url: str, *, connect_timeout_s: float, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "unix"):
            raise ValueError(f"{parts.scheme}:// is not read by RespClient")
        query = parse_qs(parts.query)
        self._unix = parts.path if parts.scheme == "unix" else None
        self._address = (parts.hostname or "localhost", parts.port or 6379)
        db = query.get("db", [""])[0] or (parts.path.strip("/") if parts.scheme == "redis" else "")
        self._db = int(db) if db else 0
        self._username = unquote(parts.username) if parts.username else None
        self._password = unquote(parts.password) if parts.password else None
        self.connect_timeout_s, self.timeout_s = connect_timeout_s, timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray()
        self._lock = threading.Lock()

    # -- commands ---------------------------------------------------------------------------
    def get(self, key: str) -> bytes | None:
        return self.command("GET", key)

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return self.command("MGET", *keys)

    def smembers(self, key: str) -> list[bytes]:
        return self.command("SMEMBERS", key)

    def command(self, *args: str | bytes) -> object:
        """Send one command, return its decoded reply (raises RespConnectionError, RespError)."""
        with self._lock:
            try:
                if self._sock is None:
                    self._connect()
                self._send(args)
                reply = self._reply()
            except (OSError, ValueError, IndexError) as exc:
                self.close()
                raise RespConnectionError(f"{type(exc).__name__}: {exc}") from None
        if isinstance(reply, RespError):
            raise reply
        return reply

    def close(self) -> None:
        sock, self._sock = self._sock, None
        self._buf.clear()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    # -- the wire ---------------------------------------------------------------------------
    def _connect(self) -> None:
        if self._unix is not None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout_s)
            try:
                sock.connect(self._unix)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(self._address, timeout=self.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout_s)
        self._sock, self._buf = sock, bytearray()
        setups = []
        if self._password:
            setups.append(["AUTH", self._username, self._password] if self._username else ["AUTH", self._password])
        if self._db:
            setups.append(["SELECT", str(self._db)])
        for setup in setups:
            self._send(setup)
            reply = self._reply()
            if isinstance(reply, RespError):
                raise OSError(f"{setup[0]} refused: {reply}")

    def _send(self, args) -> None:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            data = a if isinstance(a, bytes) else str(a).encode()
            out += [b"$%d\r\n" % len(data), data, _CRLF]
        assert self._sock is not None
        self._sock.sendall(b"".join(out))

    def _fill(self, n: int) -> None:
        """Read until the buffer holds at least ``n`` bytes."""
        assert self._sock is not None
        while len(self._buf) < n:
            chunk = self._sock.recv(max(_CHUNK, n - len(self._buf)))
            if not chunk:
                raise ConnectionError("the server closed the connection mid-reply")
            self._buf += chunk

    def _line(self) -> bytes:
        start = 0
        while True:
            end = self._buf.find(_CRLF, start)
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[:end + 2]
                return line
            start = max(0, len(self._buf) - 1)
            self._fill(len(self._buf) + 1)

    def _reply(self) -> object:
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            self._fill(n + 2)
            data = bytes(self._buf[:n])
            if self._buf[n:n + 2] != _CRLF:
                raise ValueError("a bulk reply does not end with CRLF")
            del self._buf[:n + 2]
            return data
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        if kind == b"+":
            return rest.decode()
        if kind == b":":
            return int(rest)
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        raise ValueError(f"unexpected reply type {kind!r}")
