"""Rendering the Helm chart and validating manifests offline (no cluster, no network).

- ``helm_binary``: Helm from ``<repo>/.tools/bin`` (deploy/ci/install-tools.sh) or PATH.
- ``render``: ``helm template`` -> list of manifests (dicts), refusing duplicate YAML keys.
- ``crd_schemas``: the ``openAPIV3Schema`` of every served version of the CRDs in
  ``<repo>/../shared/crds``, made strict (unknown fields rejected, as the API server's strict
  field validation does), keyed by (apiVersion, kind).
- ``pod_specs``: every pod spec of a rendered release, RayCluster templates included.
"""

from __future__ import annotations

import copy
import os
import pathlib
import shutil
import subprocess
from collections.abc import Iterator

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "nibble"
SHARED_CRDS = ROOT.parent / "shared" / "crds"
NAMESPACE = "nibble"
RELEASE = "rel"
# kubernetes-validate bundles schemas per Kubernetes minor; pinned: the chart's floor
# (Chart.yaml kubeVersion >=1.27) and the version the chart targets.
KUBERNETES_VERSIONS = ("1.27.0", "1.33.0")
HELM_KUBE_VERSION = "1.33.0"


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that fails on a repeated mapping key (kubectl apply rejects those)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def helm_binary() -> str:
    local = ROOT / ".tools" / "bin" / "helm"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which("helm")
    if found:
        return found
    pytest.fail("helm not found in .tools/bin or on PATH: run `bash deploy/ci/install-tools.sh` "
                "(the README's test command does)", pytrace=False)


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}",
                    pytrace=False)
    return proc


def template_args(values_files=(), sets=()) -> list[str]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE,
            "--kube-version", HELM_KUBE_VERSION]
    for f in values_files:
        args += ["-f", str(f)]
    for s in sets:
        args += ["--set", s]
    return args


def parse_manifests(text: str) -> list[dict]:
    return [d for d in yaml.load_all(text, Loader=UniqueKeyLoader) if d]


def render(values_files=(), sets=()) -> list[dict]:
    return parse_manifests(run_helm(*template_args(values_files, sets)).stdout)


def find(docs: list[dict], kind: str, name_suffix: str = "") -> list[dict]:
    return [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    got = find(docs, kind, name_suffix)
    assert len(got) == 1, f"expected one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in got]}"
    return got[0]


def _strict(schema):
    """Reject unknown fields wherever an object schema lists its properties."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" and "properties" in schema
                and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        for value in schema.values():
            _strict(value)
    elif isinstance(schema, list):
        for value in schema:
            _strict(value)
    return schema


def crd_schemas() -> dict[tuple[str, str], dict]:
    if not SHARED_CRDS.is_dir():
        pytest.fail(f"CRD schemas not found at {SHARED_CRDS} (<repo root>/../shared/crds, which "
                    "CI lays beside the clone); they are needed to validate RayCluster and "
                    "ServiceMonitor offline", pytrace=False)
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = {}
    for path in sorted(SHARED_CRDS.glob("*.yaml")):
        crd = yaml.load(path.read_text(), Loader=loader)
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            if version.get("served", True):
                schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
                out[(f"{group}/{version['name']}", kind)] = _strict(schema)
    return out


def pod_specs(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    """(label, pod template) of every workload: Deployments, StatefulSets, RayCluster groups."""
    for d in docs:
        name = f"{d['kind']}/{d['metadata']['name']}"
        if d["kind"] in ("Deployment", "StatefulSet"):
            yield name, d["spec"]["template"]
        elif d["kind"] == "RayCluster":
            yield f"{name}/head", d["spec"]["headGroupSpec"]["template"]
            for group in d["spec"].get("workerGroupSpecs", []):
                yield f"{name}/{group['groupName']}", group["template"]


def config_lines(docs: list[dict], key: str) -> list[str]:
    """Lines of one ConfigMap file (serve.args / ray-start.args), [] when absent."""
    data = one(docs, "ConfigMap", "-config")["data"]
    return [line for line in data.get(key, "").splitlines() if line.strip()]


def arg_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None
