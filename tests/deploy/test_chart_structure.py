"""Facts about the rendered chart that a schema cannot check: security, probes, wiring."""

from __future__ import annotations

import base64
import json

import pytest
import yaml

from .conftest import FULL_VALUES, VARIANTS
from .helpers import (NAMESPACE, arg_value, config_lines, find, one, pod_specs, render,
                      run_helm, template_args)

ALL = sorted(VARIANTS)


def containers(template: dict) -> list[dict]:
    spec = template["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def gateway(docs):
    return one(docs, "Deployment", "-gateway")["spec"]["template"]


@pytest.mark.parametrize("variant", ALL)
def test_every_pod_is_non_root_read_only_and_drops_all_capabilities(rendered, variant):
    pods = list(pod_specs(rendered(variant)))
    assert pods
    for name, template in pods:
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"].get("runAsUser", 0) != 0, name
        assert spec.get("automountServiceAccountToken") is False, name
        for c in containers(template):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert "ALL" in sc["capabilities"]["drop"], (name, c["name"])
            assert c.get("resources", {}).get("requests"), (name, c["name"])


@pytest.mark.parametrize("variant", ALL)
def test_writable_paths_are_volumes(rendered, variant):
    """With a read-only root, /tmp (Ray sessions) and $HOME (caches) must be emptyDirs."""
    for name, template in pod_specs(rendered(variant)):
        if "redis" in name:
            continue
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for c in template["spec"]["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            for path in ("/tmp", "/home/nibble"):
                assert "emptyDir" in volumes[mounts[path]], (name, path)
            home = [e["value"] for e in c["env"] if e["name"] == "HOME"]
            assert home == ["/home/nibble"], name


@pytest.mark.parametrize("variant", ALL)
def test_every_container_has_readiness_and_liveness_probes(rendered, variant):
    for name, template in pod_specs(rendered(variant)):
        for c in template["spec"]["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe"), (name, c["name"])


@pytest.mark.parametrize("variant", ALL)
def test_gateway_probes_http_health_and_grpc_health(rendered, variant):
    docs = rendered(variant)
    c = gateway(docs)["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["http"] == 30000
    if variant == "tls":       # the kubelet has no client certificate: a TCP check
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert c[probe]["tcpSocket"] == {"port": "http"}
        return
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    if find(docs, "Service", "-grpc"):
        assert c["readinessProbe"]["grpc"] == {"port": 30001}
        assert ports["grpc"] == 30001
    else:
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert "grpc" not in ports


@pytest.mark.parametrize("variant", ALL)
def test_services_and_budgets_select_the_right_pods(rendered, variant):
    docs = rendered(variant)
    pods = {name: t["metadata"]["labels"] for name, t in pod_specs(docs)}
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            assert selects(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])
        if d["kind"] == "Service":
            hit = [n for n, labels in pods.items() if selects(d["spec"]["selector"], labels)]
            assert hit, f"Service {d['metadata']['name']} selects no pod"
        if d["kind"] == "PodDisruptionBudget":
            hit = [n for n, labels in pods.items() if selects(d["spec"]["selector"]["matchLabels"], labels)]
            assert len(hit) == 1, (d["metadata"]["name"], hit)
    http = one(docs, "Service", "nibble")
    assert [(p["name"], p["port"]) for p in http["spec"]["ports"]] == [("http", 30000)]
    for grpc in find(docs, "Service", "-grpc"):
        assert grpc["spec"]["ports"][0]["appProtocol"] == "grpc"
        assert grpc["spec"]["ports"][0]["port"] == 30001


@pytest.mark.parametrize("variant", ["cpu", "full", "colocated"])
def test_service_monitors_scrape_metrics(rendered, variant):
    docs = rendered(variant)
    services = find(docs, "Service")
    monitors = find(docs, "ServiceMonitor")
    assert monitors
    for m in monitors:
        targets = [s for s in services if selects(m["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
        assert len(targets) == 1, (m["metadata"]["name"], [s["metadata"]["name"] for s in targets])
        for ep in m["spec"]["endpoints"]:
            assert ep["path"] == "/metrics"
            assert ep["port"] in {p["name"] for p in targets[0]["spec"]["ports"]}
        assert m["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    ray_monitor = find(docs, "ServiceMonitor", "-ray")
    assert bool(ray_monitor) == (variant != "colocated")
    if variant == "full":
        assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors)


def _limits(c: dict) -> dict:
    return c["resources"].get("limits", {})


def test_gpu_values_request_one_gpu_per_ray_worker(rendered):
    cluster = one(rendered("gpu-values"), "RayCluster")
    for group in cluster["spec"]["workerGroupSpecs"]:
        c = group["template"]["spec"]["containers"][0]
        assert _limits(c)["nvidia.com/gpu"] == 1, group["groupName"]
        assert c["image"].endswith("-cuda")
        tolerations = group["template"]["spec"]["tolerations"]
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
        assert group["template"]["spec"]["nodeSelector"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in _limits(head)
    gw = gateway(rendered("gpu-values"))["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in _limits(gw)
    args = config_lines(rendered("gpu-values"), "serve.args")
    assert arg_value(args, "--device") == "cuda"


def test_tp_size_asks_for_a_gpu_per_rank_and_is_passed_to_serve(rendered):
    docs = rendered("gpu-values-tp2")
    cluster = one(docs, "RayCluster")
    for group in cluster["spec"]["workerGroupSpecs"]:
        c = group["template"]["spec"]["containers"][0]
        assert _limits(c)["nvidia.com/gpu"] == 2, group["groupName"]
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 2, group["groupName"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in _limits(head)
    args = config_lines(docs, "serve.args")
    assert arg_value(args, "--tp-size") == "2"
    assert arg_value(args, "--prefill-tp-size") is None
    assert arg_value(config_lines(rendered("gpu-values"), "serve.args"), "--tp-size") == "1"


def test_tp_size_on_cpu_groups_asks_for_no_gpu(rendered):
    docs = rendered("tp-mixed")
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(docs)
    args = config_lines(docs, "serve.args")
    assert arg_value(args, "--tp-size") is None
    assert (arg_value(args, "--prefill-tp-size"), arg_value(args, "--decode-tp-size")) == ("1", "2")


def test_serve_tp_size_is_refused_with_disaggregation():
    proc = run_helm(*template_args((), ("serve.flags.tp-size=2",)), check=False)
    assert proc.returncode != 0 and "ray.prefill.tpSize" in proc.stderr
    colocated = render(sets=("serve.flags.tp-size=2", "disaggregation.enabled=false"))
    assert arg_value(config_lines(colocated, "serve.args"), "--tp-size") == "2"


def test_gpu_colocated_puts_the_gpu_on_the_gateway(rendered):
    docs = rendered("gpu-values-colocated")
    assert not find(docs, "RayCluster")
    assert _limits(gateway(docs)["spec"]["containers"][0])["nvidia.com/gpu"] == 1


def test_cpu_values_request_no_gpu(rendered):
    assert "nvidia.com/gpu" not in yaml.safe_dump_all(rendered("cpu"))


def test_raycluster_groups_match_the_serve_flags(rendered):
    docs = rendered("full")
    cluster = one(docs, "RayCluster")
    groups = {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    assert sorted(groups) == ["decode", "prefill"]
    args = config_lines(docs, "serve.args")
    for role, want in (("prefill", 3), ("decode", 2)):
        g = groups[role]
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == want
        assert arg_value(args, f"--{role}-workers") == str(want)
    assert groups["decode"]["rayStartParams"]["num-cpus"] == "4"        # user params merged
    head_svc = f"{cluster['metadata']['name']}-head-svc.{NAMESPACE}.svc.cluster.local:6379"
    assert "--disaggregate" in args and arg_value(args, "--ray-address") == head_svc
    assert f"--address={head_svc}" in config_lines(docs, "ray-start.args")
    assert cluster["spec"]["rayVersion"] == "2.60.0"


def test_disaggregated_gateway_is_recreated_not_rolled(rendered):
    """A surge pod would adopt the old pod's actors by name, and lose them when it goes."""
    assert one(rendered("cpu"), "Deployment", "-gateway")["spec"]["strategy"] == {"type": "Recreate"}
    assert "strategy" not in one(rendered("colocated"), "Deployment", "-gateway")["spec"]


def test_colocated_mode_has_no_ray(rendered):
    docs = rendered("colocated")
    assert not find(docs, "RayCluster")
    args = config_lines(docs, "serve.args")
    assert "--disaggregate" not in args and "--ray-address" not in args
    assert config_lines(docs, "ray-start.args") == []
    assert "nibble.io/ray-node" not in gateway(docs)["metadata"]["labels"]


def _secret_data(docs) -> dict[str, str]:
    secret = one(docs, "Secret", "-secrets")
    return {k: base64.b64decode(v).decode() for k, v in secret["data"].items()}


def test_secrets_are_referenced_never_inlined(rendered):
    docs = rendered("full")
    data = _secret_data(docs)
    assert data["api-keys"].splitlines() == FULL_VALUES["auth"]["apiKeys"]
    assert data["admin-api-keys"].splitlines() == FULL_VALUES["auth"]["adminApiKeys"]
    assert data["kv-secret"] == FULL_VALUES["auth"]["kvSecret"]
    assert data["hicache-storage-url"] == "redis://redis.example.internal:6379/3"
    assert data["redis-password"] == "hunter2-redis-pw"
    secret_name = one(docs, "Secret", "-secrets")["metadata"]["name"]
    values = [*data.values(), "hunter2-redis-pw", *FULL_VALUES["auth"]["apiKeys"]]
    for d in docs:
        if d["kind"] == "Secret":
            continue
        text = json.dumps(d)
        leaked = [v for v in values if v in text]
        assert not leaked, f"{d['kind']}/{d['metadata']['name']} inlines a secret"
    for name, template in pod_specs(docs):
        for c in template["spec"]["containers"]:
            env = {e["name"] for e in c.get("env", [])}
            assert "NIBBLE_KV_SECRET" not in env, name          # files only, never env
        if "redis" in name:
            continue
        vols = {v["name"]: v for v in template["spec"]["volumes"]}
        assert vols["secrets"]["secret"]["secretName"] == secret_name, name
        assert vols["secrets"]["secret"]["defaultMode"] == 0o400, name
        mounts = {m["name"]: m for m in template["spec"]["containers"][0]["volumeMounts"]}
        assert mounts["secrets"] == {"name": "secrets", "mountPath": "/etc/nibble/secrets",
                                     "readOnly": True}, name
        if name.startswith("RayCluster/"):                  # Ray pods: only what workers read
            items = {i["key"] for i in vols["secrets"]["secret"]["items"]}
            assert items == {"kv-secret", "redis-password"}, name


def test_existing_secret_is_used_and_not_rendered(rendered):
    docs = rendered("existing-secret")
    assert not find(docs, "Secret")
    assert not find(docs, "ServiceMonitor") and not find(docs, "PodDisruptionBudget")
    assert not find(docs, "ServiceAccount")
    gw = gateway(docs)
    assert {v["name"]: v for v in gw["spec"]["volumes"]}["secrets"]["secret"]["secretName"] == "my-nibble-keys"
    env = {e["name"] for e in gw["spec"]["containers"][0]["env"]}
    assert "NIBBLE_KV_SECRET" not in env


def test_generated_kv_secret_is_long_and_random(rendered):
    assert len(_secret_data(rendered("cpu"))["kv-secret"]) >= 32


def test_chart_redis_is_wired_as_the_l3_tier(rendered):
    docs = rendered("cpu")
    sts = one(docs, "StatefulSet", "-redis")
    svc = one(docs, "Service", "-redis")
    assert selects(svc["spec"]["selector"], sts["spec"]["template"]["metadata"]["labels"])
    args = config_lines(docs, "serve.args")
    assert "--enable-hierarchical-cache" in args
    assert arg_value(args, "--hicache-storage-backend") == "redis"
    url = f"redis://{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:6379/0"
    assert arg_value(args, "--hicache-storage-url") == url
    redis_args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert arg_value(redis_args, "--maxmemory-policy") == "allkeys-lru"


def test_chart_redis_requires_a_password_that_is_in_no_argv(rendered):
    docs = rendered("cpu")
    password = _secret_data(docs)["redis-password"]
    assert len(password) >= 32
    sts = one(docs, "StatefulSet", "-redis")
    pod = sts["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert password not in json.dumps(sts)
    script = c["command"][2]
    assert c["command"][:2] == ["sh", "-c"] and "requirepass" in script
    assert "/run/redis/redis.conf" in script and script.rstrip().endswith('"$@"')
    env = {e["name"]: e for e in c["env"]}
    assert env["REDISCLI_AUTH"]["valueFrom"]["secretKeyRef"]["key"] == "redis-password"
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["run"]["emptyDir"]["medium"] == "Memory"        # the config never hits a disk
    assert vols["auth"]["secret"]["items"] == [{"key": "redis-password",
                                                "path": "redis-password"}]


def test_network_policies_admit_only_the_release(rendered):
    docs = rendered("cpu")
    redis_np = one(docs, "NetworkPolicy", "-redis")
    sts = one(docs, "StatefulSet", "-redis")
    assert selects(redis_np["spec"]["podSelector"]["matchLabels"],
                   sts["spec"]["template"]["metadata"]["labels"])
    (rule,) = redis_np["spec"]["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}                        # no namespace or IP block
    pods = dict(pod_specs(docs))
    admitted = [n for n, t in pods.items() if _matches(peer["podSelector"], t)]
    assert sorted(admitted) == sorted(n for n in pods if "redis" not in n)
    ray_np = one(docs, "NetworkPolicy", "-ray")
    ray_pods = [n for n, t in pods.items() if _matches(ray_np["spec"]["podSelector"], t)]
    assert ray_pods and all(n.startswith("RayCluster/") for n in ray_pods)
    assert ray_np["spec"]["ingress"][1] == {"ports": [{"port": 8080, "protocol": "TCP"}]}
    assert not find(rendered("colocated"), "NetworkPolicy", "-ray")


def _matches(selector: dict, template: dict) -> bool:
    labels = template["metadata"]["labels"]
    if not selects(selector.get("matchLabels", {}), labels):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def test_external_redis_and_other_storage_choices(rendered):
    full = rendered("full")
    assert not find(full, "StatefulSet")
    assert arg_value(config_lines(full, "serve.args"), "--hicache-storage-url") is None   # from the Secret
    assert arg_value(config_lines(full, "serve.args"), "--hicache-storage-backend") == "redis"
    file_tier = config_lines(rendered("existing-secret"), "serve.args")
    assert arg_value(file_tier, "--hicache-storage-backend") == "file"
    assert not find(rendered("existing-secret"), "StatefulSet")
    off = config_lines(rendered("no-hicache"), "serve.args")
    assert "--enable-hierarchical-cache" not in off and not find(rendered("no-hicache"), "StatefulSet")


def test_gpu_redis_persists_to_a_volume_claim(rendered):
    sts = one(rendered("gpu-values"), "StatefulSet", "-redis")
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "64Gi"
    assert arg_value(sts["spec"]["template"]["spec"]["containers"][0]["args"], "--save") == "900 1"


def test_model_volume_is_mounted_read_only_everywhere(rendered):
    pods = list(pod_specs(rendered("full")))
    nibble_pods = [(n, t) for n, t in pods if "redis" not in n]
    assert len(nibble_pods) == 4                  # gateway, head, prefill, decode
    for name, template in nibble_pods:
        vols = {v["name"]: v for v in template["spec"]["volumes"]}
        assert vols["model"]["persistentVolumeClaim"]["claimName"] == "models", name
        mount = [m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model"]
        assert mount == [{"name": "model", "mountPath": "/models", "readOnly": True}], name


@pytest.mark.parametrize("variant", ALL)
def test_objects_carry_the_release_labels(rendered, variant):
    for d in rendered(variant):
        labels = d["metadata"]["labels"]
        assert labels["app.kubernetes.io/instance"] == "rel", d["metadata"]["name"]
        assert labels["app.kubernetes.io/part-of"] == "nibble"


def test_tls_secrets_are_mounted_and_named_by_the_flags(rendered):
    docs = rendered("tls")
    args = config_lines(docs, "serve.args")
    assert arg_value(args, "--ssl-certfile") == "/etc/nibble/tls/tls.crt"
    assert arg_value(args, "--ssl-keyfile") == "/etc/nibble/tls/tls.key"
    assert arg_value(args, "--ssl-ca-certs") == "/etc/nibble/tls/ca.crt"
    for flag, name in (("certfile", "tls.crt"), ("keyfile", "tls.key"), ("ca-certs", "ca.crt")):
        assert arg_value(args, f"--kv-transfer-ssl-{flag}") == f"/etc/nibble/transfer-tls/{name}"
    for name, template in pod_specs(docs):
        if "redis" in name:
            continue
        vols = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]}
        assert vols["transfer-tls"]["secret"]["secretName"] == "nibble-transfer-tls", name
        assert mounts["transfer-tls"] == "/etc/nibble/transfer-tls", name
    gw = gateway(docs)
    assert {v["name"]: v for v in gw["spec"]["volumes"]}["tls"]["secret"]["secretName"] == "nibble-tls"
    plain = config_lines(rendered("cpu"), "serve.args")
    assert arg_value(plain, "--ssl-certfile") is None and arg_value(plain, "--kv-transfer-ssl-ca-certs") is None


def test_https_probes_without_client_certificates():
    docs = render(sets=("gateway.tls.secretName=nibble-tls",))
    c = gateway(docs)["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http", "scheme": "HTTPS"}
    assert arg_value(config_lines(docs, "serve.args"), "--ssl-ca-certs") is None


def test_allow_unauthenticated_generates_no_key():
    docs = render(sets=("auth.allowUnauthenticated=true",))
    assert "api-keys" not in _secret_data(docs)
    assert "--allow-unauthenticated" in config_lines(docs, "serve.args")
