"""Finding 5 of issue 14, worker side: where the transfer server listens, what decode checks.

``transport_options`` turns the disaggregation config into transport options:
loopback on a local cluster (the old code bound the node's Ray address even
there), ``--kv-transfer-host`` or the node's address on a joined cluster, mutual
TLS from ``--kv-transfer-ssl-*``. ``check_transfer`` is the decode worker's test
of a finished transfer: a checksum signed for this ticket, equal to the pages'.
"""

from __future__ import annotations

import pytest

from nibble.services.config import DisaggConfig
from nibble.services.disagg.transfer_state import TransferError
from nibble.services.disagg.worker import check_transfer, transport_options
from nibble.services.errors import ConfigError
from nibble.tiering.transfer import checksum_tag, make_ticket

KEY = b"t" * 32


def _node_ip():
    return "10.1.2.3"


def _opts(**kw):
    return transport_options(DisaggConfig(disaggregate=True, **kw), KEY, _node_ip)


def test_a_local_cluster_binds_loopback_only():
    assert _opts() == {"secret": KEY, "address": "127.0.0.1:0", "loopback_only": True}
    assert _opts(kv_transfer_host="::1")["address"] == "[::1]:0"
    for host in ("0.0.0.0", "10.1.2.3"):
        with pytest.raises(ConfigError, match="loopback"):
            _opts(kv_transfer_host=host)


def test_a_joined_cluster_binds_the_configured_interface_or_the_node_address():
    joined = dict(ray_address="10.0.0.1:6379")
    assert _opts(**joined) == {"secret": KEY, "address": "10.1.2.3:0", "loopback_only": False}
    assert _opts(kv_transfer_host="192.168.7.7", **joined)["address"] == "192.168.7.7:0"
    wild = _opts(kv_transfer_host="0.0.0.0", **joined)
    assert (wild["address"], wild["advertise_host"]) == ("0.0.0.0:0", "10.1.2.3")


def test_tls_options_come_together_and_only_for_grpc():
    tls = dict(kv_transfer_ssl_certfile="c.pem", kv_transfer_ssl_keyfile="k.pem",
               kv_transfer_ssl_ca_certs="ca.pem")
    got = _opts(**tls)
    assert (got["ssl_certfile"], got["ssl_keyfile"], got["ssl_ca_certs"]) == (
        "c.pem", "k.pem", "ca.pem")
    with pytest.raises(ConfigError, match="together"):
        _opts(kv_transfer_ssl_certfile="c.pem", kv_transfer_ssl_keyfile="k.pem")
    with pytest.raises(ConfigError, match="no TLS"):
        _opts(kv_transport="nixl", **tls)
    assert _opts(kv_transport="nixl") == {"secret": KEY}


def test_decode_accepts_only_a_checksum_signed_for_its_ticket():
    a = make_ticket(KEY, "rx", "req-a", [1, 2], 64, 2e9)
    b = make_ticket(KEY, "rx", "req-b", [3, 4], 64, 2e9)
    check_transfer(KEY, a, "c0ffee", checksum_tag(KEY, a, "c0ffee"), "c0ffee")
    with pytest.raises(TransferError, match="mismatch"):          # pages differ from it
        check_transfer(KEY, a, "c0ffee", checksum_tag(KEY, a, "c0ffee"), "bad")
    with pytest.raises(TransferError, match="not signed"):        # swapped with the pages
        check_transfer(KEY, a, "bad", checksum_tag(b"x" * 32, a, "bad"), "bad")
    with pytest.raises(TransferError, match="not signed"):        # replayed from transfer a
        check_transfer(KEY, b, "c0ffee", checksum_tag(KEY, a, "c0ffee"), "c0ffee")
    with pytest.raises(TransferError, match="not signed"):
        check_transfer(KEY, a, "c0ffee", b"", "c0ffee")


def test_a_worker_whose_engine_died_exits_for_ray_to_restart_it():
    """The poll gets EngineDeadError (the router routes around the worker) and the process
    exits non-zero once no call is in flight (the calls' own order: test_exit_gate.py)."""
    import asyncio
    import types

    from nibble.services.disagg import worker as worker_mod
    from nibble.services.disagg.exit_gate import ExitGate
    from nibble.services.errors import EngineDeadError

    exits, timers = [], []
    gate = ExitGate(worker_mod.DEVICE_FAULT_EXIT_CODE, exit_fn=exits.append,
                    call_later=lambda delay, fn, *a: timers.append((delay, fn, a)))
    engine = types.SimpleNamespace(is_healthy=lambda: False,
                                   dead_reason="engine stopped after a device fault: ...")
    fake = types.SimpleNamespace(engine=engine, worker_id="nibble-decode-0", gate=gate)
    with pytest.raises(EngineDeadError, match="nibble-decode-0: engine stopped"):
        asyncio.run(worker_mod.EngineWorker.stats(fake))
    assert exits == [] and gate.reason is not None
    for _, fn, args in sorted(timers, key=lambda t: t[0]):
        fn(*args)
    assert exits[0] == worker_mod.DEVICE_FAULT_EXIT_CODE != 0
