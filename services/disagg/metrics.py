"""Nibble's gauges and counters exported through ``ray.util.metrics`` (Ray dashboard)."""

from __future__ import annotations

from ray.util import metrics as rm


class RayMetrics:
    """Updated by the router actor on each poll; names use ``nibble_`` (Ray forbids ':')."""

    def __init__(self):
        self.running = rm.Gauge("nibble_num_running_reqs", "Running requests per worker",
                                tag_keys=("worker",))
        self.queued = rm.Gauge("nibble_num_queue_reqs", "Queued requests per worker",
                               tag_keys=("worker",))
        self.usage = rm.Gauge("nibble_token_usage", "KV pool pages in use (0..1) per worker",
                              tag_keys=("worker",))
        self.transfers = rm.Gauge("nibble_kv_transfers", "KV transfers by outcome",
                                  tag_keys=("outcome",))
        self.transfer_bytes = rm.Gauge("nibble_kv_transfer_bytes", "Page bytes moved by transfers")
        self.alive = rm.Gauge("nibble_workers_alive", "Workers the router can reach")

    def export(self, orch) -> None:
        for name, view in ((n, orch.router.view(n)) for n in orch.roles):
            load = getattr(view, "load", None) if view is not None else None
            if load is not None:
                tags = {"worker": name}
                self.running.set(load.num_running, tags=tags)
                self.queued.set(load.num_queued, tags=tags)
                self.usage.set(load.token_usage, tags=tags)
        for outcome in ("transfer_success", "transfer_failed", "recomputed", "prefill_skipped"):
            self.transfers.set(orch.counts.get(outcome, 0), tags={"outcome": outcome})
        self.transfer_bytes.set(orch.counts.get("transfer_bytes", 0))
        self.alive.set(len(orch.alive))
