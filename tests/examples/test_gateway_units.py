"""The example gateway's pure parts: SSE usage scanning and API key checks (no server)."""

import hashlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

GATEWAY_PY = Path(__file__).resolve().parents[2] / "examples" / "gateway" / "gateway.py"


@pytest.fixture(scope="module")
def gateway():
    spec = importlib.util.spec_from_file_location("example_gateway", GATEWAY_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sse(*events):
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


USAGE = {"prompt_tokens": 11, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}
STREAM = sse(
    {"id": "c1", "model": "m", "choices": [{"delta": {"content": 'say "usage"'}}]},
    {"id": "c1", "model": "m", "choices": [{"delta": {}}], "usage": None},
    {"id": "c1", "model": "m", "choices": [], "usage": USAGE},
    b"[DONE]",
)


@pytest.mark.parametrize("size", [1, 2, 7, 64, len(STREAM)])
def test_usage_found_whatever_the_chunking(gateway, size):
    scanner = gateway.UsageScanner()
    for i in range(0, len(STREAM), size):
        scanner.feed(STREAM[i : i + size])
    assert scanner.usage == USAGE and scanner.model == "m"
    assert len(scanner.tail) < len(STREAM)  # only the unfinished line is kept


def test_no_usage_event_leaves_nothing(gateway):
    scanner = gateway.UsageScanner()
    scanner.feed(sse({"id": "c1", "choices": [{"delta": {"content": "x"}}]}, {"usage": None}, b"[DONE]"))
    assert scanner.usage is None


def test_authenticate(gateway):
    keys = [(hashlib.sha256(b"sk-a").digest(), "acme", "support"), (hashlib.sha256(b"sk-b").digest(), "globex", None)]
    assert gateway.authenticate(keys, "Bearer sk-a") == ("acme", "support")
    assert gateway.authenticate(keys, "bearer sk-b") == ("globex", None)
    for header in (None, "", "Bearer", "Bearer ", "sk-a", "Basic sk-a", "Bearer sk-c"):
        assert gateway.authenticate(keys, header) is None


def test_hash_key_helper_and_example_keys_file():
    out = subprocess.run(
        [sys.executable, str(GATEWAY_PY), "hash-key", "sk-demo-acme"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == hashlib.sha256(b"sk-demo-acme").hexdigest()
    example = json.loads((GATEWAY_PY.parent / "keys.example.json").read_text())
    assert {e["sha256"]: e["tenant"] for e in example["keys"]}[out] == "acme"
