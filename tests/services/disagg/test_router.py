"""The cache-aware router's decisions, fed with synthetic KV events (no model, no Ray)."""

from __future__ import annotations

import hashlib

import pytest

from nibble.kernels import PageLayout
from nibble.kernels.errors import RetryableError
from nibble.services.disagg.router import (NoWorkerAvailableError, RouteDecision, Router,
                                           RouterConfig)
from nibble.services.errors import ConfigError
from nibble.tiering.events import KVEvent, KVEventLog
from nibble.tiering.page_record import chain_keys, namespace_root
from nibble.tiering.secret import KVSecret

PS = 4
PROMPT = list(range(100, 141))        # 41 tokens: 10 usable pages (the 11th holds the last token)
SECRET = KVSecret("router-tests-secret-0123456789")


def root(ns: str) -> bytes:
    return hashlib.sha256(b"test-root\0" + ns.encode()).digest()


def keys(n: int, ns: str = "", tokens=PROMPT) -> list[str]:
    return [k.hex() for k in chain_keys(root(ns), tokens[:n * PS], PS, secret=SECRET)]


def ev(kind: str, tier: str, ks: list[str], seq: int = 1) -> dict:
    return {"seq": seq, "kind": kind, "tier": tier, "keys": list(ks)}


def make(decode=("A", "B"), prefill=("P",), **cfg) -> Router:
    r = Router(root, RouterConfig(**cfg), secret=SECRET)
    for w in decode:
        r.add_worker(w, "decode")
    for w in prefill:
        r.add_worker(w, "prefill")
    return r


def hold(r: Router, worker: str, n: int, tier: str = "l1", ns: str = "", first: int = 0) -> None:
    assert r.apply_events(worker, [ev("stored", tier, keys(n, ns)[first:])])


def test_longer_l1_prefix_wins():
    r = make()
    hold(r, "A", 6)
    hold(r, "B", 3)
    d = r.choose("", PROMPT, PS)
    assert d == RouteDecision("A", "P", 6, False, "cache", {"A": 6.0, "B": 3.0}, prompt_pages=10,
                              load_pages=0, prefill_reason="cold")


def test_l3_prefix_against_shorter_l1_prefix_follows_weights():
    r = make()
    hold(r, "A", 8, "l3")             # saves 8 x (1 - 0.6) = 3.2 pages
    hold(r, "B", 4, "l1")             # saves 4 pages
    d = r.choose("", PROMPT, PS)
    assert (d.decode_worker, d.prefix_pages, d.load_pages) == ("B", 4, 0)
    assert d.scores["A"] == pytest.approx(3.2)

    r = make(load_cost={"l1": 0.0, "l2": 0.2, "l3": 0.4})   # cheaper L3: 8 x 0.6 = 4.8
    hold(r, "A", 8, "l3")
    hold(r, "B", 4, "l1")
    d = r.choose("", PROMPT, PS)
    assert (d.decode_worker, d.prefix_pages, d.load_pages, d.reason) == ("A", 8, 8, "cache")


def test_mixed_tiers_rank_l1_over_l2_over_l3():
    r = make(decode=("A", "B", "C"))
    hold(r, "A", 5, "l3")
    hold(r, "B", 5, "l2")
    hold(r, "C", 5, "l1")
    d = r.choose("", PROMPT, PS)
    assert d.decode_worker == "C"
    assert d.scores == pytest.approx({"A": 2.0, "B": 3.75, "C": 5.0})


def test_namespaces_isolate_tenants():
    r = make()
    hold(r, "A", 10, ns="tenant-a")
    other = r.choose("tenant-b", PROMPT, PS)
    assert (other.prefix_pages, other.reason, other.skip_prefill) == (0, "cold", False)
    same = r.choose("tenant-a", PROMPT, PS)
    assert (same.decode_worker, same.prefix_pages, same.skip_prefill) == ("A", 10, True)


def test_stored_and_removed_events_move_the_index():
    r = make(decode=("A",), count_inflight=False)
    k = keys(6)
    r.apply_events("A", [ev("stored", "l1", k, 1)])
    assert r.choose("", PROMPT, PS).prefix_pages == 6
    # pages 3..5 leave L1 for L2: the run stays, three of them now have to be loaded
    r.apply_events("A", [ev("removed", "l1", k[3:], 2), ev("stored", "l2", k[3:], 3)])
    d = r.choose("", PROMPT, PS)
    assert (d.prefix_pages, d.load_pages) == (6, 3)
    assert set(r.view("A").l1) == set(k[:3]) and set(r.view("A").l2) == set(k[3:])
    r.apply_events("A", [ev("removed", "l1", k[1:2], 4)])     # a hole ends the run
    assert r.choose("", PROMPT, PS).prefix_pages == 1
    assert r.last_seq("A") == 4


def test_lost_events_clear_the_view_then_rebuild():
    r = make(decode=("A",))
    hold(r, "A", 8)
    hold(r, "A", 8, "l3")
    k = keys(2)
    assert r.apply_events("A", [ev("stored", "l2", k, 50)], lost=True)
    view = r.view("A")
    assert (len(view.l1), set(view.l2), len(view.l3)) == (0, set(k), 0)
    assert r.choose("", PROMPT, PS).prefix_pages == 2
    assert r.last_seq("A") == 50


def test_load_imbalance_falls_back_to_shortest_queue():
    prompt = list(range(401))         # 100 usable pages: A's cache outweighs its queue penalty
    r = make()
    r.apply_events("A", [ev("stored", "l1", keys(100, tokens=prompt))])
    r.update_load("A", num_running=2, num_queued=9, token_usage=0.5)
    r.update_load("B", num_running=1, num_queued=0, token_usage=0.1)
    d = r.choose("", prompt, PS)
    assert d.scores["A"] > d.scores["B"]
    assert (d.decode_worker, d.reason, d.prefix_pages, d.skip_prefill) == ("B", "load", 0, False)

    for a_queued, b_queued in ((4, 0), (9, 5)):   # not > min_queued; not > 2x the shortest
        r.update_load("A", 2, a_queued, 0.5)
        r.update_load("B", 1, b_queued, 0.1)
        d = r.choose("", prompt, PS)
        assert (d.decode_worker, d.reason, d.skip_prefill) == ("A", "cache", True)


def test_skip_prefill_only_when_every_usable_page_is_held():
    r = make(count_inflight=False)
    hold(r, "A", 4, "l1")
    hold(r, "A", 10, "l3", first=4)
    d = r.choose("", PROMPT, PS)
    assert d == RouteDecision("A", None, 10, True, "cache", d.scores, prompt_pages=10,
                              load_pages=6)
    # page-aligned prompt: the last page is recomputed anyway, so 9 held pages suffice
    assert r.choose("", PROMPT[:40], PS).skip_prefill
    # one more usable page that A lacks: prefill it elsewhere, send only pages 10..
    d = r.choose("", PROMPT + list(range(4)), PS)
    assert (d.skip_prefill, d.prefill_worker, d.prefix_pages, d.prompt_pages) == \
        (False, "P", 10, 11)


def test_short_prompts_use_a_prefill_worker_unless_configured():
    assert make().choose("", [1, 2, 3], PS).prefill_worker == "P"
    d = make(skip_short_prompts=True).choose("", [1, 2, 3], PS)
    assert (d.skip_prefill, d.prefill_worker, d.prefix_pages) == (True, None, 0)


def test_skip_tolerance_is_configurable():
    r = make(skip_max_compute_pages=2)
    hold(r, "A", 8)
    d = r.choose("", PROMPT, PS)
    assert (d.skip_prefill, d.prefix_pages) == (True, 8)


def test_prefill_worker_chosen_by_its_own_prefix_and_load():
    r = make(decode=("A",), prefill=("P1", "P2"), count_inflight=False, queued_cost_pages=0.5)
    hold(r, "P2", 5)
    d = r.choose("", PROMPT, PS)
    assert (d.prefill_worker, d.prefill_reason, d.prefix_pages) == ("P2", "cache", 0)
    r.update_load("P2", 0, 8, 0.0)    # imbalance on the prefill side too
    d = r.choose("", PROMPT, PS)
    assert (d.prefill_worker, d.prefill_reason) == ("P1", "load")


def test_dead_worker_is_removed_and_comes_back_empty():
    r = make()
    hold(r, "A", 8)
    assert r.remove_worker("A") and not r.remove_worker("A")
    assert not r.apply_events("A", [ev("stored", "l1", keys(10))])    # late events: ignored
    assert not r.update_load("A", 1, 1, 0.1)
    d = r.choose("", PROMPT, PS)
    assert (d.decode_worker, d.prefix_pages, set(d.scores)) == ("B", 0, {"B"})
    r.add_worker("A", "decode")       # restarted actor: empty view
    assert len(r.view("A").l1) == 0 and r.last_seq("A") == 0
    assert r.choose("", PROMPT, PS).prefix_pages == 0


def test_no_worker_raises_a_retryable_error():
    with pytest.raises(NoWorkerAvailableError, match="decode"):
        make(decode=()).choose("", PROMPT, PS)
    assert issubclass(NoWorkerAvailableError, RetryableError)
    with pytest.raises(NoWorkerAvailableError, match="prefill"):
        make(prefill=(), local_prefill_fallback=False).choose("", PROMPT, PS)
    d = make(prefill=()).choose("", PROMPT, PS)
    assert (d.skip_prefill, d.prefill_worker, d.reason) == (True, None, "no_prefill_worker")


def test_inflight_requests_spread_a_burst_until_the_next_load_update():
    r = make()
    picks = [r.choose("", PROMPT, PS).decode_worker for _ in range(4)]
    assert picks == ["A", "B", "A", "B"]
    assert r.view("P").load.inflight == 4
    r.update_load("A", 0, 0, 0.0)
    assert r.view("A").load.inflight == 0 and r.choose("", PROMPT, PS).decode_worker == "A"


def test_shared_l3_is_visible_to_every_worker():
    r = make(shared_l3=True, count_inflight=False)
    hold(r, "A", 6, "l3")
    hold(r, "B", 2, "l1")
    d = r.choose("", PROMPT, PS)
    assert d.scores["B"] == pytest.approx(2 + 4 * 0.4)
    r.remove_worker("A")
    assert r.choose("", PROMPT, PS).scores["B"] == pytest.approx(2.0)


def test_tier_sets_are_capped_oldest_first():
    r = make(decode=("A",), max_keys_per_tier=3)
    hold(r, "A", 5)
    assert list(r.view("A").l1) == keys(5)[2:]


def test_malformed_events_are_counted_not_fatal():
    r = make(decode=("A",))
    r.apply_events("A", [ev("stored", "l9", keys(2)),
                         {"kind": "stored", "tier": "l1", "keys": "ab"},
                         ev("stored", "l1", keys(2))])
    assert r.view("A").bad_events == 2 and len(r.view("A").l1) == 2


def test_bad_config_and_roles_are_rejected():
    with pytest.raises(ConfigError):
        RouterConfig(load_cost={"l1": 0.5, "l2": 0.2, "l3": 0.6})
    with pytest.raises(ConfigError):
        make().add_worker("X", "both")
    with pytest.raises(ConfigError):
        make().choose("", PROMPT, 0)


def test_events_from_a_tier_manager_log_match_the_routers_keys():
    """Keys the workers emit (bytes -> hex through KVEventLog) equal the router's own."""
    layout = PageLayout("nvfp4", num_layers=2, num_kv_heads=2, head_dim=64, page_size=16)
    tokens = list(range(1000, 1100))  # 99 // 16 = 6 usable pages
    log = KVEventLog()
    root = namespace_root("fp-1", layout, "t", secret=SECRET)
    log.emit("stored", "l1", chain_keys(root, tokens[:64], 16, secret=SECRET))
    log.emit("stored", "l2", chain_keys(root, tokens[:96], 16, secret=SECRET)[4:])
    events, lost = log.since(0)
    assert isinstance(events[0], KVEvent) and not lost
    r = Router.for_model("fp-1", layout, secret=SECRET)
    r.add_worker("A", "decode")
    r.add_worker("B", "decode")
    r.add_worker("P", "prefill")
    r.apply_events("A", events)                                    # KVEvent objects
    r.apply_poll("B", {"events": [e.__dict__ for e in events[:1]], "last_seq": 2, "lost": False})
    d = r.choose("t", tokens, 16)
    assert (d.decode_worker, d.prefix_pages, d.load_pages, d.skip_prefill) == ("A", 6, 2, True)
    other = Router.for_model("fp-2", layout, secret=SECRET)        # another model: no hit
    other.add_worker("A", "decode")
    other.apply_events("A", events)
    assert other.choose("t", tokens, 16).prefix_pages == 0
    stranger = Router.for_model("fp-1", layout, secret=KVSecret.generate())  # another secret
    stranger.add_worker("A", "decode")
    stranger.apply_events("A", events)
    assert stranger.choose("t", tokens, 16).prefix_pages == 0


def test_a_restarted_event_log_resets_the_view():
    r = make(decode=("A",))
    r.apply_poll("A", {"events": [ev("stored", "l1", keys(6), 40)], "last_seq": 40, "lost": False})
    assert r.last_seq("A") == 40
    # same actor name, fresh log (seq restarts): nothing after 40, but last_seq went back
    assert r.apply_poll("A", {"events": [], "last_seq": 3, "lost": False})
    assert (r.last_seq("A"), len(r.view("A").l1)) == (0, 0)
    r.apply_poll("A", {"events": [ev("stored", "l1", keys(2), 3)], "last_seq": 3, "lost": False})
    assert r.choose("", PROMPT, PS).prefix_pages == 2
