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
