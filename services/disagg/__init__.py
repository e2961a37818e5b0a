"""Disaggregated serving: prefill and decode workers on Ray, page transfer, routing."""
