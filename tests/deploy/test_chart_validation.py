"""`helm lint` / `helm template` of the chart, then offline schema validation of every manifest.

Built-in kinds are checked with kubernetes-validate (bundled Kubernetes JSON schemas, strict:
unknown fields fail) at the pinned versions; RayCluster and ServiceMonitor against the
openAPIV3Schema of their CRDs in ../shared/crds (made strict the same way). RayCluster pod
templates are also checked as core PodTemplates, and against KubeRay's own admission rules.
"""

from __future__ import annotations

import copy
import json
import re
import shlex

import jsonschema
import kubernetes_validate
import pytest

from .conftest import VARIANTS
from .helpers import CHART, KUBERNETES_VERSIONS, find, one, run_helm

CRD_KINDS = {"RayCluster", "ServiceMonitor"}
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def k8s_errors(doc: dict, version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{'.'.join(map(str, e.path))}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


def crd_errors(doc: dict, crds: dict) -> list[str]:
    schema = crds.get((doc["apiVersion"], doc["kind"]))
    if schema is None:
        return [f"no CRD schema for {doc['apiVersion']} {doc['kind']} in shared/crds"]
    validator = jsonschema.Draft7Validator(schema)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("values", [(), (CHART / "values-gpu.yaml",)], ids=["cpu-values", "gpu-values"])
def test_helm_lint_strict(values):
    args = ["lint", "--strict", str(CHART)]
    for f in values:
        args += ["-f", str(f)]
    out = run_helm(*args).stdout
    assert "0 chart(s) failed" in out, out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_builtin_kinds_validate_against_kubernetes_schemas(rendered, variant):
    docs = [d for d in rendered(variant) if d["kind"] not in CRD_KINDS]
    assert docs
    errors = [f"{d['kind']}/{d['metadata']['name']} @{v}: {err}"
              for v in KUBERNETES_VERSIONS for d in docs for err in k8s_errors(d, v)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_custom_resources_validate_against_crds(rendered, crds, variant):
    docs = [d for d in rendered(variant) if d["kind"] in CRD_KINDS]
    errors = [f"{d['kind']}/{d['metadata']['name']}: {err}"
              for d in docs for err in crd_errors(d, crds)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("variant", ["cpu", "gpu-values", "full"])
def test_ray_pod_templates_are_valid_core_pod_templates(rendered, variant):
    cluster = one(rendered(variant), "RayCluster")
    groups = [cluster["spec"]["headGroupSpec"], *cluster["spec"]["workerGroupSpecs"]]
    errors = []
    for group in groups:
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                   "template": group["template"]}
        errors += [f"{group.get('groupName', 'head')}: {e}"
                   for v in KUBERNETES_VERSIONS for e in k8s_errors(wrapped, v)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("variant", ["cpu", "gpu-values", "full"])
def test_raycluster_passes_kuberay_admission_rules(rendered, variant):
    """The checks of KubeRay's ValidateRayClusterSpec/Metadata that a schema cannot express."""
    cluster = one(rendered(variant), "RayCluster")
    name = cluster["metadata"]["name"]
    assert len(name) <= 53 and DNS1035.match(name), name
    groups = [("head", cluster["spec"]["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in cluster["spec"]["workerGroupSpecs"]]
    for label, group in groups:
        params = group.get("rayStartParams", {})
        assert group["template"]["spec"]["containers"], label
        assert "labels" not in params, f"{label}: KubeRay refuses rayStartParams['labels']"
        in_params = any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources"))
        assert not (in_params and group.get("resources")), \
            f"{label}: resources in both rayStartParams and the group's resources field"


def _ray_start_argv(params: dict[str, str]) -> list[str]:
    """rayStartParams as KubeRay writes them into `ray start ...` and the shell splits them."""
    return shlex.split(" ".join(f"--{k}={v}" for k, v in sorted(params.items())))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pydantic, via ray.serve
@pytest.mark.parametrize("variant", ["cpu", "full"])
def test_ray_start_params_parse_with_ray_start(rendered, variant):
    from ray.scripts.scripts import start

    cluster = one(rendered(variant), "RayCluster")
    head = _ray_start_argv(cluster["spec"]["headGroupSpec"]["rayStartParams"])
    ctx = start.make_context("start", ["--head", *head])
    assert ctx.params["num_cpus"] == 0                    # no actor on the head
    for group in cluster["spec"]["workerGroupSpecs"]:
        argv = _ray_start_argv(group["rayStartParams"])
        ctx = start.make_context("start", ["--address=head:6379", *argv])
        resources = json.loads(ctx.params["resources"])
        assert resources == {f"nibble_{group['groupName']}": 1}


def test_validators_reject_broken_manifests(rendered, crds):
    """The validators above can fail: a typo, a wrong type, a missing required field."""
    docs = rendered("cpu")
    deployment = copy.deepcopy(one(docs, "Deployment", "-gateway"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert k8s_errors(deployment, KUBERNETES_VERSIONS[-1])
    service = copy.deepcopy(one(docs, "Service", "-grpc"))
    service["spec"]["ports"][0]["port"] = "thirty"
    assert k8s_errors(service, KUBERNETES_VERSIONS[-1])
    cluster = copy.deepcopy(one(docs, "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 1
    assert crd_errors(cluster, crds)
    cluster = copy.deepcopy(one(docs, "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 4
    assert crd_errors(cluster, crds)
    monitor = copy.deepcopy(find(docs, "ServiceMonitor")[0])
    del monitor["spec"]["selector"]
    assert crd_errors(monitor, crds)


@pytest.mark.parametrize("bad,where", [
    ("serve.flags.kv-cache-dtype=NVFP4!", "kv-cache-dtype"),
    ("serve.flags.schedule-policy=random", "schedule-policy"),
    ("serve.flags.host=10.1.2.3", "host"),                  # the chart owns --host
    ("serve.flags.page-size=12", "page-size"),
    ("podSecurityContext.runAsNonRoot=false", "runAsNonRoot"),
    ("hierarchicalCache.storage=s3", "storage"),
    ("ray.prefill.replicas=0", "replicas"),
    ("gateway.grpc.port=70000", "port"),
    ("unknownTopLevel=1", "unknownTopLevel"),
])
def test_values_schema_rejects_bad_values(bad, where):
    proc = run_helm("template", "r", str(CHART), "--set", bad, check=False)
    assert proc.returncode != 0, f"helm accepted --set {bad}"
    assert where in proc.stderr, proc.stderr


def test_install_notes_render_without_a_cluster():
    """`helm install --dry-run=client` renders NOTES.txt (which `helm template` skips)."""
    out = run_helm("install", "nibble", str(CHART), "--namespace", "nibble", "--dry-run=client").stdout
    notes = out.split("NOTES:", 1)[1]
    assert "port-forward svc/nibble 30000:30000" in notes
    assert "port-forward svc/nibble-grpc 30001:30001" in notes
    assert "the chart generated one key" in notes and "answer only\nloopback clients" in notes
    keyed = run_helm("install", "nibble", str(CHART), "--dry-run=client",
                     "--set", "auth.apiKeys[0]=test-api-key-0001").stdout
    assert "generated" not in keyed.split("NOTES:", 1)[1]
    open_ = run_helm("install", "nibble", str(CHART), "--dry-run=client",
                     "--set", "auth.allowUnauthenticated=true").stdout
    assert "WARNING: auth.allowUnauthenticated" in open_.split("NOTES:", 1)[1]
