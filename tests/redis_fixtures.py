"""Redis for tests: the shared server at 127.0.0.1:6379 if it answers, else a private one.

* ``redis_url``: the Redis at 127.0.0.1:6379 if it answers, else a private
  ``redis-server`` on a free port for the whole session (stopped by PID).
* ``redis_prefix``: a random key prefix per test; every key under it is
  deleted afterwards.
* ``private_redis``: a ``redis-server`` of the test's own (no persistence),
  which the test may stop and restart; always stopped by PID at the end.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
import uuid

import pytest

try:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry
except ImportError:     # a GPU machine with torch alone: the redis-marked tests skip
    redis = None

SHARED_HOST, SHARED_PORT = "127.0.0.1", 6379


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout: float = 5.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(step)
    return bool(pred())


def _answers(host: str, port: int, password: str | None = None) -> bool:
    try:
        with redis.Redis(host=host, port=port, socket_connect_timeout=0.5, password=password,
                         retry=Retry(NoBackoff(), 0)) as r:  # no retries: answer now
            return bool(r.ping())
    except redis.RedisError:
        return False


class RedisServer:
    """A private redis-server on 127.0.0.1 (no RDB, no AOF), controlled by its PID."""

    def __init__(self, workdir, port: int | None = None, password: str | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed")
        self.workdir, self.port = workdir, port or free_port()
        self.password = password          # requirepass, set through the config file
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        conf = []
        if self.password is not None:     # a config file keeps it out of this test's argv
            path = self.workdir / "redis.conf"
            path.write_text(f"requirepass {self.password}\n")
            conf = [str(path)]
        self.proc = subprocess.Popen(
            [self.binary, *conf, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if not wait_for(lambda: _answers("127.0.0.1", self.port, self.password)):
            self.stop()
            pytest.fail(f"private redis-server did not start on port {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):
    if redis is None:
        pytest.skip("the redis package is not installed")
    if _answers(SHARED_HOST, SHARED_PORT):
        yield f"redis://{SHARED_HOST}:{SHARED_PORT}/0"
        return
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def raw_redis(redis_url):
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def redis_prefix(raw_redis):
    prefix = f"nibble:test:{uuid.uuid4().hex}:"
    yield prefix
    keys = list(raw_redis.scan_iter(match=prefix + "*", count=1000))
    if keys:
        raw_redis.unlink(*keys)


@pytest.fixture
def private_redis(tmp_path):
    if redis is None:
        pytest.skip("the redis package is not installed")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
