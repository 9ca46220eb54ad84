"""LLMEngineStalled in a real Prometheus: a real vLLM CPU server scraped every second, the generated
rules (stall window STALL_SECONDS, evaluated every second, `for` FOR) and streams running on the paced server when
the engine core process is stopped (SIGSTOP). The idle server raises nothing; the stopped engine
raises the alert, pending then firing, not before the stall window has passed; after SIGCONT the
streams finish and the alert resolves."""

import json
import os
import re
import signal
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import openai
import pytest
import yaml
from helpers import start_prometheus, start_server

from devkit.tiny_model import MODEL_NAME
from otel_llm import semconv
from otel_llm.ops import rules

STALL = "LLMEngineStalled"
STALL_SECONDS = 20
FOR_SECONDS = 10
STREAMS = 4
# on the paced server (a step ~10x the tiny model's) a stream of this many tokens runs for about 20 s, so
# the engine is stopped mid-stream however fast the machine: unpaced, 400 tokens could all be computed
# between the streams' first chunks and the stop (seen once: nothing was running, no alert)
MAX_TOKENS = 1000
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def vllm(receiver, tmp_path_factory):
    srv = start_server(
        receiver, tmp_path_factory, "alerts", extra_args=["--max-model-len", str(MAX_MODEL_LEN)], paced=True
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory):
    """The generated rules with a 20 s stall window, every group evaluated every second and the stall
    alert's `for` at 10 s."""
    data = yaml.safe_load(rules.render(rules.Params(stall_seconds=STALL_SECONDS)))
    for group in data["groups"]:
        group["interval"] = "1s"
    [stall] = [r for g in data["groups"] for r in g["rules"] if r.get("alert") == STALL]
    stall["for"] = f"{FOR_SECONDS}s"
    path = tmp_path_factory.mktemp("rules") / "rules.yml"
    path.write_text(yaml.safe_dump(data, sort_keys=False, width=1000))
    return path


@pytest.fixture(scope="module")
def prometheus(vllm, rules_file, tmp_path_factory):
    prom = start_prometheus(vllm, tmp_path_factory, rule_files=[rules_file])
    yield prom
    prom.stop()


def api(prometheus, path: str) -> dict:
    with urllib.request.urlopen(prometheus.url + path, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def stall_alerts(prometheus) -> list[dict]:
    return [a for a in api(prometheus, "/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == STALL]


def stall_rule(prometheus) -> dict:
    [rule] = [
        r for g in api(prometheus, "/api/v1/rules?type=alert")["groups"] for r in g["rules"] if r["name"] == STALL
    ]
    return rule


def unix_time(rfc3339: str) -> float:
    """Prometheus's timestamps carry nanoseconds; datetime reads microseconds."""
    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", rfc3339).replace("Z", "+00:00")).timestamp()


def engine_core(vllm) -> int:
    """The pid of the server's engine core process (its title is vLLM's "EngineCore")."""
    found = []
    for pid in vllm.pids():
        try:
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            continue
    [pid] = found
    return pid


def wait_for(what, condition, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


class Stream(threading.Thread):
    """One streamed completion of MAX_TOKENS tokens; `started` is set at its first token."""

    def __init__(self, vllm, i: int):
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=vllm.url + "/v1", api_key="sk-alerts", max_retries=0, timeout=600)
        self.prompt = f"stream {i}: once upon a time"
        self.started = threading.Event()
        self.tokens, self.finish_reason, self.error = 0, None, None

    def run(self):
        try:
            for chunk in self.client.completions.create(
                model=MODEL_NAME,
                prompt=self.prompt,
                max_tokens=MAX_TOKENS,
                stream=True,
                temperature=0,
                extra_body={"ignore_eos": True},
                stream_options={"include_usage": True},
                extra_headers={"x-tenant-id": "alerts"},
            ):
                if chunk.choices:
                    self.started.set()
                    self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
                if chunk.usage:
                    self.tokens = chunk.usage.completion_tokens
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.started.set()


def test_a_stopped_engine_raises_the_stall_alert(vllm, prometheus):
    # the idle server, past a whole stall window after a request: evaluated, nothing raised
    openai.OpenAI(base_url=vllm.url + "/v1", api_key="sk-alerts", max_retries=0).completions.create(
        model=MODEL_NAME, prompt="warm up", max_tokens=8
    )
    wait_for(
        "Prometheus sees the request's tokens and no request running",
        lambda: prometheus.query(
            f"{semconv.VLLM_METRIC_GENERATION_TOKENS_TOTAL} > 0 and on (instance) {semconv.VLLM_METRIC_RUNNING} == 0"
        ),
        60,
    )
    idle_since = time.time()
    wait_for(
        "a stall window of evaluations on the idle server",
        lambda: unix_time(stall_rule(prometheus)["lastEvaluation"]) > idle_since + STALL_SECONDS + 2,
        120,
    )
    rule = stall_rule(prometheus)
    assert (rule["health"], rule["state"], rule["alerts"]) == ("ok", "inactive", [])

    streams = [Stream(vllm, i) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120) and s.error is None, s.error
    pid = engine_core(vllm)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    try:
        assert not any(s.finish_reason for s in streams)  # all still generating when the engine stopped
        seen = []

        def firing():
            alerts = stall_alerts(prometheus)
            seen.extend(a["state"] for a in alerts if not seen or seen[-1] != a["state"])
            return [a for a in alerts if a["state"] == "firing"]

        [alert] = wait_for("LLMEngineStalled firing", firing, 120)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert seen == ["pending", "firing"]
    # tokens were generated up to the stop: not active before a whole stall window without any
    # (less a scrape and an evaluation interval)
    assert unix_time(alert["activeAt"]) >= stopped_at + STALL_SECONDS - 2
    assert alert["labels"] == {
        "alertname": STALL,
        "severity": "critical",
        "instance": f"127.0.0.1:{vllm.port}",
        "job": "vllm",
        semconv.VLLM_LABEL_MODEL: MODEL_NAME,
        "engine": "0",
    }
    assert alert["annotations"]["summary"] == (
        f"{STREAMS} requests are running in vLLM 127.0.0.1:{vllm.port} (model {MODEL_NAME}), which computed no "
        f"token in {STALL_SECONDS}s"
    )

    # resumed: every stream finishes with all its tokens, and the alert resolves
    for s in streams:
        s.join(300)
        assert (s.is_alive(), s.error, s.finish_reason, s.tokens) == (False, None, "length", MAX_TOKENS)
    wait_for("LLMEngineStalled resolved", lambda: not stall_alerts(prometheus), 120)
