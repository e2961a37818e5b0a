"""Redis L3: key layout, TTL, prefix isolation, and losing Redis without failing a request."""

import pytest

redis = pytest.importorskip("redis")

from nibble.tiering.page_record import PageRecordError
from nibble.tiering.storage import RedisStorage

from .conftest import FAST_BACKOFF, free_port, wait_for

pytestmark = pytest.mark.redis


def _kill_clients(raw: redis.Redis, name: str) -> list[str]:
    ids = [c["id"] for c in raw.client_list() if c["name"] == name]
    for cid in ids:
        raw.client_kill_filter(_id=cid)
    return ids


def test_keys_are_prefix_plus_hex(make_backend, raw_redis, pages):
    store = make_backend("redis")
    p = pages("nvfp4", 2)
    store.put_batch(p.items)
    for key, rec in p.items:
        assert raw_redis.get(store.prefix + key.hex()) == rec
        assert raw_redis.ttl(store.prefix + key.hex()) == -1  # no TTL unless configured


def test_ttl_is_set_when_configured(make_backend, raw_redis, pages):
    store = make_backend("redis", ttl_s=30)
    p = pages("fp8_e4m3", 3)
    assert store.put_batch(p.items) == 3
    for key in p.keys:
        assert 25_000 < raw_redis.pttl(store.prefix + key.hex()) <= 30_000


def test_clear_leaves_every_foreign_key(make_backend, raw_redis, redis_prefix, pages):
    # Glob characters in the prefix must match literally, not as a pattern.
    store = make_backend("redis", "k*[v]")
    assert store.prefix == redis_prefix + "k*[v]:"
    p = pages("nvfp4", 3)
    store.put_batch(p.items)
    foreign = [redis_prefix + "kXXv:" + p.keys[0].hex(),  # matches the unescaped glob
               redis_prefix + "other:" + p.keys[0].hex(),
               store.prefix + "meta", store.prefix + p.keys[0].hex().upper(),
               store.prefix + "abc"]
    for k in foreign:
        raw_redis.set(k, b"keep")
    assert store.clear() == 3
    assert store.exists_batch(p.keys) == [False] * 3
    assert [raw_redis.get(k) for k in foreign] == [b"keep"] * len(foreign)


def test_corrupted_value_is_returned_and_rejected_by_its_tag(make_backend, raw_redis, pages):
    store = make_backend("redis")
    p = pages("nvfp4", 2)
    store.put_batch(p.items)
    rkey = store.prefix + p.keys[0].hex()
    pos = len(p.records[0]) - 100  # inside the payload (the scales of the last layer)
    raw_redis.setrange(rkey, pos, bytes([p.records[0][pos] ^ 0x01]))
    raw_redis.set(store.prefix + p.keys[1].hex(), p.records[1][:20])  # truncated
    bad, short = store.get_batch(p.keys)
    assert len(bad) == len(p.records[0]) and bad != p.records[0]
    with pytest.raises(PageRecordError, match="authenticate") as err:
        p.decode(0, bad)
    assert err.value.reason == "auth"
    with pytest.raises(PageRecordError, match="truncated"):
        p.decode(1, short)
    assert store.health().state == "up"


def test_server_error_reply_is_a_miss_not_an_outage(make_backend, raw_redis):
    store = make_backend("redis")
    key = b"\x05" * 32
    raw_redis.hset(store.prefix + key.hex(), "f", "v")  # WRONGTYPE for GET
    assert store.get_batch([key]) == [None]
    assert store.stats()["errors"] == 1
    assert store.health().state == "up" and "WRONGTYPE" in store.health().last_error
    assert store.put_batch([(key, b"v")]) == 1  # SET replaces any type
    assert store.get_batch([key]) == [b"v"]


def test_client_kill_never_fails_a_request(make_backend, raw_redis, pages):
    """redis-py replaces a killed idle connection when it next checks it out."""
    store = make_backend("redis")
    p = pages("nvfp4", 4)
    store.put_batch(p.items)
    killed = _kill_clients(raw_redis, store.client_name)
    assert killed
    got = store.get_batch(p.keys)  # must not raise: values or misses
    assert all(g is None or g == r for g, r in zip(got, p.records))
    assert wait_for(lambda: store.health().state == "up")
    assert store.get_batch(p.keys) == p.records
    now = [c["id"] for c in raw_redis.client_list() if c["name"] == store.client_name]
    assert now and not set(now) & set(killed)


def test_client_kill_without_reconnect_goes_down_then_up(private_redis, make_backend, pages):
    raw = redis.Redis.from_url(private_redis.url)
    store = make_backend("redis", url=private_redis.url)
    p = pages("fp8_e4m3", 3)
    assert store.put_batch(p.items) == 3
    raw.config_set("maxclients", 1)  # only `raw` fits: the backend cannot reconnect
    assert _kill_clients(raw, store.client_name)
    assert store.get_batch(p.keys) == [None] * 3
    health = store.health()
    assert health.state == "down" and "max number of clients" in health.last_error
    assert store.put_batch(p.items) == 0 and store.exists_batch(p.keys) == [False] * 3
    assert wait_for(lambda: store.health().reconnect_attempts >= 2)
    assert store.health().state == "down"
    raw.config_set("maxclients", 1000)
    assert wait_for(lambda: store.health().state == "up")
    assert store.get_batch(p.keys) == p.records  # the server kept the data
    stats = store.stats()
    assert stats["reconnects"] == 1 and stats["skipped"] >= 2
    raw.close()


def test_a_stalled_server_times_out_into_down_then_recovers(private_redis, make_backend):
    raw = redis.Redis.from_url(private_redis.url)
    store = make_backend("redis", url=private_redis.url, socket_timeout=0.2)
    key = b"\x09" * 32
    raw.execute_command("CLIENT", "PAUSE", 800, "WRITE")
    assert store.put_batch([(key, b"v")]) == 0  # blocked write: timeout, no exception
    assert store.health().state == "down" and "Timeout" in store.health().last_error
    assert wait_for(lambda: store.health().state == "up")  # PING is not a write
    raw.execute_command("CLIENT", "UNPAUSE")
    assert store.put_batch([(key, b"w")]) == 1
    assert store.get_batch([key]) == [b"w"]
    raw.close()


def test_redis_stopped_mid_run_then_restarted(private_redis, make_backend, pages):
    store = make_backend("redis", url=private_redis.url)
    p = pages("nvfp4", 3)
    assert store.put_batch(p.items) == 3
    private_redis.stop()
    assert store.get_batch(p.keys) == [None] * 3
    assert store.health().state == "down"
    assert store.put_batch(p.items) == 0
    assert store.exists_batch(p.keys) == [False] * 3
    assert store.delete_batch(p.keys) == 0 and store.clear() == 0
    assert wait_for(lambda: store.health().reconnect_attempts >= 2)
    private_redis.start()  # same port, empty: nothing was persisted
    assert wait_for(lambda: store.health().state == "up")
    assert store.get_batch(p.keys) == [None] * 3
    assert store.put_batch(p.items) == 3
    assert store.get_batch(p.keys) == p.records


def test_unreachable_at_start_is_down_not_an_error(pages):
    store = RedisStorage(f"redis://127.0.0.1:{free_port()}/0", prefix="nibble:test:none:",
                         connect_timeout=0.2, **FAST_BACKOFF)
    try:
        p = pages("nvfp4", 2)
        assert store.health().state == "down"
        assert store.get_batch(p.keys) == [None, None]
        assert store.put_batch(p.items) == 0
        assert store.stats()["misses"] == 2
    finally:
        store.close()
    assert store.health().last_error == "closed"


def test_bad_url_raises():
    with pytest.raises(ValueError):
        RedisStorage("http://127.0.0.1:6379", prefix="nibble:test:x:")
