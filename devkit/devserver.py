"""Start and stop a real `vllm serve` on CPU with the tiny model (demo, tests, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from devkit import tiny_model

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = Path(os.environ.get("OTEL_LLM_TINY_MODEL", REPO_ROOT / ".cache" / "tiny-llama"))
# The KV cache vLLM allocates (and zero-fills) at start: its first touch of each page is most of an engine's
# start on a small VM (12 s for vLLM CPU's usual 1 GiB here). 128 MiB holds 65,536 of the tiny model's
# tokens, 128 requests of max-model-len. The paced network's tokens take 16 times as much: its servers keep
# 1 GiB (32,768 tokens; a module of them asks for max-model-len 4096). vLLM's VLLM_CPU_KVCACHE_SPACE (whole
# GiB) would override either.
KV_CACHE_BYTES = 128 << 20
PACED_KV_CACHE_BYTES = 1 << 30
CPU_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--gpu-memory-utilization", "0.3"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bin_path(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


class ServerProcess:
    """A server subprocess in its own session: started, polled until ready, stopped with its children."""

    name = "server"
    stop_signal = signal.SIGTERM
    command: list[str]
    env: dict[str, str]
    log_path: Path | None
    url: str
    process: subprocess.Popen | None = None

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 60.0):
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log: {self.log_path}")
            try:
                if self.ready():
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout}s; log: {self.log_path}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, self.stop_signal)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class VLLMServer(ServerProcess):
    """`[opentelemetry-instrument] vllm serve MODEL ...` as a subprocess on a free port."""

    def __init__(
        self,
        *,
        instrumented: bool = True,
        extra_args=(),
        env=None,
        model_dir: Path | None = None,
        log_path: Path | None = None,
        served_model_name: str = tiny_model.MODEL_NAME,
        paced: bool = False,
        scorer: bool = False,
    ):
        """paced: the tiny tokenizer on tiny_model.PACED_NETWORK with made-up weights, for tests in
        which the server must see a client leave while the engine still generates."""
        self.port = free_port()
        if paced:
            paced_dir = Path(model_dir) if model_dir else DEFAULT_MODEL_DIR.with_name(DEFAULT_MODEL_DIR.name + "-paced")
            self.model_dir = tiny_model.build_paced(paced_dir, DEFAULT_MODEL_DIR)
            extra_args = (*tiny_model.PACED_SERVE_ARGS, *extra_args)
        elif scorer:  # the tiny model as a cross-encoder (/classify, /score, /rerank)
            scorer_dir = (
                Path(model_dir) if model_dir else DEFAULT_MODEL_DIR.with_name(DEFAULT_MODEL_DIR.name + "-scorer")
            )
            self.model_dir = tiny_model.build_scorer(scorer_dir, DEFAULT_MODEL_DIR)
            extra_args = ("--runner", "pooling", *extra_args)
        else:
            self.model_dir = tiny_model.build(model_dir or DEFAULT_MODEL_DIR)
        self.served_model_name = served_model_name
        command = [
            bin_path("vllm"),
            "serve",
            str(self.model_dir),
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--served-model-name",
            served_model_name,
            *CPU_ARGS,
            "--kv-cache-memory-bytes",
            str(PACED_KV_CACHE_BYTES if paced else KV_CACHE_BYTES),
            *extra_args,
        ]
        if instrumented:
            command = [bin_path("opentelemetry-instrument"), *command]
        self.command = command
        self.env = {
            **{key: value for key, value in os.environ.items() if key != "VLLM_CPU_KVCACHE_SPACE"},
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **(env or {}),
        }
        self.log_path = log_path
        self.url = f"http://127.0.0.1:{self.port}"

    name = "vllm serve"
    stop_signal = signal.SIGINT

    def ready(self) -> bool:
        with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
            return r.status == 200

    def start(self, timeout: float = 240.0) -> "VLLMServer":
        return super().start(timeout)

    def pids(self) -> list[int]:
        """The server's processes: the main one and its descendants."""
        assert self.process is not None
        out = subprocess.run(["pgrep", "-g", str(self.process.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]


def otlp_env(
    endpoint: str, service_name: str | None = None, metric_interval_ms: int = 1000, protocol: str = "http/protobuf"
) -> dict[str, str]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_METRICS_EXPORTER": "otlp",
        "OTEL_LOGS_EXPORTER": "none",
        "OTEL_METRIC_EXPORT_INTERVAL": str(metric_interval_ms),
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    if service_name:
        env["OTEL_SERVICE_NAME"] = service_name
    return env


GATEWAY_DIR = REPO_ROOT / "examples" / "gateway"
APP_PATH = REPO_ROOT / "examples" / "app" / "app.py"


class GatewayServer(ServerProcess):
    """The example gateway (examples/gateway) under `opentelemetry-instrument uvicorn`."""

    name = "gateway"

    def __init__(
        self,
        upstream_url: str,
        keys_file: Path,
        env=None,
        log_path: Path | None = None,
        upstream_api_key: str | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = {
            **os.environ,
            "GATEWAY_UPSTREAM_URL": upstream_url,
            "GATEWAY_KEYS_FILE": str(keys_file),
            **({"GATEWAY_UPSTREAM_API_KEY": upstream_api_key} if upstream_api_key else {}),
            **(env or {}),
        }
        self.command = [
            bin_path("opentelemetry-instrument"),
            bin_path("uvicorn"),
            "gateway:app",
            "--app-dir",
            str(GATEWAY_DIR),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]

    def ready(self) -> bool:
        socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        return True


class BudgetServer(ServerProcess):
    """`otel-llm budget-server` over a spool directory (otel_llm/ops/budget_server.py)."""

    name = "budget-server"

    def __init__(
        self, budgets_file: Path, ledger: str, log_path: Path | None = None, interval: float = 0.2, extra_args=()
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.env = dict(os.environ)
        self.command = [
            bin_path("otel-llm"),
            "budget-server",
            "--budgets",
            str(budgets_file),
            "--ledger",
            ledger,
            "--listen",
            f"127.0.0.1:{self.port}",
            "--interval",
            str(interval),
            *extra_args,
        ]

    def ready(self) -> bool:
        with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
            return r.status == 200

    def state(self) -> dict:
        import json

        with urllib.request.urlopen(self.url + "/v1/budgets", timeout=10) as r:
            return json.loads(r.read())


def write_keys_file(path: Path, keys: dict[str, tuple[str, str | None]]) -> Path:
    """keys: API key -> (tenant, scene). Only SHA-256 hashes are written."""
    import hashlib
    import json

    entries = [
        {"sha256": hashlib.sha256(key.encode()).hexdigest(), "tenant": tenant, **({"scene": scene} if scene else {})}
        for key, (tenant, scene) in keys.items()
    ]
    path.write_text(json.dumps({"keys": entries}))
    return path


def run_app(
    call: str, base_url: str, api_key: str, env=None, model: str | None = None, timeout: float = 120.0
) -> list[dict]:
    """examples/app/app.py CALL under `opentelemetry-instrument`; its JSON lines."""
    import json

    full_env = {
        **os.environ,
        "APP_BASE_URL": base_url,
        "APP_API_KEY": api_key,
        **({"APP_MODEL": model} if model else {}),
        **(env or {}),
    }
    result = subprocess.run(
        [bin_path("opentelemetry-instrument"), sys.executable, str(APP_PATH), call],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise RuntimeError(f"app.py {call} exited with {result.returncode}:\n{result.stderr}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


class PrometheusServer(ServerProcess):
    """A real Prometheus (Debian package `prometheus`) scraping the given targets every second."""

    name = "prometheus"

    def __init__(self, targets: list[str], workdir: Path, scrape_interval: str = "1s", rule_files: list[Path] = ()):
        import shutil

        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError("prometheus is not installed (Debian package `prometheus`; `make prometheus`)")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval}\n"
            f"  evaluation_interval: {scrape_interval}\n"
            + (f"rule_files: [{', '.join(repr(str(f)) for f in rule_files)}]\n" if rule_files else "")
            + "scrape_configs:\n"
            "  - job_name: vllm\n"
            f"    static_configs: [{{targets: [{', '.join(repr(t) for t in targets)}]}}]\n"
        )
        self.command = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--log.level=warn",
        ]
        self.env = dict(os.environ)
        self.log_path = workdir / "prometheus.log"

    def ready(self) -> bool:
        with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
            return r.status == 200

    def query(self, expr: str) -> list[dict]:
        """An instant query now (the same client `otel-llm report` uses)."""
        from otel_llm.billing.report import Prometheus

        return Prometheus(self.url, timeout=10).query(expr, time.time())
