"""Rendered chart variants, shared by the tests of this folder (rendered once per session)."""

from __future__ import annotations

import pytest
import yaml

from .helpers import CHART, crd_schemas, render

# Values that switch on every optional branch of the templates.
FULL_VALUES = {
    "auth": {"apiKeys": ["test-api-key-0001", "test-api-key-0002"],
             "adminApiKeys": ["test-admin-key-0001"],
             "kvSecret": "test-kv-secret-0123456789abcdef"},
    "redis": {"external": {"url": "redis://:hunter2-redis-pw@redis.example.internal:6379/3"}},
    "model": {"volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}},
    "serve": {"flags": {"model-path": "/models/SmolLM2", "max-total-tokens": 1000000,
                        "mem-fraction-static": 0.5, "disable-radix-cache": False,
                        "schedule-policy": "lpm", "hicache-storage-ttl": 86400, "device": None}},
    "serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}},
    "gateway": {"replicas": 2, "podAnnotations": {"example.com/team": "inference"}},
    "ray": {"prefill": {"replicas": 3}, "decode": {"replicas": 2,
                                                   "rayStartParams": {"num-cpus": "4"}}},
}
# An existing Secret, the file L3 tier, no gRPC, no monitoring objects.
EXISTING_SECRET_VALUES = {
    "auth": {"existingSecret": "my-nibble-keys"},
    "hierarchicalCache": {"storage": "file"},
    "gateway": {"grpc": {"enabled": False}},
    "serviceMonitor": {"enabled": False},
    "podDisruptionBudget": {"enabled": False},
    "serviceAccount": {"create": False},
}
# TLS on the gateway (client certificates required) and mutual TLS between workers.
TLS_VALUES = {
    "gateway": {"tls": {"secretName": "nibble-tls", "requireClientCertificates": True}},
    "ray": {"transferTls": {"secretName": "nibble-transfer-tls"}},
}
# Tensor-parallel worker groups: two ranks (two GPUs) per prefill and per decode pod.
TP2_VALUES = {"ray": {"prefill": {"tpSize": 2}, "decode": {"tpSize": 2}}}
# Different prefill and decode sizes (nibble serve refuses them: the flags say so).
TP_MIXED_VALUES = {"ray": {"prefill": {"tpSize": 1}, "decode": {"tpSize": 2}}}
GPU = CHART / "values-gpu.yaml"
VARIANTS = {
    "cpu": ((), (), None),
    # Not named "gpu": tests/conftest.py skips items with a "gpu" keyword on CPU machines.
    "gpu-values": ((GPU,), (), None),
    "colocated": ((), ("disaggregation.enabled=false",), None),
    "gpu-values-colocated": ((GPU,), ("disaggregation.enabled=false",), None),
    "full": ((), (), FULL_VALUES),
    "existing-secret": ((), (), EXISTING_SECRET_VALUES),
    "no-hicache": ((), ("hierarchicalCache.enabled=false",), None),
    "tls": ((), (), TLS_VALUES),
    "gpu-values-tp2": ((GPU,), (), TP2_VALUES),
    "tp-mixed": ((), (), TP_MIXED_VALUES),
}


@pytest.fixture(scope="session")
def rendered(tmp_path_factory):
    """variant name -> rendered manifests (each variant rendered once)."""
    cache: dict[str, list[dict]] = {}
    tmp = tmp_path_factory.mktemp("values")

    def get(variant: str) -> list[dict]:
        if variant not in cache:
            files, sets, extra = VARIANTS[variant]
            if extra is not None:
                path = tmp / f"{variant}.yaml"
                path.write_text(yaml.safe_dump(extra))
                files = (*files, path)
            cache[variant] = render(files, sets)
        return cache[variant]

    return get


@pytest.fixture(scope="session")
def crds():
    return crd_schemas()
