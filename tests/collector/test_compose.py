"""Static checks of examples/compose/ (Docker is not runnable here: nothing is started).

- docker-compose.yml and every config it mounts or builds from parse (YAML/JSON);
- every host path mounted exists in the repo; ../../dashboards is checked only when present,
  because dashboards/ is written by another part of the project and may not exist yet;
- build contexts, Dockerfiles and the sources they COPY exist;
- ports agree: the collector's OTLP receiver ports (collector-config/otelcol.yaml) match every
  OTEL_EXPORTER_OTLP_ENDPOINT; Tempo's OTLP receiver (tempo.yaml, bound 0.0.0.0) matches the
  collector's Tempo exporter endpoint; Prometheus scrapes the collector's prometheus exporter port
  and vLLM's --port; Grafana datasource URLs hit the services' ports;
- every host in an endpoint/URL is a compose service; the Grafana datasource uids referenced
  (exemplar link, tracesToMetrics, serviceMap) exist;
- images are pinned (no :latest, no untagged image), the collector version is inside the range
  collector-config/README.md states, and otelcol.yaml merged with the Jaeger overlay passes the
  same static checks as collector-config/ (tests/collector/validator.py);
- the usage ledger: a pinned ClickHouse service; one named spool volume, mounted by the vLLM
  services at their OTEL_LLM_USAGE_DIR and read-only by the collector at the path its filelog
  receiver reads (the config's ${env:...} expanded with the collector's environment); file_storage
  on a volume; the collector's ClickHouse endpoint names the compose service;
- content and retention: the collector runs with the recordpolicy feature gate its content transform
  needs; Tempo, Prometheus and the ClickHouse ledger keep their data on volumes for exactly the
  periods the table in collector-config/README.md (retention per signal) states.
"""

from __future__ import annotations

import copy
import json
import posixpath
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from collector.validator import RECORD_POLICY_GATE, check_all, duration_seconds

from otel_llm.ops import budgets

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "examples" / "compose"
COMPOSE = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
SERVICES: dict[str, dict] = COMPOSE["services"]
OTELCOL = yaml.safe_load((ROOT / "collector-config" / "otelcol.yaml").read_text())

# Written by someone else, possibly later than this example: asserted only when present.
OPTIONAL_MOUNTS = {"../../dashboards"}

# Jaeger v2 all-in-one's default ports (its built-in config): OTLP gRPC 4317, UI/API 16686.
JAEGER_OTLP_GRPC_PORT = 4317
JAEGER_UI_PORT = 16686
PROMETHEUS_PORT = 9090  # prom/prometheus default --web.listen-address


def expand(value: str) -> str:
    """Compose variable substitution with the defaults (${VAR:-default} -> default)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", value)


def volumes() -> list[tuple[str, str, str]]:
    """(service, host path, container path) of every bind mount."""
    result = []
    for name, svc in SERVICES.items():
        for vol in svc.get("volumes") or []:
            host, container = vol.split(":")[:2]
            if host.startswith((".", "/", "~", "$")):  # bind mounts; named volumes skipped
                result.append((name, host, container))
    return result


def named_mounts(service: str) -> dict[str, tuple[str, bool]]:
    """container path -> (named volume, read-only) of a service's named-volume mounts."""
    result = {}
    for vol in SERVICES[service].get("volumes") or []:
        parts = vol.split(":")
        if not parts[0].startswith((".", "/", "~", "$")):
            result[parts[1]] = (parts[0], len(parts) > 2 and "ro" in parts[2].split(","))
    return result


def expand_otelcol(value: str, env: dict) -> str:
    """The collector's ${env:VAR:-default} substitution, with a service's environment."""
    return re.sub(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}", lambda m: str(env.get(m[1], m[2] or "")), value)


def mounted(service: str, container_path: str) -> Path:
    """Host file mounted at container_path (or under a mounted directory)."""
    for name, host, container in volumes():
        if name != service:
            continue
        if container_path == container:
            return (COMPOSE_DIR / host).resolve()
        if container_path.startswith(container.rstrip("/") + "/"):
            return (COMPOSE_DIR / host / container_path[len(container.rstrip("/")) + 1 :]).resolve()
    raise AssertionError(f"{service}: nothing mounted at {container_path}")


def command_args(svc: dict) -> list[str]:
    cmd = svc.get("command") or []
    if isinstance(cmd, str):
        cmd = shlex.split(cmd)
    if cmd[:2] == ["sh", "-c"]:
        cmd = shlex.split(cmd[2])
    return [expand(c) for c in cmd]


def flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def host_port(endpoint: str) -> tuple[str, int]:
    if "://" not in endpoint:
        endpoint = "//" + endpoint
    u = urlsplit(endpoint)
    return u.hostname, u.port


def deep_merge(base: dict, overlay: dict) -> dict:
    """The collector's merge of several --config files: maps merged, everything else replaced."""
    out = copy.deepcopy(base)
    for k, v in overlay.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def collector_config() -> dict:
    """The collector service's effective config: its --config files merged in order."""
    files = [a.split("=", 1)[1] for a in command_args(SERVICES["otel-collector"]) if a.startswith("--config=")]
    assert files, "otel-collector: no --config"
    cfg: dict = {}
    for f in files:
        cfg = deep_merge(cfg, yaml.safe_load(mounted("otel-collector", f).read_text()))
    return cfg


def otlp_receiver_ports(cfg: dict) -> dict[str, int]:
    protocols = cfg["receivers"]["otlp"]["protocols"]
    return {proto: host_port(conf["endpoint"])[1] for proto, conf in protocols.items()}


def datasources() -> list[dict]:
    path = mounted("grafana", "/etc/grafana/provisioning/datasources/datasources.yaml")
    return yaml.safe_load(path.read_text())["datasources"]


# ---- files ------------------------------------------------------------------------------------


def test_every_mounted_host_path_exists():
    assert volumes()
    for service, host, _container in volumes():
        path = (COMPOSE_DIR / host).resolve()
        assert path.is_relative_to(ROOT), f"{service}: {host} is outside the repository"
        if host in OPTIONAL_MOUNTS and not path.exists():
            continue  # dashboards/ not written yet: nothing to check
        assert path.exists(), f"{service}: mounted {host} does not exist ({path})"


def test_mounted_configs_parse():
    for _service, host, _container in volumes():
        path = (COMPOSE_DIR / host).resolve()
        files = sorted(path.rglob("*")) if path.is_dir() else [path] if path.exists() else []
        for f in files:
            if f.suffix in (".yml", ".yaml"):
                assert yaml.safe_load(f.read_text()) is not None, f
            elif f.suffix == ".json":
                json.loads(f.read_text())


def test_builds_and_dockerfile_sources_exist():
    built = [(n, s) for n, s in SERVICES.items() if "build" in s]
    assert {"vllm", "vllm-cpu"} <= {n for n, _ in built}
    for name, svc in built:
        context = (COMPOSE_DIR / svc["build"]["context"]).resolve()
        dockerfile = context / svc["build"]["dockerfile"]
        assert dockerfile.is_file(), f"{name}: {dockerfile}"
        for line in dockerfile.read_text().splitlines():
            if line.startswith("COPY "):
                sources = [a for a in shlex.split(line)[1:-1] if not a.startswith("--")]
                for src in sources:
                    assert (context / src).exists(), f"{name}: COPY {src} not in the build context"
            if line.startswith("FROM "):
                image = line.split()[1]
                assert ":" in image and not image.endswith(":latest"), f"{name}: {line}"


def test_images_pinned():
    for name, svc in SERVICES.items():
        image = svc.get("image")
        assert image, f"{name}: no image"
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: image {image!r} is not pinned"


def test_collector_version_in_supported_range():
    text = (ROOT / "collector-config" / "README.md").read_text()
    m = re.search(r"Supported: otelcol-contrib v(\d+)\.(\d+)\.(\d+) to v(\d+)\.(\d+)\.(x|\d+)", text)
    assert m, "collector-config/README.md states no supported range"
    low = (int(m[1]), int(m[2]), int(m[3]))
    high = (int(m[4]), int(m[5]))
    image = SERVICES["otel-collector"]["image"]
    assert image.startswith("otel/opentelemetry-collector-contrib:")
    version = tuple(int(x) for x in image.rsplit(":", 1)[1].lstrip("v").split("."))
    assert low <= version and version[:2] <= high, f"{image} outside v{low} .. v{high}.x"


def test_collector_config_with_jaeger_overlay_is_valid():
    cfg = collector_config()
    assert check_all(cfg) == []
    # the overlay only adds: otelcol.yaml's pipelines keep all their components
    for pid, pipeline in OTELCOL["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            assert set(pipeline.get(kind, [])) <= set(cfg["service"]["pipelines"][pid].get(kind, [])), (pid, kind)
    assert "otlp_grpc/jaeger" in cfg["service"]["pipelines"]["traces/sampled"]["exporters"]


# ---- ports and names -----------------------------------------------------------------------------


def test_otlp_endpoints_match_collector_receiver():
    ports = otlp_receiver_ports(collector_config())
    users = 0
    for name, svc in SERVICES.items():
        env = svc.get("environment") or {}
        endpoint = env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint is None:
            continue
        users += 1
        host, port = host_port(expand(endpoint))
        assert host == "otel-collector" and host in SERVICES, f"{name}: {endpoint}"
        protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
        assert port == ports["grpc" if protocol == "grpc" else "http"], f"{name}: {endpoint} ({protocol})"
    assert users >= 3  # vllm, vllm-cpu, gateway, app
    # the ports published to the host are the receiver's
    published = {int(p.split(":")[0]) for p in SERVICES["otel-collector"]["ports"]}
    assert set(ports.values()) <= published


def test_tempo_receiver_matches_collector_exporter():
    tempo = yaml.safe_load(mounted("tempo", flag(command_args(SERVICES["tempo"]), "-config.file")).read_text())
    protocols = tempo["distributor"]["receivers"]["otlp"]["protocols"]
    for proto in ("grpc", "http"):
        host, _ = host_port(protocols[proto]["endpoint"])
        assert host == "0.0.0.0", f"tempo OTLP {proto} must bind 0.0.0.0 in docker (default is localhost)"
    exporters = {k: v for k, v in collector_config()["exporters"].items() if k.endswith("/tempo")}
    assert exporters, "no Tempo exporter in the collector config"
    for eid, conf in exporters.items():
        host, port = host_port(conf["endpoint"])
        assert host == "tempo" and host in SERVICES, eid
        expected = protocols["grpc" if eid.startswith(("otlp_grpc", "otlp/")) else "http"]["endpoint"]
        assert port == host_port(expected)[1], (eid, conf["endpoint"], expected)
    assert tempo["server"]["http_listen_port"] == 3200


def test_jaeger_exporter_targets_jaeger_service():
    conf = collector_config()["exporters"]["otlp_grpc/jaeger"]
    assert host_port(conf["endpoint"]) == ("jaeger", JAEGER_OTLP_GRPC_PORT)
    assert "jaeger" in SERVICES


def test_prometheus_scrapes_collector_and_vllm():
    svc = SERVICES["prometheus"]
    args = command_args(svc)
    assert "--enable-feature=exemplar-storage" in args
    prom = yaml.safe_load(mounted("prometheus", flag(args, "--config.file")).read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    exporter_port = host_port(collector_config()["exporters"]["prometheus"]["endpoint"])[1]
    assert f"otel-collector:{exporter_port}" in targets
    for t in targets:
        assert t.split(":")[0] in SERVICES, f"scrape target {t} is not a compose service"
    for name in ("vllm", "vllm-cpu"):
        port = flag(command_args(SERVICES[name]), "--port")
        assert f"{name}:{port}" in targets, name
    # the rules files are mounted where rule_files points: otel-llm's rules, and the budget rules of
    # the example budget file, as `otel-llm budget-rules` makes them
    mounted_rules = [mounted("prometheus", rule_file) for rule_file in prom["rule_files"]]
    assert mounted_rules == [
        (ROOT / "collector-config" / "prometheus" / "otel-llm-rules.yml").resolve(),
        (COMPOSE_DIR / "budget-rules.yml").resolve(),
    ]
    budget_file = ROOT / "examples" / "gateway" / "budgets.example.json"
    assert mounted_rules[1].read_text() == budgets.rules_yaml(budgets.load(budget_file))


def test_the_gateway_asks_the_budget_server_which_prometheus_scrapes():
    server = command_args(SERVICES["budgets"])
    host, port = host_port(SERVICES["gateway"]["environment"]["GATEWAY_BUDGETS_URL"])
    assert host == "budgets" and server[:2] == ["otel-llm", "budget-server"]
    assert flag(server, "--listen") == f"0.0.0.0:{port}"
    assert flag(server, "--budgets") == "/src/examples/gateway/budgets.example.json"
    assert host_port(flag(server, "--ledger"))[0] == "clickhouse" and "budgets" in SERVICES["gateway"]["depends_on"]
    prom = yaml.safe_load(
        mounted("prometheus", flag(command_args(SERVICES["prometheus"]), "--config.file")).read_text()
    )
    assert f"budgets:{port}" in {
        t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    }


def test_gateway_upstream_is_a_vllm_service():
    host, port = host_port(expand(SERVICES["gateway"]["environment"]["GATEWAY_UPSTREAM_URL"]))
    assert host in SERVICES and port == int(flag(command_args(SERVICES[host]), "--port"))
    app_host, app_port = host_port(SERVICES["app"]["environment"]["APP_BASE_URL"])
    assert app_host == "gateway" and app_port == int(flag(command_args(SERVICES["gateway"]), "--port"))


def test_grafana_datasources_reach_services_and_uids_resolve():
    ds = datasources()
    uids = {d["uid"] for d in ds}
    by_type = {d["type"]: d for d in ds}
    tempo_port = yaml.safe_load((COMPOSE_DIR / "tempo.yaml").read_text())["server"]["http_listen_port"]
    expected_ports = {"prometheus": PROMETHEUS_PORT, "tempo": tempo_port, "jaeger": JAEGER_UI_PORT}
    for d in ds:
        host, port = host_port(d["url"])
        assert host in SERVICES, f"datasource {d['name']}: {d['url']}"
        assert port == expected_ports[d["type"]], d["url"]
    links = by_type["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]
    assert links
    for link in links:
        assert link["datasourceUid"] in uids
        # the label the collector's OTel -> Prometheus translation gives exemplars
        assert link["name"] == "trace_id"
    assert by_type["tempo"]["uid"] in {link["datasourceUid"] for link in links}
    tempo_json = by_type["tempo"]["jsonData"]
    for key in ("tracesToMetrics", "serviceMap"):
        if key in tempo_json:
            assert tempo_json[key]["datasourceUid"] in uids, key


def test_grafana_dashboards_provider_points_at_mounted_dashboards():
    providers = yaml.safe_load(mounted("grafana", "/etc/grafana/provisioning/dashboards/dashboards.yaml").read_text())[
        "providers"
    ]
    for p in providers:
        host = mounted("grafana", p["options"]["path"])
        assert host == (ROOT / "dashboards").resolve()
    if not (ROOT / "dashboards").is_dir():
        pytest.skip("dashboards/ not present yet: provider path checked, contents not")
    uids = {d["uid"] for d in datasources()}
    for f in sorted((ROOT / "dashboards").glob("*.json")):
        text = f.read_text()
        json.loads(text)
        # literal datasource uids must be provisioned ones; ${var} template variables are not checked
        for uid in re.findall(r'"datasource"\s*:\s*\{[^{}]*"uid"\s*:\s*"([^"$][^"]*)"', text):
            assert uid in uids, f"{f.name}: datasource uid {uid!r} is not provisioned"


def test_service_names_in_endpoints_exist():
    """Any http://host:port in the environment of a service names a compose service."""
    for name, svc in SERVICES.items():
        for key, value in (svc.get("environment") or {}).items():
            value = expand(str(value))
            if value.startswith("http://"):
                assert host_port(value)[0] in SERVICES, f"{name}.{key}={value}"
        for dep in svc.get("depends_on") or []:
            assert dep in SERVICES, f"{name} depends on unknown {dep}"


def test_named_volumes_declared():
    declared = set(COMPOSE.get("volumes") or {})
    for name, svc in SERVICES.items():
        for vol in svc.get("volumes") or []:
            source = vol.split(":")[0]
            if not source.startswith((".", "/", "~", "$")):
                assert source in declared, f"{name}: named volume {source!r} not declared"


def test_prometheus_config_passes_promtool(tmp_path):
    """promtool check config, with the rules file at its repo path (Debian's promtool 2.42 when
    installed; the compose image is Prometheus 3.x, whose config format is a superset)."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed")
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    prom["rule_files"] = [str(mounted("prometheus", f)) for f in prom["rule_files"]]
    for job in prom["scrape_configs"]:
        job.pop("scrape_protocols", None)  # Prometheus >= 2.49; Debian's promtool is 2.42
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump(prom))
    result = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# ---- usage ledger: spool -> collector -> ClickHouse ------------------------------------------------

VLLM_SERVICES = ("vllm", "vllm-cpu")
CLICKHOUSE_NATIVE_PORT = 9000  # clickhouse-server's default tcp_port (the exporter's tcp:// endpoint)
CLICKHOUSE_HTTP_PORT = 8123  # its HTTP interface (otel-llm report --ledger clickhouse://...)


def test_clickhouse_service_pinned():
    image = SERVICES["clickhouse"]["image"]
    repo, _, tag = image.rpartition(":")
    assert repo == "clickhouse/clickhouse-server"
    assert re.fullmatch(r"\d+\.\d+(\.\d+)*", tag), f"{image}: pin a version, not a moving tag"
    assert f"127.0.0.1:{CLICKHOUSE_HTTP_PORT}:{CLICKHOUSE_HTTP_PORT}" in SERVICES["clickhouse"]["ports"]


def test_usage_spool_shared_by_vllm_and_collector():
    env = SERVICES["otel-collector"]["environment"]
    (pattern,) = collector_config()["receivers"]["filelog/usage"]["include"]
    spool_dir = posixpath.dirname(expand_otelcol(pattern, env))
    volume, read_only = named_mounts("otel-collector")[spool_dir]
    assert read_only, "the collector only reads the spool"
    for name in VLLM_SERVICES:
        svc_env = SERVICES[name]["environment"]
        assert svc_env["OTEL_LLM_USAGE_DIR"] == spool_dir, name
        assert named_mounts(name).get(spool_dir) == (volume, False), f"{name}: spool volume not mounted at {spool_dir}"


def test_collector_file_storage_on_a_volume():
    env = SERVICES["otel-collector"]["environment"]
    directory = expand_otelcol(collector_config()["extensions"]["file_storage/usage"]["directory"], env)
    volume, read_only = named_mounts("otel-collector")[directory]
    assert not read_only and volume in COMPOSE["volumes"]


def test_collector_emits_spool_records_synchronously():
    """Without this gate the filelog receiver batches records in memory after moving its offsets."""
    gates = [a.split("=", 1)[1] for a in command_args(SERVICES["otel-collector"]) if a.startswith("--feature-gates=")]
    assert "stanza.synchronousLogEmitter" in ",".join(gates).split(",")


def test_collector_clickhouse_endpoint_is_the_compose_service():
    env = SERVICES["otel-collector"]["environment"]
    endpoint = expand_otelcol(collector_config()["exporters"]["clickhouse/usage"]["endpoint"], env)
    assert endpoint == env["CLICKHOUSE_ENDPOINT"]
    assert host_port(endpoint) == ("clickhouse", CLICKHOUSE_NATIVE_PORT) and "clickhouse" in SERVICES
    assert SERVICES["otel-collector"]["depends_on"]["clickhouse"]["condition"] == "service_healthy"


# ---- content and retention ---------------------------------------------------------------------------


def collector_gates() -> set[str]:
    gates = [a.split("=", 1)[1] for a in command_args(SERVICES["otel-collector"]) if a.startswith("--feature-gates=")]
    return set(",".join(gates).split(","))


def test_collector_records_the_sampling_policy():
    """transform/content_by_policy keeps content only where tail_sampling recorded a policy: without
    the gate no trace would keep any."""
    assert "transform/content_by_policy" in collector_config()["processors"]
    assert RECORD_POLICY_GATE in collector_gates()


DAY = 86400
PROMETHEUS_UNITS = {"ms": 1e-3, "s": 1, "m": 60, "h": 3600, "d": DAY, "w": 7 * DAY, "y": 365 * DAY}


def prometheus_duration(text: str) -> float:
    parts = re.findall(r"(\d+)(ms|s|m|h|d|w|y)", text)
    assert parts and "".join(n + u for n, u in parts) == text, text
    return sum(int(n) * PROMETHEUS_UNITS[u] for n, u in parts)


def readme_retention() -> dict[str, float]:
    """'Tempo' / 'Prometheus' / 'ClickHouse' -> seconds, from the table in collector-config/README.md."""
    text = (ROOT / "collector-config" / "README.md").read_text()
    section = text[text.index("## Retention per signal") :]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (m := re.fullmatch(r"(\d+) days", cells[3])):
            store = next(s for s in ("Tempo", "Prometheus", "ClickHouse") if cells[1].startswith(s))
            rows[store] = int(m[1]) * DAY
    assert set(rows) == {"Tempo", "Prometheus", "ClickHouse"}, rows
    return rows


def test_tempo_retention_is_the_readmes():
    tempo = yaml.safe_load(mounted("tempo", flag(command_args(SERVICES["tempo"]), "-config.file")).read_text())
    want = readme_retention()["Tempo"]
    assert duration_seconds(tempo["backend_worker"]["compaction"]["block_retention"]) == want  # the worker applies it
    scheduler = tempo["backend_scheduler"]["provider"]["compaction"]["compaction"]
    assert duration_seconds(scheduler["block_retention"]) == want
    blocks = tempo["storage"]["trace"]["local"]["path"]
    volume, read_only = next(
        (v for path, v in named_mounts("tempo").items() if blocks.startswith(path.rstrip("/") + "/"))
    )
    assert not read_only and volume in COMPOSE["volumes"]


def test_prometheus_retention_is_the_readmes():
    args = command_args(SERVICES["prometheus"])
    assert prometheus_duration(flag(args, "--storage.tsdb.retention.time")) == readme_retention()["Prometheus"]
    volume, read_only = named_mounts("prometheus")[flag(args, "--storage.tsdb.path")]
    assert not read_only and volume in COMPOSE["volumes"]


def test_ledger_retention_is_the_readmes():
    """The clickhouse exporter's ttl becomes the table's TTL (whole days: toIntervalDay)."""
    want = readme_retention()["ClickHouse"]
    for cfg in (collector_config(), yaml.safe_load((ROOT / "collector-config" / "agent.yaml").read_text())):
        ttl = duration_seconds(cfg["exporters"]["clickhouse/usage"]["ttl"])
        assert ttl == want and ttl % DAY == 0
    volume, read_only = named_mounts("clickhouse")["/var/lib/clickhouse"]
    assert not read_only and volume in COMPOSE["volumes"]
    # content is kept the shortest, the ledger the longest
    assert readme_retention()["Tempo"] < readme_retention()["Prometheus"] < want
