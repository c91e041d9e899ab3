"""The remote tier's read client (``dsa_aot.cache.resp``) against a real ``redis-server``: the
replies ``redis`` gives for the same keys, a password, an ACL user and a database number from
the URL, error replies, and every way a connection fails, each closing the connection."""

from __future__ import annotations

import sys
import time

import pytest

import _redis
from dsa_aot.cache.resp import RespClient, RespConnectionError, RespError, supported


def _client(url: str, timeout_s: float = 0.5) -> RespClient:
    return RespClient(url, connect_timeout_s=0.1, timeout_s=timeout_s)


def test_replies_equal_the_redis_packages(redis_server):
    ref = redis_server.client()
    big = bytes(range(256)) * 8192 + b"\r\n$-1\r\n"  # 2 MiB with protocol bytes inside
    ref.set("a", b"1")
    ref.set("big", big)
    ref.sadd("s", b"x", b"y", b"z")
    ours = _client(redis_server.url)
    assert ours.get("a") == ref.get("a") == b"1"
    assert ours.get("absent") is None
    assert ours.get("big") == big
    assert ours.mget(["a", "absent", "big"]) == ref.mget(["a", "absent", "big"])
    assert sorted(ours.smembers("s")) == sorted(ref.smembers("s")) == [b"x", b"y", b"z"]
    assert ours.smembers("absent") == []
    assert ours.command("PING") == "PONG" and ours.command("EXISTS", "a") == 1


def test_password_user_and_database_from_the_url(redis_server):
    admin = redis_server.client()
    admin.execute_command("SELECT", 3)
    admin.set("k", b"in db 3")
    admin.execute_command("SELECT", 0)
    admin.execute_command("ACL", "SETUSER", "reader", "on", ">r3ad", "~*", "+@read", "+select", "+auth")
    admin.config_set("requirepass", "s3cr:t/")
    base = f"127.0.0.1:{redis_server.port}"
    assert _client(f"redis://:s3cr%3At%2F@{base}/3").get("k") == b"in db 3"
    assert _client(f"redis://reader:r3ad@{base}/3").get("k") == b"in db 3"
    assert _client(f"redis://reader:r3ad@{base}?db=3").get("k") == b"in db 3"
    with pytest.raises(RespConnectionError, match="AUTH refused"):
        _client(f"redis://:wrong@{base}/3").get("k")
    with pytest.raises(RespError, match="NOAUTH"):
        _client(f"redis://{base}/0").get("k")  # no password: the command itself is refused
    with pytest.raises(RespError, match="NOPERM"):
        _client(f"redis://reader:r3ad@{base}/0").command("SET", "k", "v")


def test_error_reply_keeps_the_connection_usable(redis_server):
    ours = _client(redis_server.url)
    with pytest.raises(RespError, match="unknown command"):
        ours.command("NOSUCHCOMMAND")
    redis_server.client().set("a", b"2")
    assert ours.get("a") == b"2"


def test_refused_and_silent_servers_fail_within_the_timeouts():
    port = _redis.free_port()
    start = time.perf_counter()
    with pytest.raises(RespConnectionError):
        _client(f"redis://127.0.0.1:{port}/0").get("k")
    silent = _redis.SilentListener()
    try:
        with pytest.raises(RespConnectionError, match="timed out"):
            _client(silent.url, timeout_s=0.3).get("k")
    finally:
        silent.close()
    assert time.perf_counter() - start < 2.0


@pytest.mark.parametrize("reply, why", [
    (b"$10\r\nshort", "closed the connection mid-reply"),
    (b"$3\r\nabcXY", "does not end with CRLF"),
    (b"?what\r\n", "unexpected reply type"),
    (b"$x\r\n", "invalid literal"),
    (b"", "closed the connection"),
])
def test_malformed_or_cut_replies_close_the_connection(reply, why):
    server = _redis.ScriptedListener(reply)
    try:
        ours = _client(server.url)
        with pytest.raises(RespConnectionError, match=why):
            ours.get("k")
        assert ours._sock is None and not ours._buf
    finally:
        server.close()


def test_only_plain_and_unix_urls_are_read_here():
    assert supported("redis://h:1/0") and supported("unix:///run/redis.sock")
    assert not supported("rediss://h:1/0")
    with pytest.raises(ValueError):
        RespClient("rediss://h:1/0", connect_timeout_s=0.1, timeout_s=0.1)


def test_first_remote_read_imports_no_redis_package(redis_server, tmp_path):
    """What a first call from the remote tier imports: not ``redis`` (40-200 ms)."""
    import subprocess
    import textwrap

    code = textwrap.dedent(f"""
        import sys
        from dsa_aot.cache.remote import RemoteStore
        store = RemoteStore({redis_server.url!r})
        assert store.lookup("0" * 16, "sm_90a", "fwd-sm_90a-d512-h16-noncompact-tilelang") is None
        assert list(store.candidates("sm_90a", "fwd-sm_90a-d512-h16-noncompact-tilelang")) == []
        print(sorted(m for m in sys.modules if m == "redis" or m.startswith("redis.")))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
