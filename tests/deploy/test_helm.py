"""The Helm chart (helm/kvx): lint, render, validate, scan, and what it promises.

Every values file in helm/kvx/ci/ is rendered once per session with
`helm template`; the renders are validated offline against the Kubernetes
JSON schemas kubernetes-validate bundles (1.30, the oldest the chart
supports, and the newest bundled) and scanned by checkov in one run. The
other tests read the renders (or render a variation) and check what could
break silently: the schema's strictness, the drain/grace-period relation,
secrets that must not change, which pods each NetworkPolicy admits, and
what each RDMA mode adds. One test installs and upgrades the chart against
a fake API server on loopback (tests/deploy/_kube_fake.py), because
`lookup`, which keeps generated secrets, runs only in a real install.

The tools come from scripts/deploy_tools.sh (scripts/test.sh runs it and
exports KVX_HELM, KVX_CHECKOV, KVX_K8S_VALIDATE). Without them the tests skip,
except in CI, where they must run. They run in the KVX_NATIVE=1 pass only:
nothing here touches the data path.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import conftest
from tests.deploy._kube_fake import FakeKube

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvx"
CHECKOV_CONFIG = ROOT / "helm" / "checkov.yaml"
RELEASE = "kvx-test"
NAMESPACE = "kvx"
FULLNAME = f"{RELEASE}"  # the release name contains the chart's name: no suffix
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the
# newest whose schemas kubernetes-validate bundles.
KUBE_OLDEST = "1.30.0"
KUBE_NEWEST = "1.37.0"
# resource.k8s.io/v1 (DRA, rdma.mode=dra) exists from Kubernetes 1.34 on.
KUBE_DRA = "1.34.0"
# Custom resources: no schema is bundled for them. Their pod templates
# (LeaderWorkerSet) are validated as Pods instead; the Prometheus Operator's
# objects are checked by test_prometheus_rule_* below, not against a schema.
CRD_KINDS = {
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "a CRD of the LeaderWorkerSet controller",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "a CRD of the Prometheus Operator",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "a CRD of the Prometheus Operator",
}
TOOLS = {"KVX_HELM": "helm", "KVX_CHECKOV": "checkov", "KVX_K8S_VALIDATE": "kubernetes-validate"}
TIMEOUT_S = 120


def _tool(env: str) -> str:
    if conftest.NATIVE == "0":
        pytest.skip("the chart's tests run in the KVX_NATIVE=1 pass: they do not touch the data path")
    path = os.environ.get(env, "")
    if not path or not os.access(path, os.X_OK):
        why = (
            f"{env} is not set to an executable {TOOLS[env]} ({path or 'unset'}): run scripts/deploy_tools.sh"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the chart's tests, but {why} (scripts/test.sh does)")
        pytest.skip(why)
    return path


def _run(
    args: list[str], check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    done = subprocess.run(
        args, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=TIMEOUT_S, env=env
    )
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def helm_template(
    *values_files: Path, sets: list[str] | None = None, kube: str = KUBE_OLDEST, check: bool = True
) -> subprocess.CompletedProcess:
    args = [
        _tool("KVX_HELM"),
        "template",
        RELEASE,
        str(CHART),
        "--namespace",
        NAMESPACE,
        "--kube-version",
        kube,
    ]
    for f in values_files:
        args += ["--values", str(f)]
    for s in sets or []:
        args += ["--set", s]
    return _run(args, check=check)


def render(*values_files: Path, sets: list[str] | None = None, kube: str = KUBE_OLDEST) -> list[dict]:
    out = helm_template(*values_files, sets=sets, kube=kube).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def ci_file(name: str) -> Path:
    return CHART / "ci" / f"{name}-values.yaml"


def kube_for(name: str) -> str:
    return KUBE_DRA if name == "rdma-dra" else KUBE_OLDEST


CI_NAMES = sorted(p.name.removesuffix("-values.yaml") for p in (CHART / "ci").glob("*-values.yaml"))


@pytest.fixture(scope="session")
def renders() -> dict[str, list[dict]]:
    """Every ci/*-values.yaml, rendered once: {name: [objects]}."""
    return {name: render(ci_file(name), kube=kube_for(name)) for name in CI_NAMES}


def find(objs: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def pod_templates(objs: list[dict]) -> dict[str, dict]:
    """{workload/template: pod template} of every workload rendered."""
    out = {}
    for o in objs:
        name = f"{o['kind']}/{o['metadata']['name']}"
        if o["kind"] in ("Deployment", "StatefulSet"):
            out[name] = o["spec"]["template"]
        elif o["kind"] == "LeaderWorkerSet":
            lwt = o["spec"]["leaderWorkerTemplate"]
            for key in ("leaderTemplate", "workerTemplate"):
                if key in lwt:
                    out[f"{name}/{key}"] = lwt[key]
    return out


def worker_pod(objs: list[dict], role: str) -> dict:
    for tpl in pod_templates(objs).values():
        if tpl["metadata"]["labels"]["app.kubernetes.io/component"] == role:
            return tpl
    raise AssertionError(f"no {role} pod template")


def container(tpl: dict) -> dict:
    (c,) = tpl["spec"]["containers"]
    return c


def env_of(c: dict) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


# -- lint, schemas, policy scan --------------------------------------------------------------


def test_chart_lints_strictly_with_every_ci_values_file():
    helm = _tool("KVX_HELM")
    _run([helm, "lint", "--strict", str(CHART)])
    for name in CI_NAMES:
        if kube_for(name) != KUBE_OLDEST:
            # helm 3.10's lint has no --kube-version and renders for Kubernetes
            # 1.25, where the chart refuses DRA; `helm template` renders it below.
            continue
        _run([helm, "lint", "--strict", str(CHART), "--values", str(ci_file(name))])


def test_every_render_matches_the_kubernetes_schemas(renders, tmp_path):
    validate = _tool("KVX_K8S_VALIDATE")
    files: dict[str, list[Path]] = {}  # the oldest version to check -> files
    skipped = []
    for name, objs in renders.items():
        for i, obj in enumerate(objs):
            key = (obj["apiVersion"], obj["kind"])
            docs = [obj]
            if key in CRD_KINDS:
                skipped.append(f"{obj['kind']}/{obj['metadata']['name']}: {CRD_KINDS[key]}")
                # What can be checked of a LeaderWorkerSet: its pods.
                docs = [
                    {"apiVersion": "v1", "kind": "Pod", "metadata": {**tpl["metadata"], "name": pod.lower().replace("/", "-")},
                     "spec": tpl["spec"]}
                    for pod, tpl in pod_templates([obj]).items()
                ]  # fmt: skip
            for j, doc in enumerate(docs):
                path = tmp_path / f"{name}-{i}-{j}.yaml"
                path.write_text(yaml.safe_dump(doc))
                files.setdefault(kube_for(name), []).append(path)
    assert skipped, "the CI values files render no custom resources: the skip list is stale"
    checked = 0
    for oldest, paths in files.items():
        for version in (oldest, KUBE_NEWEST):
            done = _run([validate, "--strict", "-k", version, *map(str, paths)], check=False)
            problems = [
                line
                for line in done.stdout.splitlines() + done.stderr.splitlines()
                if not line.startswith("INFO")
            ]
            assert done.returncode == 0 and not problems, "\n".join(problems)
            passed = done.stdout.count(" passed for resource ")
            assert passed == len(paths), f"{passed} of {len(paths)} objects validated against {version}"
            checked += passed
    assert checked > 100


def test_checkov_finds_nothing_unexplained(renders, tmp_path):
    checkov = _tool("KVX_CHECKOV")
    # Every skip in the config says why, on its line.
    skips = [
        line.strip() for line in CHECKOV_CONFIG.read_text().splitlines() if line.strip().startswith("- CKV")
    ]
    assert skips
    for line in skips:
        check, _, reason = line.removeprefix("- ").partition("#")
        assert len(reason.strip()) > 30, f"checkov skip {check.strip()} has no reason in {CHECKOV_CONFIG}"
    for name, objs in renders.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump_all(objs))
    env = dict(os.environ, BC_SKIP_MAPPING="TRUE", CKV_SKIP_PACKAGE_UPDATE_CHECK="TRUE")
    done = _run(
        [checkov, "--config-file", str(CHECKOV_CONFIG), "--directory", str(tmp_path), "--output", "json"],
        check=False,
        env=env,
    )
    report = json.loads(done.stdout)
    reports = report if isinstance(report, list) else [report]
    failed = [
        f"{c['check_id']} {c['check_name']}: {c['resource']} in {c['file_path']}"
        for r in reports
        for c in r.get("results", {}).get("failed_checks", [])
    ]
    assert not failed, (
        "checkov failures (fix them, or skip with a reason in helm/checkov.yaml):\n" + "\n".join(failed)
    )
    summary = reports[0]["summary"]
    assert summary["parsing_errors"] == 0
    assert summary["resource_count"] >= 10 * len(renders), summary
    assert done.returncode == 0, done.stderr


# -- the values schema and the chart's own checks ---------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["metdata.store=etcd"], "Additional property metdata is not allowed"),
        (["workers.engin=vllm"], "Additional property engin is not allowed"),
        (["workers.prefill.gpu=1"], "Additional property gpu is not allowed"),
        (["workers.engine=vlm"], "workers.engine must be one of the following"),
        (["rdma.mode=sriov"], "rdma.mode must be one of the following"),
        (["workers.kind=deployment"], "workers.kind must be one of the following"),
        (["metadata.eventLoop=trio"], "metadata.eventLoop must be one of the following"),
    ],
)
def test_schema_rejects_typos_and_unknown_names(sets, message):
    done = helm_template(sets=sets, check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["metadata.replicas=2"], "needs metadata.store=etcd"),
        (["metadata.store=etcd"], "needs etcd.external.endpoints or etcd.deploy.enabled"),
        (["etcd.deploy.enabled=true"], "metadata.store is memory"),
        (
            ["metadata.readReplicas=1", "metadata.store=etcd", "etcd.deploy.enabled=true"],
            "raise metadata.replicas instead",
        ),
        (["workers.engine=sglang"], "needs workers.image.repository"),
        (["rdma.mode=dra", "rdma.dra.deviceClassName=x"], "needs Kubernetes 1.34.0 or newer"),
        (
            ["workers.kind=leaderworkerset", "workers.leaderWorkerSet.size=2"],
            "needs workers.leaderWorkerSet.workerCommand",
        ),
        (["secret.adminToken=short"], "shorter than 16 characters"),
    ],
)
def test_inconsistent_settings_fail_with_a_fix(sets, message):
    done = helm_template(sets=sets, check=False)
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


# -- workers: the daemon contract ----------------------------------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_workers_run_the_daemon_as_the_contract_says(renders, role):
    objs = renders["vllm-gpu"]
    c = container(worker_pod(objs, role))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"prefill": {"api": 8100, "admin": 9100, "agent": 7100},
                     "decode": {"api": 8200, "admin": 9200, "agent": 7200}}[role]  # fmt: skip
    assert c["command"] == ["kvx", role]
    extra = ["--enforce-eager"] if role == "prefill" else []
    assert c["args"] == [
        "--",
        "--model",
        "meta-llama/Llama-3.1-8B-Instruct",
        "--max-model-len",
        "8192",
        *extra,
    ]
    assert c["image"] == "ghcr.io/kvx-project/kvx-vllm:0.1.0"
    env = env_of(c)
    assert env["KVX_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["KVX_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["KVX_HOST"] == "0.0.0.0"
    assert env["KVX_ENGINE"] == "vllm"
    assert env["KVX_METADATA"] == f"{FULLNAME}-metadata:50051"
    assert (env["KVX_API_PORT"], env["KVX_ADMIN_PORT"], env["KVX_AGENT_PORT"]) == tuple(
        str(ports[k]) for k in ("api", "admin", "agent")
    )
    # Every file the daemon is told of is mounted from the Secret.
    pod = worker_pod(objs, role)["spec"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "secrets"]
    (vol,) = [v for v in pod["volumes"] if v["name"] == "secrets"]
    mounted = {f"{mount['mountPath']}/{i['path']}" for i in vol["secret"]["items"]}
    for key in ("KVX_SECRET_FILE", "KVX_ADMIN_TOKEN_FILE", "KVX_METADATA_TOKEN_FILE"):
        assert env[key] in mounted
    assert vol["secret"]["secretName"] == f"{FULLNAME}-secret"
    # Probes on the admin port: liveness /healthz, readiness /readyz, a long start for vllm.
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    startup = c["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 1800
    # GPUs, /dev/shm in memory, a locked-down container.
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    assert pod["automountServiceAccountToken"] is False


def test_the_synthetic_engine_gets_its_settings_and_no_gpu(renders):
    for role, replicas in (("prefill", 2), ("decode", 3)):
        sts = find(renders["synthetic"], "StatefulSet", f"{FULLNAME}-{role}")
        assert sts["spec"]["replicas"] == replicas
        c = container(sts["spec"]["template"])
        env = env_of(c)
        assert (env["KVX_ENGINE"], env["KVX_MODEL_SHAPE"], env["KVX_NUM_BLOCKS"]) == (
            "synthetic",
            "llama-3.1-8b",
            "4096",
        )
        assert (env["KVX_PREFILL_TOKENS_PER_S"], env["KVX_BACKEND"]) == ("20000", "tcp")
        assert "args" not in c and c["image"] == "ghcr.io/kvx-project/kvx:0.1.0"
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


@pytest.mark.parametrize(("drain_s", "margin_s"), [(None, None), (120, 15), (7, 30)])
def test_prestop_drains_within_the_grace_period(drain_s, margin_s):
    sets = []
    if drain_s is not None:
        sets = [f"workers.drainTimeoutS={drain_s}", f"workers.terminationGraceMarginS={margin_s}"]
    else:
        drain_s, margin_s = 30, 15  # values.yaml
    objs = render(sets=sets)
    for role, admin_port in (("prefill", 9100), ("decode", 9200)):
        tpl = worker_pod(objs, role)
        c = container(tpl)
        cmd = c["lifecycle"]["preStop"]["exec"]["command"]
        assert cmd[:2] == ["kvx", "drain"] and "--wait" in cmd
        assert cmd[cmd.index("--admin") + 1] == f"http://127.0.0.1:{admin_port}"
        assert cmd[cmd.index("--token-file") + 1] == env_of(c)["KVX_ADMIN_TOKEN_FILE"]
        assert int(cmd[cmd.index("--timeout-s") + 1]) == drain_s == int(env_of(c)["KVX_DRAIN_TIMEOUT_S"])
        # The kubelet kills the container when the grace period ends, preStop or not.
        grace = tpl["spec"]["terminationGracePeriodSeconds"]
        assert grace == drain_s + margin_s and grace > drain_s


def test_leaderworkerset_groups_run_the_daemon_on_the_leader(renders):
    objs = renders["lws"]
    assert not [o for o in objs if o["kind"] == "StatefulSet"]
    for role in ("prefill", "decode"):
        lws = find(objs, "LeaderWorkerSet", f"{FULLNAME}-{role}")
        lwt = lws["spec"]["leaderWorkerTemplate"]
        assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lwt["size"] == 2
        leader, worker = container(lwt["leaderTemplate"]), container(lwt["workerTemplate"])
        assert leader["command"] == ["kvx", role] and "preStop" in leader["lifecycle"]
        assert worker["command"] == ["sh", "-c", "ray start --address=$(LWS_LEADER_ADDRESS):6379 --block"]
        assert "lifecycle" not in worker and "ports" not in worker
        assert (
            leader["resources"]["limits"]["nvidia.com/gpu"]
            == worker["resources"]["limits"]["nvidia.com/gpu"]
            == 8
        )


# -- metadata, etcd, proxy -----------------------------------------------------------------


def args_of(objs: list[dict], kind: str, name: str) -> list[str]:
    return container(find(objs, kind, name)["spec"]["template"])["args"]


def test_metadata_store_follows_the_values(renders):
    default = renders["defaults"]
    dep = find(default, "Deployment", f"{FULLNAME}-metadata")
    assert "--store=memory" in args_of(default, "Deployment", f"{FULLNAME}-metadata")
    # asyncio, the default, is not named: an image of a kvx before the flag still starts
    assert not [a for a in args_of(default, "Deployment", f"{FULLNAME}-metadata") if "event-loop" in a]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    assert not [o for o in default if "etcd" in o["metadata"]["name"]]

    deployed = renders["etcd-deploy"]
    etcd = f"{FULLNAME}-etcd"
    members = ",".join(f"{etcd}-{i}.{etcd}:2379" for i in range(3))
    assert f"--store=etcd://{members}" in args_of(deployed, "Deployment", f"{FULLNAME}-metadata")
    assert find(deployed, "Deployment", f"{FULLNAME}-metadata")["spec"]["replicas"] == 2
    sts = find(deployed, "StatefulSet", etcd)
    assert sts["spec"]["replicas"] == 3
    cluster = [a for a in container(sts["spec"]["template"])["command"] if a.startswith("--initial-cluster=")]
    assert cluster == [
        "--initial-cluster=" + ",".join(f"{etcd}-{i}=http://{etcd}-{i}.{etcd}:2380" for i in range(3))
    ]

    external = renders["etcd-external"]
    eps = ",".join(f"etcd-{i}.etcd.infra.svc:2379" for i in range(3))
    assert f"--store=etcd://{eps}" in args_of(external, "Deployment", f"{FULLNAME}-metadata")
    assert not [o for o in external if o["kind"] == "StatefulSet" and o["metadata"]["name"] == etcd]


def test_read_replicas_follow_the_service_and_the_workers_read_there(renders):
    objs = renders["synthetic"]  # metadata.readReplicas: 2
    service = f"{FULLNAME}-metadata"
    read = find(objs, "Deployment", f"{service}-read")
    assert read["spec"]["replicas"] == 2 and "strategy" not in read["spec"]  # copies roll freely
    args = args_of(objs, "Deployment", f"{service}-read")
    grpc = {p["name"]: p["port"] for p in find(objs, "Service", service)["spec"]["ports"]}["grpc"]
    assert f"--store=mirror://{service}:{grpc}" in args
    assert "--token-file=/etc/kvx/secrets/metadata-token" in args  # its token at the service too
    assert find(objs, "Deployment", service)["spec"]["strategy"]["type"] == "Recreate"
    # Watch slots set aside at the service for its replicas (the default, twice 2 and more).
    assert "--max-replica-watch-streams=16" in args_of(objs, "Deployment", service)
    # metadata.eventLoop: uvloop, for the service and its replicas alike.
    assert "--event-loop=uvloop" in args_of(objs, "Deployment", service)
    assert "--event-loop=uvloop" in args
    read_svc = find(objs, "Service", f"{service}-read")
    assert read_svc["spec"]["selector"]["app.kubernetes.io/component"] == "metadata-read"
    read_grpc = {p["name"]: p["port"] for p in read_svc["spec"]["ports"]}["grpc"]
    for role in ("prefill", "decode"):
        env = env_of(container(worker_pod(objs, role)))
        assert env["KVX_METADATA"] == f"{service}:{grpc}"  # registration and renewals
        assert env["KVX_METADATA_READ"] == f"{service}-read:{read_grpc}"  # lookups and the watch
    assert find(objs, "PodDisruptionBudget", f"{service}-read")["spec"]["maxUnavailable"] == 1
    # SGLang's agents do not look peers up in the metadata service: no setting that
    # its daemon would refuse. The replicas' /metrics are scraped as the service's.
    sets = ["metadata.readReplicas=1", "workers.engine=sglang", "workers.image.repository=x/sglang"]
    sglang = render(sets=[*sets, "serviceMonitor.enabled=true"])
    assert "KVX_METADATA_READ" not in env_of(container(worker_pod(sglang, "decode")))
    monitor = find(sglang, "ServiceMonitor", f"{service}-read")
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "metadata-read"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["authorization"]["credentials"]["key"] == "metadata-admin-token"
    # Without read replicas: none of it, and the workers read at the service.
    default = renders["defaults"]
    assert not [o for o in default if o["metadata"]["name"].startswith(f"{service}-read")]
    assert "KVX_METADATA_READ" not in env_of(container(worker_pod(default, "decode")))


def test_proxy_and_workers_reach_the_metadata_service_it_renders(renders):
    objs = renders["defaults"]
    svc = find(objs, "Service", f"{FULLNAME}-metadata")
    grpc = {p["name"]: p["port"] for p in svc["spec"]["ports"]}["grpc"]
    address = f"{svc['metadata']['name']}:{grpc}"
    args = args_of(objs, "Deployment", f"{FULLNAME}-proxy")
    assert f"--metadata={address}" in args and "--listen=0.0.0.0:8000" in args
    assert env_of(container(worker_pod(objs, "decode")))["KVX_METADATA"] == address
    meta_args = args_of(objs, "Deployment", f"{FULLNAME}-metadata")
    assert f"--listen=0.0.0.0:{grpc}" in meta_args
    # Its gRPC and admin tokens are two files of the Secret.
    assert "--token-file=/etc/kvx/secrets/metadata-token" in meta_args
    assert "--admin-token-file=/etc/kvx/secrets/metadata-admin-token" in meta_args


# -- secrets ---------------------------------------------------------------------------------

GIVEN = {
    "clusterSecret": ("cluster-secret", "a-cluster-secret-of-32-characters"),
    "adminToken": ("admin-token", "an-admin-token-0123456789"),
    "metadataToken": ("metadata-token", "a-metadata-token-0123456789"),
    "metadataAdminToken": ("metadata-admin-token", "a-metadata-admin-token-0123456789"),
}


def secret_data(objs: list[dict]) -> dict[str, str]:
    data = find(objs, "Secret", f"{FULLNAME}-secret")["data"]
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def test_given_secrets_are_kept_as_they_are_render_after_render():
    sets = [f"secret.{key}={value}" for key, (_, value) in GIVEN.items()]
    first, second = render(sets=sets), render(sets=sets)
    assert secret_data(first) == secret_data(second) == {k: v for k, v in GIVEN.values()}
    # Nothing rolls the pods either: their checksum of the Secret is the same.
    sums = [
        worker_pod(objs, "prefill")["metadata"]["annotations"]["checksum/secret"] for objs in (first, second)
    ]
    assert sums[0] == sums[1]


def test_missing_secrets_are_generated_long_and_distinct():
    # `helm template` reaches no cluster, so lookup finds nothing and every
    # render generates anew; on a cluster, lookup keeps the ones stored.
    first, second = secret_data(render()), secret_data(render())
    assert set(first) == {k for k, _ in GIVEN.values()}
    for key, value in first.items():
        assert re.fullmatch(r"[A-Za-z0-9]{48}", value), key
        assert second[key] != value
    assert len(set(first.values())) == 4


def test_generated_secrets_survive_upgrades_and_do_not_roll_pods(tmp_path):
    """A real `helm install` and two `helm upgrade`s against a fake API server
    (tests/deploy/_kube_fake.py): the only way `lookup` runs offline."""
    helm = _tool("KVX_HELM")
    with FakeKube() as kube:
        config = tmp_path / "kubeconfig"
        config.write_text(kube.kubeconfig(NAMESPACE))
        config.chmod(0o600)
        env = dict(os.environ, KUBECONFIG=str(config))
        for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
            env[var] = str(tmp_path / var.lower())
        base = [helm, "--namespace", NAMESPACE]
        chart = [RELEASE, str(CHART), "--disable-openapi-validation"]

        def manifest(revision: int) -> list[dict]:
            done = _run([*base, "get", "manifest", RELEASE, "--revision", str(revision)], env=env)
            return [doc for doc in yaml.safe_load_all(done.stdout) if doc]

        def checksums(objs: list[dict]) -> set[str]:
            return {t["metadata"]["annotations"]["checksum/secret"] for t in pod_templates(objs).values()}

        _run([*base, "install", *chart], env=env)
        secret_path = f"/api/v1/namespaces/{NAMESPACE}/secrets/{FULLNAME}-secret"
        assert secret_path in kube.objects
        lookups_before = sum(1 for m, p, _ in kube.requests if m == "GET" and p == secret_path)
        _run([*base, "upgrade", *chart, "--set", "workers.decode.replicas=2"], env=env)
        first, second = manifest(1), manifest(2)
        assert sum(1 for m, p, _ in kube.requests if m == "GET" and p == secret_path) > lookups_before
        generated = secret_data(first)
        assert secret_data(second) == generated
        stored = kube.objects[secret_path]["data"]
        assert {k: base64.b64decode(v).decode() for k, v in stored.items()} == generated
        # Nothing about the secret changed, so no pod rolls: only the replicas were patched.
        assert len(checksums(first)) == 1 and checksums(first) == checksums(second)
        patches = [(p, body) for m, p, body in kube.requests if m == "PATCH"]
        assert not [p for p, body in patches if "checksum/secret" in json.dumps(body) or "/secrets/" in p]
        assert any("statefulsets/kvx-test-decode" in p for p, _ in patches)

        # A token given later replaces the generated one, and only that one; the pods roll.
        _run(
            [
                *base,
                "upgrade",
                *chart,
                "--reuse-values",
                "--set",
                "secret.adminToken=a-new-admin-token-0123456789",
            ],
            env=env,
        )
        third = manifest(3)
        assert secret_data(third) == {**generated, "admin-token": "a-new-admin-token-0123456789"}
        assert checksums(third).isdisjoint(checksums(second))


def test_an_existing_secret_replaces_the_charts():
    objs = render(sets=["secret.existingSecret=site-kvx"])
    assert not [o for o in objs if o["kind"] == "Secret"]
    for tpl in pod_templates(objs).values():
        (vol,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "secrets"]
        assert vol["secret"]["secretName"] == "site-kvx"


def test_each_pod_mounts_only_the_secret_keys_it_uses(renders):
    wanted = {
        "metadata": {"metadata-token", "metadata-admin-token"},
        "proxy": {"metadata-token"},
        "prefill": {"cluster-secret", "admin-token", "metadata-token"},
        "decode": {"cluster-secret", "admin-token", "metadata-token"},
    }
    for tpl in pod_templates(renders["defaults"]).values():
        (vol,) = [v for v in tpl["spec"]["volumes"] if v["name"] == "secrets"]
        keys = {i["key"] for i in vol["secret"]["items"]}
        assert keys == wanted[tpl["metadata"]["labels"]["app.kubernetes.io/component"]]


# -- NetworkPolicy -------------------------------------------------------------------------


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector's verdict (matchLabels, matchExpressions In/NotIn/Exists)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        op, value = e["operator"], labels.get(e["key"])
        ok = {
            "In": value in e.get("values", []),
            "NotIn": value not in e.get("values", []),
            "Exists": e["key"] in labels,
            "DoesNotExist": e["key"] not in labels,
        }[op]
        if not ok:
            return False
    return True


def admitted_ports(policy: dict, peer_labels: dict[str, str]) -> set[int] | None:
    """Ports a pod in this namespace with ``peer_labels`` may reach; None: all."""
    ports: set[int] = set()
    for rule in policy["spec"].get("ingress", []):
        peers = rule.get("from")
        if peers is not None and not any(
            "podSelector" in p and "namespaceSelector" not in p and selects(p["podSelector"], peer_labels)
            for p in peers
        ):
            continue
        if "ports" not in rule:
            return None
        for p in rule["ports"]:
            ports.update(range(p["port"], p.get("endPort", p["port"]) + 1))
    return ports


def test_network_policies_admit_only_the_releases_pods(renders):
    for name in ("defaults", "etcd-deploy", "lws", "synthetic"):
        objs = renders[name]
        policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
        pods = pod_templates(objs)
        stranger = {"app.kubernetes.io/name": "kvx", "app.kubernetes.io/instance": "another-release",
                    "app.kubernetes.io/component": "prefill"}  # fmt: skip
        proxy = find(objs, "Deployment", f"{FULLNAME}-proxy")["spec"]["template"]["metadata"]["labels"]
        # The policies govern this release's pods, never another's.
        components = ("metadata", "metadata-read", "prefill", "decode", "proxy", "etcd", "prefill-worker")
        for component in components:
            other = {**stranger, "app.kubernetes.io/component": component}
            assert not [p["metadata"]["name"] for p in policies if selects(p["spec"]["podSelector"], other)]
        for workload, tpl in pods.items():
            labels = tpl["metadata"]["labels"]
            component = labels["app.kubernetes.io/component"]
            mine = [p for p in policies if selects(p["spec"]["podSelector"], labels)]
            # Each pod is covered by exactly the policy of its component.
            assert [p["metadata"]["name"] for p in mine] == [
                f"{FULLNAME}-{component.removesuffix('-worker')}"
            ], f"{name}: {workload}"
            (policy,) = mine
            assert policy["spec"]["policyTypes"] == ["Ingress"]
            declared = {p["containerPort"] for c in tpl["spec"]["containers"] for p in c.get("ports", [])}
            if component == "proxy":  # its port only; by default from anywhere
                (rule,) = policy["spec"]["ingress"]
                assert {p["port"] for p in rule["ports"]} == declared
                assert name != "defaults" or admitted_ports(policy, {}) == declared
                continue
            # A pod of another release with the same labels reaches nothing.
            assert not admitted_ports(policy, stranger), f"{name}: {workload} admits another release"
            # The proxy (a pod of the release) reaches every port the others
            # serve; etcd's peers are the metadata service and etcd itself.
            reach = admitted_ports(policy, labels if component == "etcd" else proxy)
            assert reach is None or declared <= reach, f"{name}: {workload} {declared} vs {reach}"
            if component in ("prefill", "decode"):
                agent = {p["name"]: p["containerPort"] for p in container(tpl).get("ports", [])}["agent"]
                assert reach is None or set(range(agent, agent + 8)) <= reach  # one port per rank


def test_proxy_and_metrics_ingress_are_configurable(renders):
    objs = renders["etcd-deploy"]  # proxyFrom and metricsFrom set
    proxy = find(objs, "NetworkPolicy", f"{FULLNAME}-proxy")
    (rule,) = proxy["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "ingress"}}}
    ]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    for component, admin in (("metadata", 8081), ("prefill", 9100), ("decode", 9200)):
        policy = find(objs, "NetworkPolicy", f"{FULLNAME}-{component}")
        rules = [r for r in policy["spec"]["ingress"] if r.get("from") == [monitoring]]
        assert [r["ports"] for r in rules] == [[{"port": admin, "protocol": "TCP"}]]
    etcd = find(objs, "NetworkPolicy", f"{FULLNAME}-etcd")
    metadata_labels = find(objs, "Deployment", f"{FULLNAME}-metadata")["spec"]["template"]["metadata"][
        "labels"
    ]
    proxy_labels = find(objs, "Deployment", f"{FULLNAME}-proxy")["spec"]["template"]["metadata"]["labels"]
    assert admitted_ports(etcd, metadata_labels) == {2379}
    assert not admitted_ports(etcd, proxy_labels)  # etcd has no auth: only the metadata service


# -- RDMA modes ----------------------------------------------------------------------------


def diff(a: Any, b: Any, path: str = "") -> set[str]:
    """Paths where b differs from a (list items by their name when they have one)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = set()
        for k in set(a) | set(b):
            out |= diff(a.get(k), b.get(k), f"{path}.{k}")
        return out
    if (
        isinstance(a, list)
        and isinstance(b, list)
        and all(isinstance(x, dict) and "name" in x for x in a + b)
    ):
        return diff({x["name"]: x for x in a}, {x["name"]: x for x in b}, path)
    return set() if a == b else {path}


def without_checksum(tpl: dict) -> dict:
    tpl = copy.deepcopy(tpl)
    tpl["metadata"].get("annotations", {}).pop("checksum/secret", None)
    return tpl


RDMA_ADDS = {
    "rdma-deviceplugin": {
        ".metadata.annotations.k8s.v1.cni.cncf.io/networks",
        ".spec.containers.{role}.resources.limits.rdma/ib",
        ".spec.containers.{role}.resources.requests.rdma/ib",
        ".spec.containers.{role}.securityContext.capabilities.add",
    },
    "rdma-dra": {
        ".spec.resourceClaims",
        ".spec.containers.{role}.resources.claims",
        ".spec.containers.{role}.securityContext.capabilities.add",
    },
    "rdma-hostnetwork": {
        ".spec.hostNetwork",
        ".spec.dnsPolicy",
        ".spec.volumes.infiniband",
        ".spec.containers.{role}.volumeMounts.infiniband",
        ".spec.containers.{role}.securityContext.capabilities.add",
    },
}


@pytest.mark.parametrize("mode", sorted(RDMA_ADDS))
def test_each_rdma_mode_adds_exactly_its_pieces(renders, mode):
    base, objs = renders["defaults"], renders[mode]
    for role in ("prefill", "decode"):
        before, after = without_checksum(worker_pod(base, role)), without_checksum(worker_pod(objs, role))
        assert diff(before, after) == {p.format(role=role) for p in RDMA_ADDS[mode]}
        spec, c = after["spec"], container(after)
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert c["securityContext"]["privileged"] is False
        if mode == "rdma-deviceplugin":
            assert c["resources"]["limits"]["rdma/ib"] == c["resources"]["requests"]["rdma/ib"] == 1
            assert after["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "sriov-rdma"
        elif mode == "rdma-dra":
            assert spec["resourceClaims"] == [
                {"name": "rdma", "resourceClaimTemplateName": f"{FULLNAME}-rdma"}
            ]
            assert c["resources"]["claims"] == [{"name": "rdma"}]
        else:
            assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
            (vol,) = [v for v in spec["volumes"] if v["name"] == "infiniband"]
            assert vol["hostPath"] == {"path": "/dev/infiniband", "type": "Directory"}
    # The other pods do not change, and only DRA adds an object.
    for tpl_name, tpl in pod_templates(base).items():
        if tpl["metadata"]["labels"]["app.kubernetes.io/component"] not in ("prefill", "decode"):
            assert without_checksum(pod_templates(objs)[tpl_name]) == without_checksum(tpl)
    kinds = lambda o: sorted((x["kind"], x["metadata"]["name"]) for x in o)  # noqa: E731
    added = set(kinds(objs)) - set(kinds(base))
    assert added == ({("ResourceClaimTemplate", f"{FULLNAME}-rdma")} if mode == "rdma-dra" else set())
    if mode == "rdma-dra":
        rct = find(objs, "ResourceClaimTemplate", f"{FULLNAME}-rdma")
        assert rct["apiVersion"] == "resource.k8s.io/v1"
        (request,) = rct["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == "rdma.example.com"


def test_without_rdma_no_pod_gets_a_capability_or_the_host(renders):
    for name in ("defaults", "synthetic", "vllm-gpu", "etcd-deploy", "lws"):
        for workload, tpl in pod_templates(renders[name]).items():
            spec = tpl["spec"]
            assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), f"{name}: {workload}"
            assert not [v for v in spec.get("volumes", []) if "hostPath" in v]
            for c in spec["containers"]:
                assert "add" not in c["securityContext"]["capabilities"], f"{name}: {workload}"
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]


# -- monitoring ------------------------------------------------------------------------------


def test_prometheus_rule_alerts_on_the_daemons_metrics(renders):
    objs = renders["etcd-deploy"]
    rule = find(objs, "PrometheusRule", FULLNAME)
    alerts = {r["alert"]: r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"KvxTransferFailureRatioHigh", "KvxTransferLatencyP99High", "KvxNoPrefillReady",
                           "KvxNoDecodeReady", "KvxMetadataNotReady"}  # fmt: skip
    assert (
        'kvx_transfers_total{namespace="kvx",job=~"kvx-test-(prefill|decode)",outcome="failed"}'
        in alerts["KvxTransferFailureRatioHigh"]
    )
    assert "histogram_quantile(0.99" in alerts["KvxTransferLatencyP99High"]
    assert "kvx_transfer_duration_seconds_bucket" in alerts["KvxTransferLatencyP99High"]
    assert 'kvx_daemon_ready{namespace="kvx",job="kvx-test-prefill"}' in alerts["KvxNoPrefillReady"]
    assert (
        'kvx_metadata_store_ready{namespace="kvx",job="kvx-test-metadata"}' in alerts["KvxMetadataNotReady"]
    )
    for expr in alerts.values():  # balanced, so Prometheus can at least parse the nesting
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
    # The jobs the rules name are the Services the ServiceMonitors scrape.
    for component in ("prefill", "decode", "metadata"):
        monitor = find(objs, "ServiceMonitor", f"{FULLNAME}-{component}")
        svc = find(objs, "Service", f"{FULLNAME}-{component}")
        assert selects(monitor["spec"]["selector"], svc["metadata"]["labels"])
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics" and endpoint["port"] in {
            p["name"] for p in svc["spec"]["ports"]
        }
        if component == "metadata":  # its /metrics needs a token
            assert endpoint["authorization"]["credentials"] == {
                "name": f"{FULLNAME}-secret",
                "key": "metadata-admin-token",
            }
