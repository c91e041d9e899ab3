"""Real Redis servers and misbehaving listeners on loopback ports, for the remote-tier tests.

``RedisServer`` runs ``redis-server`` (no persistence) on a free port of 127.0.0.1; it can be
stopped, SIGKILLed or restarted. ``SilentListener`` accepts connections and never answers.
``CuttingProxy`` forwards to a server and SIGKILLs it once a blob reply is under way.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """The ``redis-server`` path; skips (fails under ``DSA_AOT_REQUIRE_REDIS=1``, as in CI)
    when it or the ``redis`` package is missing."""
    path = shutil.which("redis-server")
    why = None if path else "redis-server is not installed (apt-get install redis-server)"
    try:
        import redis  # noqa: F401
    except ImportError:
        why = why or "the redis package is not installed (pip install 'dsa-aot[remote]')"
    if why:
        if os.environ.get("DSA_AOT_REQUIRE_REDIS") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return path


class RedisServer:
    """One ``redis-server`` process on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        self.binary = redis_server_binary()
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not come up on port {self.port}")

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=1)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def keys(self, pattern: str = "*") -> list[str]:
        return sorted(k.decode() for k in self.client().keys(pattern))


class ScriptedListener:
    """Accepts TCP connections on a loopback port; answers each with ``reply`` and closes it, or,
    with no reply, holds it open and never sends a byte."""

    def __init__(self, reply: bytes | None = None) -> None:
        self.reply = reply
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._run, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            if self.reply is None:
                self.accepted.append(conn)  # held open, never answered
                continue
            conn.settimeout(2)
            try:
                conn.recv(1024)
                conn.sendall(self.reply)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self._stop = True
        for conn in self.accepted:
            conn.close()
        self.sock.close()


class SilentListener(ScriptedListener):
    """Accepts TCP connections on a loopback port and never sends a byte."""

    def __init__(self) -> None:
        super().__init__(None)


class CuttingProxy:
    """Forwards one loopback port to ``server``; once a request for a blob has gone through,
    lets ``cut_after`` bytes of the reply pass, then SIGKILLs the server (mid-transfer)."""

    def __init__(self, server: RedisServer, cut_after: int) -> None:
        self.server, self.cut_after = server, cut_after
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.cut = threading.Event()
        self.forwarded_after_request = 0
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.server.port))
            state = {"blob_requested": False}
            threading.Thread(target=self._up, args=(client, upstream, state), daemon=True).start()
            threading.Thread(target=self._down, args=(upstream, client, state), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket, state: dict) -> None:
        try:
            while data := client.recv(65536):
                if b":blob:" in data:
                    state["blob_requested"] = True
                upstream.sendall(data)
        except OSError:
            pass

    def _down(self, upstream: socket.socket, client: socket.socket, state: dict) -> None:
        try:
            while data := upstream.recv(65536):
                if state["blob_requested"]:
                    room = self.cut_after - self.forwarded_after_request
                    client.sendall(data[:max(room, 0)])
                    self.forwarded_after_request += min(len(data), max(room, 0))
                    if room <= len(data):
                        self.server.kill()
                        self.cut.set()
                        break
                else:
                    client.sendall(data)
        except OSError:
            pass
        for s in (client, upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.sock.close()
