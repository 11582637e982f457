"""deploy/kubernetes, deploy/prometheus and deploy/grafana, checked without a cluster.

- Every overlay (and every overlay with every component) renders with `kubectl kustomize`, and every object
  validates offline: built-in kinds against the Kubernetes OpenAPI schemas that `kubernetes-validate` ships
  (strict: an unknown field is an error, as `kubectl apply` makes it), KEDA's against the structure KEDA's CRDs
  define (and against the CRDs themselves when KEDA_CRDS_DIR points at keda.sh_*.yaml files).
- What the manifests say about rsb is what rsb does: commands, flags and RSB_* variables exist (read from
  `rsb <command> --help`), probe paths and ports are the ones a consumer and a generator started with the
  manifests' own environment answer, the grace periods satisfy docs/deployment.md, the KEDA triggers watch
  exactly the job streams broker.streams.keys names for the overlay's partitions.
- Every metric the manifests, the alert rules and the dashboard name is served by a live consumer or
  generator; the rules and the dashboard's queries pass `promtool`.
"""

from __future__ import annotations

import base64
import copy
import functools
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers import CliCommand, cli_command, eventually, parse_bytes, read_sse, wait_status

from broker.redis.server import RedisServer, free_port
from broker.streams.keys import QueueKeys

ROOT = Path(__file__).resolve().parents[2]

K8S = ROOT / "deploy" / "kubernetes"
ALERTS = ROOT / "deploy" / "prometheus" / "rsb-alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "rsb-dashboard.json"
ADAPTER_RULES = K8S / "components" / "hpa-readers" / "prometheus-adapter-rules.yaml"
DEPLOYMENT_DOC = ROOT / "docs" / "deployment.md"

OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").exists())
VARIANTS = OVERLAYS + [f"{o}+{c}" for o in OVERLAYS for c in COMPONENTS]

# The oldest Kubernetes the manifests claim (docs/deployment.md), and the newest kubernetes-validate knows.
MIN_KUBERNETES = "1.27"
# A grace period must exceed the drain time rsb bounds by at least this much (process exit, last writes).
MARGIN_S = 2.0
RSB_COMMANDS = {"consumer", "generator"}

KUBECTL = shutil.which("kubectl")
PROMTOOL = shutil.which("promtool")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed: it renders the overlays "
                                   "(`kubectl kustomize`, offline)")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package "
                                    "`prometheus`; scripts/test.sh installs it)")


# -- rendering -------------------------------------------------------------------------------------------


@dataclass
class Rendered:
    variant: str
    objects: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.variant}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def has(self, kind: str, name: str) -> bool:
        return any(o["metadata"]["name"] == name for o in self.all(kind))

    def workload(self, component: str) -> dict[str, Any]:
        """The Deployment whose pods carry app.kubernetes.io/component=<component>."""
        found = [o for o in self.all("Deployment")
                 if o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"{self.variant}: expected one {component} Deployment"
        return found[0]

    def secret_value(self, name: str, key: str) -> str:
        data = self.get("Secret", name).get("data") or {}
        assert key in data, f"{self.variant}: Secret {name} has no key {key}"
        return base64.b64decode(data[key]).decode()

    def configmap_value(self, name: str, key: str) -> str:
        data = self.get("ConfigMap", name).get("data") or {}
        assert key in data, f"{self.variant}: ConfigMap {name} has no key {key}"
        return str(data[key])


@functools.cache
def render(variant: str) -> Rendered:
    """`kubectl kustomize` of an overlay, or of an overlay plus a component (``overlay+component``)."""
    assert KUBECTL is not None
    overlay, _, component = variant.partition("+")
    path = K8S / "overlays" / overlay
    with tempfile.TemporaryDirectory() as tmp:
        if component:
            # A kustomization using both, as an operator's own overlay would (kustomize wants relative paths).
            (Path(tmp) / "kustomization.yaml").write_text(yaml.safe_dump({
                "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": [os.path.relpath(path, tmp)],
                "components": [os.path.relpath(K8S / "components" / component, tmp)]}))
            path = Path(tmp)
        proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {variant}:\n{proc.stderr}"
    return Rendered(variant, [o for o in yaml.safe_load_all(proc.stdout) if o])


def is_rsb_image(image: str) -> bool:
    return image.rsplit("/", 1)[-1].split(":")[0].split("@")[0] == "rsb"


def rsb_containers(r: Rendered) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container running the image this repository builds."""
    for kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob"):
        for obj in r.all(kind):
            spec = obj["spec"]["jobTemplate"]["spec"] if kind == "CronJob" else obj["spec"]
            for c in spec["template"]["spec"].get("containers", []):
                if is_rsb_image(c["image"]):
                    yield obj, c


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = [c for c in pod_spec(workload)["containers"] if is_rsb_image(c["image"])]
    assert len(containers) == 1
    return containers[0]


def resolved_env(r: Rendered, c: dict[str, Any]) -> dict[str, str]:
    """The environment the container gets, with ConfigMap and Secret references resolved from the render
    (a reference to an object or key that is not rendered fails here, as it would fail the pod)."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            data = r.get("ConfigMap", source["configMapRef"]["name"]).get("data") or {}
            env.update({prefix + k: str(v) for k, v in data.items()})
        elif "secretRef" in source:
            data = r.get("Secret", source["secretRef"]["name"]).get("data") or {}
            env.update({prefix + k: base64.b64decode(v).decode() for k, v in data.items()})
    for item in c.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "configMapKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = r.configmap_value(ref["name"], ref["key"])
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = r.secret_value(ref["name"], ref["key"])
        else:
            env[item["name"]] = f"<{next(iter(item['valueFrom']))}>"  # fieldRef and the like: set at run time
    return env


def setting(r: Rendered, c: dict[str, Any], cli: CliCommand, name: str) -> str:
    """What the container's rsb gets for setting ``name``: its args' flag, else its environment, else the
    default `rsb <command> --help` shows."""
    return cli.effective(resolved_env(r, c), command_of(c)[1:], name)


def command_of(c: dict[str, Any]) -> list[str]:
    assert "command" not in c, "override `args`, not `command`: the image's ENTRYPOINT is rsb"
    args = [str(a) for a in c.get("args", [])]
    assert args and args[0] in RSB_COMMANDS, f"container {c['name']}: args {args} start with no rsb command"
    return args


def named_port(c: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    found = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert len(found) == 1, f"container {c['name']} has no port named {port}"
    return int(found[0])


def probes(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c}


def quantity(value: str | int | float) -> float:
    """A Kubernetes CPU quantity in cores (``250m``, ``4``)."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


# -- KEDA: its objects' structure ---------------------------------------------------------------------------
# The fields of KEDA's v1alpha1 ScaledObject and TriggerAuthentication that a manifest may set, written from
# KEDA's published CRDs (kedacore/keda, config/crd/bases). Unknown fields are errors, as the API server's
# strict field validation makes them.

_OBJ: dict[str, Any] = {"type": "object"}
_STR: dict[str, Any] = {"type": "string"}
_INT: dict[str, Any] = {"type": "integer"}


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_METADATA = _closed({"name": _STR, "namespace": _STR, "labels": _OBJ, "annotations": _OBJ}, ("name",))
KEDA_SCHEMAS: dict[str, dict[str, Any]] = {
    "ScaledObject": _closed({
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"}, "metadata": _METADATA,
        "spec": _closed({
            "scaleTargetRef": _closed({"apiVersion": _STR, "kind": _STR, "name": {"type": "string", "minLength": 1},
                                       "envSourceContainerName": _STR}, ("name",)),
            "pollingInterval": _INT, "cooldownPeriod": _INT, "initialCooldownPeriod": _INT,
            "idleReplicaCount": _INT, "minReplicaCount": _INT, "maxReplicaCount": _INT,
            "advanced": _closed({
                "restoreToOriginalReplicaCount": {"type": "boolean"},
                "horizontalPodAutoscalerConfig": _closed({"name": _STR, "behavior": _OBJ}),
                "scalingModifiers": _closed({"formula": _STR, "target": _STR, "activationTarget": _STR,
                                             "metricType": {"enum": ["AverageValue", "Value"]}}),
            }),
            "fallback": _closed({"failureThreshold": _INT, "replicas": _INT,
                                 "behavior": {"enum": ["static", "currentReplicas", "currentReplicasIfHigher",
                                                       "currentReplicasIfLower", "scalingModifiers"]}},
                                ("failureThreshold", "replicas")),
            "triggers": {"type": "array", "minItems": 1, "items": _closed({
                "type": {"type": "string", "minLength": 1}, "name": _STR, "useCachedMetrics": {"type": "boolean"},
                "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                "metadata": {"type": "object", "additionalProperties": _STR},
                "authenticationRef": _closed({"name": _STR, "kind": {"enum": ["TriggerAuthentication",
                                                                            "ClusterTriggerAuthentication"]}},
                                             ("name",)),
            }, ("type", "metadata"))},
        }, ("scaleTargetRef", "triggers")),
    }, ("apiVersion", "kind", "metadata", "spec")),
    "TriggerAuthentication": _closed({
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "TriggerAuthentication"},
        "metadata": _METADATA,
        "spec": _closed({
            "secretTargetRef": {"type": "array", "items": _closed({"parameter": _STR, "name": _STR, "key": _STR},
                                                                  ("parameter", "name", "key"))},
            "configMapTargetRef": {"type": "array", "items": _closed({"parameter": _STR, "name": _STR, "key": _STR},
                                                                     ("parameter", "name", "key"))},
            "env": {"type": "array", "items": _closed({"parameter": _STR, "name": _STR, "containerName": _STR},
                                                      ("parameter", "name"))},
            "podIdentity": _OBJ, "hashiCorpVault": _OBJ, "azureKeyVault": _OBJ, "awsSecretManager": _OBJ,
            "gcpSecretManager": _OBJ, "boundServiceAccountToken": {"type": "array"},
        }),
    }, ("apiVersion", "kind", "metadata", "spec")),
}
# What KEDA's redis-streams / redis-cluster-streams scalers read from a trigger's metadata
# (pkg/scalers/redis_streams_scaler.go, redis_scaler.go).
REDIS_STREAMS_METADATA = {
    "address", "addresses", "host", "hosts", "port", "ports", "username", "password", "usernameFromEnv",
    "passwordFromEnv", "addressFromEnv", "addressesFromEnv", "hostFromEnv", "hostsFromEnv", "portFromEnv",
    "portsFromEnv", "stream", "consumerGroup", "pendingEntriesCount", "streamLength", "lagCount",
    "activationLagCount", "databaseIndex", "enableTLS", "unsafeSsl",
}


def crd_schema(kind: str) -> dict[str, Any] | None:
    """The openAPIV3Schema of KEDA's own CRD for ``kind``, when KEDA_CRDS_DIR has it (not vendored here),
    closed like the API server's strict field validation: unknown fields are errors."""
    folder = os.environ.get("KEDA_CRDS_DIR")
    if not folder:
        return None
    for path in sorted(Path(folder).glob("keda.sh_*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            schema: dict[str, Any] = copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
            _close(schema)
            schema["properties"]["metadata"] = _METADATA
            return schema
    return None


def _close(node: Any) -> None:
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for value in node.values():
            _close(value)
    elif isinstance(node, list):
        for value in node:
            _close(value)


def validate_object(obj: dict[str, Any]) -> list[str]:
    """Schema errors of one rendered object (empty: valid)."""
    where = f"{obj['kind']} {obj['metadata']['name']}"
    if obj["apiVersion"].startswith("keda.sh/"):
        schemas = [KEDA_SCHEMAS[obj["kind"]]] + [s for s in [crd_schema(obj["kind"])] if s]
        return [f"{where}: {e.message} at {list(e.absolute_path)}"
                for schema in schemas for e in jsonschema.Draft202012Validator(schema).iter_errors(obj)]
    errors = []
    for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where} (Kubernetes {version}): {e.message} at {list(e.absolute_path)}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where}: {e.message}")
    return errors


# -- PromQL ------------------------------------------------------------------------------------------------

PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
                   "offset", "bool", "inf", "nan", "atan2", "topk", "bottomk", "quantile", "count_values"}
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def grafana_to_promql(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions (followed by ``(``),
    keywords, label names (inside ``{...}`` and ``by (...)``), durations or numbers."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)", text):
        follows = text[m.end():].lstrip()
        if follows.startswith("(") or m.group(1).lower() in PROMQL_KEYWORDS:
            continue
        names.add(m.group(1))
    return names


def alert_rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(ALERTS.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of the dashboard, Grafana's variables filled in."""
    out = []
    stack = list(json.loads(DASHBOARD.read_text())["panels"])
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        for target in panel.get("targets", []):
            out.append((panel["title"], grafana_to_promql(target["expr"])))
    return out


def named_metrics() -> dict[str, set[str]]:
    """Every metric name a deployment file names, by file."""
    named: dict[str, set[str]] = {}

    def add(where: str, names: set[str]) -> None:
        named.setdefault(where, set()).update(names)

    for rule in alert_rules():
        add(str(ALERTS.relative_to(ROOT)), promql_metric_names(rule["expr"]))
    for _, expr in dashboard_queries():
        add(str(DASHBOARD.relative_to(ROOT)), promql_metric_names(expr))
    for rule in yaml.safe_load(ADAPTER_RULES.read_text())["rules"]:
        query = rule["metricsQuery"].replace("<<.LabelMatchers>>", "").replace("<<.GroupBy>>", "pod")
        add(str(ADAPTER_RULES.relative_to(ROOT)), promql_metric_names(rule["seriesQuery"]) |
            promql_metric_names(query) | {rule["name"]["as"]})
    if KUBECTL is not None:
        for variant in VARIANTS:
            for hpa in render(variant).all("HorizontalPodAutoscaler"):
                for metric in hpa["spec"].get("metrics", []):
                    if metric["type"] in ("Pods", "Object", "External"):
                        add(f"{variant} HorizontalPodAutoscaler", {metric[metric["type"].lower()]["metric"]["name"]})
    return named


def exposition_names(text: str) -> set[str]:
    """Metric names in a Prometheus text exposition: sampled series, and every # TYPE (a counter with no
    sample yet, such as a label set never seen, still names its metric); a histogram brings its series."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


# -- static checks ---------------------------------------------------------------------------------------


def test_promql_metric_names() -> None:
    assert promql_metric_names('sum by (le) (rate(rsb_a_bucket{x="y"}[5m])) / sum(rate(rsb_b[1h] offset 5m))') \
        == {"rsb_a_bucket", "rsb_b"}
    assert promql_metric_names("max(rsb_q) > 0 unless on() (count(rsb_r) > 0)") == {"rsb_q", "rsb_r"}
    assert promql_metric_names("clamp_min(sum(rsb_c), 1e-3) and absent(rsb_d{reason=\"a b\"})") == {"rsb_c", "rsb_d"}
    assert promql_metric_names("histogram_quantile(0.95, sum without (instance) (rate(x:y[5m])))") == {"x:y"}


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_redis_refuses_writes_before_its_pod_is_killed(variant: str) -> None:
    """A Redis the manifests run has a maxmemory below its container's memory limit, and noeviction: full, it
    refuses writes (rsb answers 507 storage_full) instead of being OOM-killed or evicting unfinished streams."""
    servers = 0
    for sts in render(variant).all("StatefulSet"):
        for c in sts["spec"]["template"]["spec"]["containers"]:
            # The words of its command line, a `sh -c` script's included (it checks the password first).
            args = [w for a in (c.get("command") or []) + (c.get("args") or []) for w in shlex.split(str(a))]
            if "redis-server" not in args:
                continue
            assert args[args.index("--maxmemory-policy") + 1] == "noeviction", variant
            limit = parse_bytes(c["resources"]["limits"]["memory"])
            assert 0 < parse_bytes(args[args.index("--maxmemory") + 1]) <= limit * 3 // 4, variant
            servers += 1
    assert servers == (0 if variant.startswith("redis-cluster") else 1), variant  # the cluster is the operator's


@needs_kubectl
def test_the_validator_rejects_a_typo() -> None:
    """The schemas are strict: a misspelt field fails (else this test file would prove little)."""
    deployment = copy.deepcopy(render(OVERLAYS[0]).workload("consumer"))
    container(deployment)["readinessProbes"] = container(deployment).pop("readinessProbe")
    assert validate_object(deployment)
    scaled = copy.deepcopy(render(OVERLAYS[0]).all("ScaledObject")[0])
    scaled["spec"]["minReplicas"] = 1
    assert validate_object(scaled)


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_object_validates(variant: str) -> None:
    r = render(variant)
    errors = [e for obj in r.objects for e in validate_object(obj)]
    assert not errors, "\n".join(errors)
    kinds = {o["kind"] for o in r.objects}
    assert {"Deployment", "Service", "Ingress", "PodDisruptionBudget", "HorizontalPodAutoscaler", "ScaledObject",
            "Secret", "ConfigMap"} <= kinds
    for so in r.all("ScaledObject"):  # the CRD's CEL rule
        assert so["spec"].get("minReplicaCount", 0) <= so["spec"].get("maxReplicaCount", 100)


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_references_resolve(variant: str) -> None:
    """Every object a manifest names is rendered (kustomize's hash-suffixed names included)."""
    r = render(variant)
    for workload, c in rsb_containers(r):
        resolved_env(r, c)  # ConfigMap and Secret keys
        for volume in pod_spec(workload).get("volumes", []):
            if "secret" in volume:
                assert r.has("Secret", volume["secret"]["secretName"]), volume
            if "configMap" in volume:
                assert r.has("ConfigMap", volume["configMap"]["name"]), volume
    for hpa in r.all("HorizontalPodAutoscaler"):
        assert r.has(hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
    for so in r.all("ScaledObject"):
        assert r.has(so["spec"]["scaleTargetRef"].get("kind", "Deployment"), so["spec"]["scaleTargetRef"]["name"])
        for trigger in so["spec"]["triggers"]:
            if "authenticationRef" in trigger:
                auth = r.get(trigger["authenticationRef"].get("kind", "TriggerAuthentication"),
                             trigger["authenticationRef"]["name"])
                for ref in auth["spec"].get("secretTargetRef", []):
                    r.secret_value(ref["name"], ref["key"])
    for ingress in r.all("Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                service = r.get("Service", backend["name"])
                assert backend["port"].get("name") in {p.get("name") for p in service["spec"]["ports"]} or \
                    backend["port"].get("number") in {p["port"] for p in service["spec"]["ports"]}
    for pdb in r.all("PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        matched = [w for w in r.all("Deployment") + r.all("StatefulSet")
                   if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matched) == 1, f"PodDisruptionBudget {pdb['metadata']['name']} selects {len(matched)} workloads"


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_commands_flags_and_env_are_real(variant: str) -> None:
    r = render(variant)
    commands = set()
    for workload, c in rsb_containers(r):
        cmd = command_of(c)
        commands.add(cmd[0])
        cli = cli_command(cmd[0])
        unknown_flags = {a.split("=", 1)[0] for a in cmd[1:] if a.startswith("--")} - cli.flags
        assert not unknown_flags, f"{workload['metadata']['name']}: `rsb {cmd[0]}` has no {sorted(unknown_flags)}"
        env = {k for k in resolved_env(r, c) if k.startswith("RSB_")}
        assert not env - set(cli.settings), \
            f"{workload['metadata']['name']}: `rsb {cmd[0]}` reads no {sorted(env - set(cli.settings))}"
        assert "RSB_REDIS_URL" in env, "rsb consumer and rsb generator need a Redis URL"
    assert commands == RSB_COMMANDS


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_ports_and_scrape_annotations(variant: str) -> None:
    r = render(variant)
    consumer = r.workload("consumer")
    c = container(consumer)
    cli = cli_command("consumer")
    port = int(setting(r, c, cli, "RSB_PORT"))
    assert setting(r, c, cli, "RSB_HOST") == "0.0.0.0", "a consumer listening on loopback is unreachable in a pod"
    p = probes(c)
    assert p["readinessProbe"]["httpGet"]["path"] == "/readyz"  # Redis reachable
    assert p["livenessProbe"]["httpGet"]["path"] == "/healthz"  # process up, no Redis call
    for probe in p.values():
        assert named_port(c, probe["httpGet"]["port"]) == port
    annotations = consumer["spec"]["template"]["metadata"]["annotations"]
    # With API keys the API port's /metrics needs a key: Prometheus scrapes the consumer's own metrics port.
    consumer_metrics = int(setting(r, c, cli, "RSB_SCRAPE_PORT"))
    assert consumer_metrics and consumer_metrics != port and setting(r, c, cli, "RSB_SCRAPE_HOST") == "0.0.0.0"
    assert named_port(c, "metrics") == consumer_metrics
    assert (annotations["prometheus.io/scrape"], int(annotations["prometheus.io/port"]),
            annotations["prometheus.io/path"]) == ("true", consumer_metrics, "/metrics")
    service = r.get("Service", "rsb-consumer")
    assert service["spec"]["selector"].items() <= consumer["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"].get("sessionAffinity", "None") == "None", "any pod serves any stream: no affinity"
    for sp in service["spec"]["ports"]:
        assert named_port(c, sp["targetPort"]) == port
    generator = r.workload("generator")
    assert not service["spec"]["selector"].items() <= generator["spec"]["template"]["metadata"]["labels"].items()

    g = container(generator)
    gcli = cli_command("generator")
    metrics_port = int(setting(r, g, gcli, "RSB_METRICS_PORT"))
    assert metrics_port, "generators need --metrics-port: their probes and Prometheus use it"
    assert setting(r, g, gcli, "RSB_METRICS_HOST") == "0.0.0.0"
    gp = probes(g)
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(gp)
    for probe in gp.values():
        assert probe["httpGet"]["path"] == "/metrics"
        assert named_port(g, probe["httpGet"]["port"]) == metrics_port
    gannotations = generator["spec"]["template"]["metadata"]["annotations"]
    assert (gannotations["prometheus.io/scrape"], int(gannotations["prometheus.io/port"]),
            gannotations["prometheus.io/path"]) == ("true", metrics_port, "/metrics")


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_grace_periods_cover_the_drain(variant: str) -> None:
    """docs/deployment.md: the consumer's grace period starts with the preStop sleep, then SIGTERM drains within
    --shutdown-grace-s; a generator finishes or hands back its job within --generator-grace-s."""
    r = render(variant)
    consumer = r.workload("consumer")
    c = container(consumer)
    pre_stop = c["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        sleep_s = float(pre_stop["sleep"]["seconds"])
    else:
        argv = pre_stop["exec"]["command"]
        assert argv[0] == "sleep" and len(argv) == 2, f"preStop should be a plain sleep: {argv}"
        sleep_s = float(argv[1])
    assert sleep_s >= 2, "the preStop sleep lets the endpoints and ingress controllers drop the pod first"
    drain_s = float(setting(r, c, cli_command("consumer"), "RSB_SHUTDOWN_GRACE_S"))
    grace = pod_spec(consumer)["terminationGracePeriodSeconds"]
    assert grace >= sleep_s + drain_s + MARGIN_S, (grace, sleep_s, drain_s)

    generator = r.workload("generator")
    handover_s = float(setting(r, container(generator), cli_command("generator"), "RSB_GENERATOR_GRACE_S"))
    assert pod_spec(generator)["terminationGracePeriodSeconds"] >= handover_s + MARGIN_S


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_keda_watches_every_job_stream(variant: str) -> None:
    """One trigger per partition on exactly the job streams broker.streams.keys names, summed by the formula, with the
    target a worker's concurrency; the scaler type and address follow the Redis URL."""
    r = render(variant)
    generator = r.workload("generator")
    g, c = container(generator), container(r.workload("consumer"))
    gcli = cli_command("generator")
    partitions = int(setting(r, g, gcli, "RSB_PARTITIONS"))
    assert int(setting(r, c, cli_command("consumer"), "RSB_PARTITIONS")) == partitions, "consumers and generators agree"
    redis_url = setting(r, g, gcli, "RSB_REDIS_URL")
    assert setting(r, c, cli_command("consumer"), "RSB_REDIS_URL") == redis_url

    [so] = [s for s in r.all("ScaledObject") if s["spec"]["scaleTargetRef"]["name"] == generator["metadata"]["name"]]
    triggers = so["spec"]["triggers"]
    model = setting(r, g, gcli, "RSB_MODEL_NAME")
    assert setting(r, c, cli_command("consumer"), "RSB_DEFAULT_MODEL") == model, "creates naming no model run on it"
    if so["spec"].get("minReplicaCount", 0) == 0:
        # Scaled to zero, no generator announces the model: the consumers know it only as declared (--models), and
        # a create for it queues (the backlog that activates the trigger) instead of a 404 model_not_found.
        assert model in setting(r, c, cli_command("consumer"), "RSB_MODELS").split(","), "a scaled-to-zero model is declared"
    assert sorted(t["metadata"]["stream"] for t in triggers) == sorted(
        QueueKeys(i, partitions, model).backlog for i in range(partitions))

    url = urlsplit(redis_url)
    cluster = url.scheme.endswith("+cluster") or \
        resolved_env(r, g).get("RSB_REDIS_CLUSTER", "").lower() in ("1", "true", "yes", "on") or \
        "--redis-cluster" in command_of(g)
    namespace = generator["metadata"]["namespace"]
    assert url.hostname and "." not in url.hostname, "a Service of this namespace (else adjust this check)"
    expected_address = f"{url.hostname}.{namespace}.svc.cluster.local:{url.port or 6379}"
    for t in triggers:
        meta = t["metadata"]
        assert set(meta) <= REDIS_STREAMS_METADATA, f"KEDA's redis scalers read no {set(meta) - REDIS_STREAMS_METADATA}"
        assert t["type"] == ("redis-cluster-streams" if cluster else "redis-streams")
        assert meta.get("addresses" if cluster else "address") == expected_address
        # The stream's length = queued + running jobs, because rsb deletes a job when it ends (keda.yaml says
        # why not the group's lag or pending count): no consumerGroup, or KEDA would read those instead.
        assert "consumerGroup" not in meta and "lagCount" not in meta and "pendingEntriesCount" not in meta
        assert int(meta["streamLength"]) >= 1
        assert (meta.get("enableTLS") == "true") == url.scheme.startswith("rediss"), "TLS like rsb's URL"

    modifiers = so["spec"]["advanced"]["scalingModifiers"]
    terms = [term.strip() for term in modifiers["formula"].split("+")]
    assert sorted(terms) == sorted(t["name"] for t in triggers), "the formula sums every partition's trigger once"
    assert all(re.fullmatch(r"[A-Za-z_]\w*", term) for term in terms)
    assert float(modifiers["target"]) == float(setting(r, g, gcli, "RSB_CONCURRENCY")), "jobs per worker = --concurrency"
    assert modifiers.get("metricType", "AverageValue") == "AverageValue"
    behavior = so["spec"]["advanced"].get("horizontalPodAutoscalerConfig", {}).get("behavior")
    if behavior:  # the HPA KEDA creates gets it: validate it as one
        hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
               "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "x"}, "maxReplicas": 1, "behavior": behavior}}
        assert not validate_object(hpa)


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_autoscaling_disruption_and_resources(variant: str) -> None:
    r = render(variant)
    scaled = {h["spec"]["scaleTargetRef"]["name"]: h["spec"].get("minReplicas", 1)
              for h in r.all("HorizontalPodAutoscaler")}
    scaled.update({s["spec"]["scaleTargetRef"]["name"]: s["spec"].get("minReplicaCount", 0)
                   for s in r.all("ScaledObject")})
    for workload, c in rsb_containers(r):
        name = workload["metadata"]["name"]
        assert name in scaled, f"{name} has no autoscaler"
        assert "replicas" not in workload["spec"], f"{name}: its autoscaler owns replicas (apply would reset them)"
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] > 0
        assert spec.get("automountServiceAccountToken") is False
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
        # Any pod that writes (the demo model cache, temp files) writes to a volume: the root is read-only.
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts
    # PodDisruptionBudgets never block a node drain: minAvailable stays below the autoscaler's minimum.
    for pdb in r.all("PodDisruptionBudget"):
        selector = pdb["spec"]["selector"]["matchLabels"]
        [workload] = [w for w in r.all("Deployment") + r.all("StatefulSet")
                      if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        floor = scaled.get(workload["metadata"]["name"], workload["spec"].get("replicas", 1))
        if "minAvailable" in pdb["spec"]:
            assert int(pdb["spec"]["minAvailable"]) < floor, f"{pdb['metadata']['name']} would block drains"
        assert pdb["spec"].get("unhealthyPodEvictionPolicy") == "AlwaysAllow"
    # llama.cpp would start a thread per core of the node: the generator's threads fit its CPUs.
    g = container(r.workload("generator"))
    threads = setting(r, g, cli_command("generator"), "RSB_N_THREADS") if "RSB_N_THREADS" in resolved_env(r, g) \
        or "--n-threads" in command_of(g) else None
    assert threads, "set RSB_N_THREADS: the default is every physical core of the node"
    assert int(threads) <= quantity(g["resources"]["requests"]["cpu"]) == quantity(g["resources"]["limits"]["cpu"])


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_ingress_is_set_for_sse(variant: str) -> None:
    """The ingress-nginx annotations that deploy/nginx.conf's settings translate to (docs/deployment.md)."""
    r = render(variant)
    c = container(r.workload("consumer"))
    cli = cli_command("consumer")
    [ingress] = r.all("Ingress")
    a = {k.removeprefix("nginx.ingress.kubernetes.io/"): v for k, v in ingress["metadata"]["annotations"].items()}
    assert a["proxy-buffering"] == "off"
    heartbeat = float(setting(r, c, cli, "RSB_HEARTBEAT_S"))
    assert float(a["proxy-read-timeout"]) >= 10 * heartbeat and float(a["proxy-send-timeout"]) >= 10 * heartbeat
    assert a["load-balance"] in ("ewma", "least_conn"), "streams are long-lived: not round robin"
    assert a.get("service-upstream", "false") == "false"
    assert "affinity" not in a and "upstream-hash-by" not in a, "no session affinity"
    size = re.fullmatch(r"(\d+)([kmg]?)", a["proxy-body-size"].lower())
    assert size, a["proxy-body-size"]
    body_bytes = int(size.group(1)) * {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}[size.group(2)]
    assert body_bytes > float(setting(r, c, cli, "RSB_MAX_BODY_BYTES")), "rsb answers 413 as JSON, not nginx"


@needs_kubectl
def test_the_api_keys_placeholder_is_no_key() -> None:
    """The committed keys file is valid (a consumer starts with it) and accepts no secret: all zeros is no
    SHA-256 anyone can produce. The read-token secret is empty: a random one kept in Redis. The live test checks
    that the consumer answers 401."""
    r = render(OVERLAYS[0])
    keys = json.loads(r.secret_value(resolve_api_keys_secret(r), "keys.json"))
    assert [k["sha256"] for k in keys["keys"]] == ["0" * 64]
    assert r.secret_value(read_token_secret_name(r), "secret") == ""


@needs_kubectl
def test_the_in_namespace_redis_requires_the_password_rsb_and_keda_use_and_has_no_default() -> None:
    """standalone-redis: Redis gets ``--requirepass`` from the rsb-redis Secret's ``password``, which its probe,
    KEDA's trigger and every rsb pod (RSB_REDIS_PASSWORD) read too; the committed password is empty, and the
    container's command, run for real, refuses to start Redis with it."""
    r = render("standalone-redis")
    [redis_set] = r.all("StatefulSet")
    [c] = pod_spec(redis_set)["containers"]
    [auth] = [e for e in c["env"] if e["name"] == "REDISCLI_AUTH"]
    secret = auth["valueFrom"]["secretKeyRef"]
    assert secret["key"] == "password"
    script = c["args"][-1]
    assert c["args"][:2] == ["sh", "-c"] and '--requirepass "$REDISCLI_AUTH"' in script
    for component in ("consumer", "generator"):
        [item] = [e for e in container(r.workload(component))["env"] if e["name"] == "RSB_REDIS_PASSWORD"]
        assert item["valueFrom"]["secretKeyRef"] == {"name": secret["name"], "key": "password"}, component
    keda = [t for t in r.all("TriggerAuthentication") for ref in t["spec"]["secretTargetRef"]
            if ref["name"] == secret["name"] and ref["key"] == "password"]
    assert keda, "KEDA's trigger reads the same password"
    assert r.secret_value(secret["name"], "password") == ""
    refused = subprocess.run(["sh", "-c", script], env={"PATH": os.environ["PATH"], "REDISCLI_AUTH": ""},
                             capture_output=True, text=True, timeout=10)
    assert refused.returncode == 1 and "set the rsb-redis Secret's password" in refused.stderr


def resolve_api_keys_secret(r: Rendered) -> str:
    c = container(r.workload("consumer"))
    path = resolved_env(r, c)["RSB_API_KEYS"]
    for mount in c["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            [volume] = [v for v in pod_spec(r.workload("consumer"))["volumes"] if v["name"] == mount["name"]]
            assert path.rsplit("/", 1)[1] in r.get("Secret", volume["secret"]["secretName"])["data"]
            return str(volume["secret"]["secretName"])
    raise AssertionError(f"RSB_API_KEYS={path} is on no mounted volume")


def read_token_secret_name(r: Rendered) -> str:
    [item] = [e for e in container(r.workload("consumer"))["env"] if e["name"] == "RSB_READ_TOKEN_SECRET"]
    return str(item["valueFrom"]["secretKeyRef"]["name"])


def test_docs_give_the_apply_path() -> None:
    doc = DEPLOYMENT_DOC.read_text()
    for overlay in OVERLAYS:
        assert f"kubectl apply -k deploy/kubernetes/overlays/{overlay}" in doc
    for component in COMPONENTS:
        assert f"components/{component}" in doc


@needs_promtool
def test_alert_rules_pass_promtool() -> None:
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), rule["alert"]
        assert rule["annotations"]["summary"]


@needs_promtool
def test_dashboard_queries_parse(tmp_path: Path) -> None:
    """Every dashboard query is valid PromQL: promtool parses them as recording rules."""
    assert PROMTOOL is not None
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    queries = dashboard_queries()
    assert len(queries) >= 10
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"rsb_dashboard:q{i}", "expr": expr}
                                                        for i, (_, expr) in enumerate(queries)]}]}
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump(rules))
    proc = subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    titles = " ".join(title for title, _ in queries).lower()
    for topic in ("streams", "token", "first token", "queue", "readers", "aborted"):
        assert topic in titles, f"the dashboard has no panel about {topic}"


# -- a live rsb, configured as the manifests configure it ------------------------------------------------


def manifest_env(r: Rendered, component: str) -> dict[str, str]:
    return {k: v for k, v in resolved_env(r, container(r.workload(component))).items() if k.startswith("RSB_")}


@needs_kubectl
def test_live_rsb_serves_what_the_deployment_files_name(
        stack_factory: Any, redis_server: RedisServer, redis_client: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A consumer and a generator started with the environment the standalone-redis overlay gives them (the
    Redis URL, ports and listen addresses replaced for this machine, by flags, which win over the variables)
    answer every probe path of the manifests, and together serve every metric the manifests, the alert rules
    and the dashboard name. On the way: the job stream's length, the signal KEDA scales the generators on,
    is the count of unfinished jobs and drains to zero."""
    r = render("standalone-redis")
    stack = stack_factory(redis_server.url)
    partitions = int(manifest_env(r, "generator")["RSB_PARTITIONS"])
    jobs = [QueueKeys(i, partitions, manifest_env(r, "generator")["RSB_MODEL_NAME"]).backlog for i in range(partitions)]

    # The keys file and read-token secret as the pod gets them (the committed fail-closed placeholder).
    placeholder = tmp_path / "placeholder-keys.json"
    placeholder.write_text(r.secret_value(resolve_api_keys_secret(r), "keys.json"))
    # A real key, generated as docs/deployment.md shows, for driving the API.
    secret = secrets.token_urlsafe(32)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"id": "ops", "sha256": hashlib.sha256(secret.encode()).hexdigest()}]}))
    auth = {"Authorization": f"Bearer ops.{secret}"}

    consumer_env = manifest_env(r, "consumer")
    with monkeypatch.context() as m:
        for k, v in consumer_env.items():
            m.setenv(k, v)
        # As deployed: the placeholder keys. Every probe path answers; the API is closed; /metrics is on its port.
        sealed_metrics = free_port()
        _, sealed = stack.consumer("--host", "127.0.0.1", "--api-keys", str(placeholder), "--scrape-port",
                                   str(sealed_metrics))
        # Driving the API: a real key, and a queue bound of 1 to see a 429.
        _, url = stack.consumer("--host", "127.0.0.1", "--api-keys", str(keys), "--max-queue", "1",
                                "--scrape-port", "0")  # not the manifests' fixed port, on every interface
    c = container(r.workload("consumer"))
    for name, probe in probes(c).items():
        assert httpx.get(sealed + probe["httpGet"]["path"], timeout=5).status_code == 200, name
    assert httpx.get(sealed + "/metrics", timeout=5).status_code == 401  # the API port: keys only
    assert httpx.get(f"http://127.0.0.1:{sealed_metrics}/metrics", timeout=5).status_code == 200
    body = {"prompt": "Hello", "max_tokens": 4}
    assert httpx.post(sealed + "/v1/streams", json=body, timeout=5).status_code == 401
    assert httpx.post(sealed + "/v1/streams", json=body, headers={"Authorization": "Bearer replace-me.x"},
                      timeout=5).status_code == 401

    def xlen() -> int:
        return sum(int(redis_client.xlen(k)) for k in jobs)

    def waiting() -> float:
        found = re.search(r"^rsb_queue_waiting (\S+)$", httpx.get(url + "/metrics", headers=auth, timeout=5).text,
                          re.M)
        assert found, "the consumer serves no rsb_queue_waiting"
        return float(found.group(1))

    with httpx.Client(base_url=url, headers=auth, timeout=30) as api:
        first, second, third = (str(uuid.uuid4()) for _ in range(3))
        assert api.post("/v1/streams", json={"id": first, **body}).status_code == 201
        assert api.post("/v1/streams", json={"id": second, **body}).status_code == 429  # queue full
        assert api.post("/v1/streams", json={"id": first, **body}).status_code == 200  # a retry: replayed
        assert xlen() == 1 and waiting() == 1
        assert api.post(f"/v1/streams/{first}/cancel").status_code == 202  # cancelled while queued
        wait_status(api, first, {"cancelled"})
        assert api.post("/v1/streams", json={"id": third, "prompt": "Once upon", "max_tokens": 12}).status_code == 201
        # The cancelled stream's job left the backlog with its cancel: KEDA counts only work to do.
        assert xlen() == 1 and waiting() == 1

        generator_env = manifest_env(r, "generator")
        metrics_port = free_port()
        with monkeypatch.context() as m:
            for k, v in generator_env.items():
                m.setenv(k, v)
            stack.generator("--metrics-port", str(metrics_port), "--metrics-host", "127.0.0.1")
        gurl = f"http://127.0.0.1:{metrics_port}"
        wait_status(api, third, {"done"})
        eventually(lambda: xlen() == 0, 30, "the job streams to drain (finished jobs are deleted)")
        read = read_sse(api, f"/v1/streams/{third}/events")
        assert read.status == 200 and read.events[-1].event == "done"
        resumed = read_sse(api, f"/v1/streams/{third}/events", headers={"Last-Event-ID": read.ids[0]})
        assert resumed.ids == read.ids[1:]

    for name, probe in probes(container(r.workload("generator"))).items():
        assert httpx.get(gurl + probe["httpGet"]["path"], timeout=5).status_code == 200, name
    served = exposition_names(httpx.get(url + "/metrics", headers=auth, timeout=5).text) | \
        exposition_names(httpx.get(gurl + "/metrics", timeout=5).text)
    missing = {where: sorted(names - served) for where, names in named_metrics().items() if names - served}
    assert not missing, f"metrics named but not served by rsb: {missing}\nserved: {sorted(served)}"
