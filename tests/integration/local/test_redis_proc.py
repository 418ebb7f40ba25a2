import socket
from pathlib import Path

import pytest
import redis

from lorafn.local.redis_proc import RedisNotInstalledError, RedisProcess


def test_real_redis_server_starts_persists_and_stops(tmp_path: Path) -> None:
    with RedisProcess(data_dir=tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url)
        client.set("k", "v")
        assert client.get("k") == b"v"
        client.close()
        pid = server.pid
    assert not server.alive()
    assert pid is not None
    # The AOF kept the write: a new server on the same directory sees it.
    with RedisProcess(data_dir=tmp_path / "redis") as again:
        assert redis.Redis.from_url(again.url).get("k") == b"v"


def test_missing_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisNotInstalledError, match="apt-get install redis-server"):
        RedisProcess(data_dir=tmp_path / "r").start()


def test_port_in_use_is_reported(tmp_path: Path) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port}"):
            RedisProcess(data_dir=tmp_path / "r", port=port).start()


def test_local_redis_requires_its_password_and_keeps_it_private(tmp_path: Path) -> None:
    """Issue 15: no local user may write the registry without the password; nothing on disk is readable
    by others; the password is never on the command line."""
    import os
    import stat

    data = tmp_path / "redis"
    with RedisProcess(data_dir=data) as server:
        assert server.password and server.password in server.url
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(host=server.host, port=server.port).hset("lorafn:fn:a/b", "public", "1")
        assert redis.Redis.from_url(server.url).ping()
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert server.password.encode() not in cmdline
        assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
        for name in ("redis.password", "redis.conf"):
            assert stat.S_IMODE(os.stat(data / name).st_mode) == 0o600, name
        first = server.password
        redis.Redis.from_url(server.url).set("k", "v")
    # a restart on the same directory reuses the password (the AOF's data stays reachable)
    with RedisProcess(data_dir=data) as again:
        assert again.password == first
        assert redis.Redis.from_url(again.url).get("k") == b"v"


def test_platform_state_is_private_and_carries_the_password(tmp_path: Path) -> None:
    import os
    import stat

    from lorafn.local.config import PlatformState

    state_dir = tmp_path / "state"
    state_dir.mkdir(mode=0o755)
    with RedisProcess(data_dir=state_dir / "redis") as server:
        state = PlatformState(
            pid=os.getpid(), redis_url=server.url, gateway_url="http://x", key_prefix="p", device="cpu"
        )
        state.write(state_dir)
        assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(PlatformState.path(state_dir)).st_mode) == 0o600
        read = PlatformState.read(state_dir)
        assert redis.Redis.from_url(read.redis_url).ping()  # what status/apply/invoke connect with
        assert server.password not in read.shown_redis_url and "***" in read.shown_redis_url
