"""Engine-core cost of otel-llm's per-request cost accounting (otel_llm/vllm/engine_cost.py), bare
vs instrumented, side by side in one run.

Two drivers each start vLLM's engine core on the tiny CPU model through vLLM's own engine-core
client (no API server): one bare, one under `opentelemetry-instrument` with the usage spool on (so
every step runs the accounting hooks and finished requests are written). Both are fed the same
workloads in turn (batch sizes 1, 16 and 64: that many requests added at once, each generating
STEPS tokens), several rounds, alternating which goes first. Per run we read:

- the engine-core process's CPU time (all its threads, /proc/PID/task/*/schedstat): the host work on the GPU's
  critical path (vLLM's CPU backend runs the model in a separate worker process, so this is
  scheduling, IPC and our hooks, not the matmuls);
- the wall time per step (the steps' own duration, what a GPU user waits for between batches).

Printed: medians per batch size, bare vs instrumented, the difference per step and per scheduled
request (a figure a GPU user can multiply out), and the difference as a share of the bare step time.

    .venv/bin/python benchmarks/engine_cost.py [--rounds 5] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCHES = (1, 16, 64)


def _cpu_seconds(pid: int) -> float:
    """CPU time of all the process's threads, in ns resolution (/proc/PID/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError):
            continue  # a thread gone meanwhile
    return total / 1e9


def _engine_pid(parent: int) -> int:
    """The EngineCore child process of the driver (vLLM titles it EngineCore)."""
    for _ in range(600):
        out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
        for pid in out:
            try:
                if "EngineCore" in Path(f"/proc/{pid}/comm").read_text() or \
                        b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
            except OSError:
                continue
        time.sleep(0.1)
    raise RuntimeError("no EngineCore process")


def driver(model_dir: str) -> None:
    """Reads `BATCH STEPS` lines; for each, runs BATCH requests of STEPS tokens and prints the wall time."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.executor import Executor

    config = EngineArgs(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512,
                        max_num_seqs=128).create_engine_config()
    client = EngineCoreClient.make_client(multiprocess_mode=True, asyncio_mode=False, vllm_config=config,
                                          executor_class=Executor.get_class(config), log_stats=False)
    print(json.dumps({"ready": True}), flush=True)
    run = 0
    for line in sys.stdin:
        batch, steps = map(int, line.split())
        run += 1
        started = time.perf_counter()
        pending = set()
        for i in range(batch):
            rid = f"r{run}-{i}"
            pending.add(rid)
            client.add_request(EngineCoreRequest(
                request_id=rid, prompt_token_ids=[5 + (i + j) % 90 for j in range(16)], mm_features=None,
                sampling_params=SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0),
                pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
                data_parallel_rank=None))
        while pending:
            for output in client.get_output().outputs:
                if output.finish_reason is not None:
                    pending.discard(output.request_id)
        print(json.dumps({"wall": time.perf_counter() - started}), flush=True)
    client.shutdown()


class Driver:
    def __init__(self, name: str, instrumented: bool, model_dir: str, spool: str):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
               "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
               "OTEL_SERVICE_NAME": "bench", "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
        command = [sys.executable, __file__, "--driver", model_dir]
        if instrumented:
            env["OTEL_LLM_USAGE_DIR"] = spool
            command = [str(Path(sys.executable).with_name("opentelemetry-instrument")), *command]
        self.name = name
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        self._read()
        self.engine = _engine_pid(self.process.pid)

    def _read(self) -> dict:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} driver exited")
            if line.startswith("{"):
                return json.loads(line)

    def run(self, batch: int, steps: int) -> tuple[float, float]:
        """(engine-core CPU seconds, wall seconds) of one workload."""
        before = _cpu_seconds(self.engine)
        self.process.stdin.write(f"{batch} {steps}\n")
        self.process.stdin.flush()
        wall = self._read()["wall"]
        return _cpu_seconds(self.engine) - before, wall

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64, help="tokens generated per request (about one step each)")
    args = parser.parse_args()
    if args.driver:
        return driver(args.driver)
    from devkit.devserver import DEFAULT_MODEL_DIR
    from devkit.tiny_model import build

    model_dir = str(build(DEFAULT_MODEL_DIR))
    with tempfile.TemporaryDirectory() as spool:
        drivers = {"bare": Driver("bare", False, model_dir, spool),
                   "instrumented": Driver("instrumented", True, model_dir, spool)}
        try:
            for d in drivers.values():  # warm-up
                d.run(4, 8)
            cpu = {(n, b): [] for n in drivers for b in BATCHES}
            wall = {(n, b): [] for n in drivers for b in BATCHES}
            for r in range(args.rounds):
                order = list(drivers.values()) if r % 2 == 0 else list(reversed(drivers.values()))
                for batch in BATCHES:
                    for d in order:
                        c, w = d.run(batch, args.steps)
                        cpu[(d.name, batch)].append(c / args.steps)
                        wall[(d.name, batch)].append(w / args.steps)
            records = sum(1 for f in Path(spool).glob("usage-*.jsonl") for _ in f.open())
        finally:
            for d in drivers.values():
                d.close()
    print(f"engine-core cost of per-request cost accounting: tiny model on CPU, {args.steps} steps per run, "
          f"median of {args.rounds} rounds; {records} engine records written\n")
    print(f"{'batch':>5} | {'bare CPU/step':>13} | {'instr. CPU/step':>15} | {'+ per step':>10} | "
          f"{'+ per sched. req':>16} | {'bare step wall':>14} | {'instr. step wall':>16} | {'+ of bare step':>14}")
    for batch in BATCHES:
        bare_cpu, instr_cpu = (statistics.median(cpu[(n, batch)]) for n in ("bare", "instrumented"))
        bare_wall, instr_wall = (statistics.median(wall[(n, batch)]) for n in ("bare", "instrumented"))
        extra = instr_cpu - bare_cpu
        print(f"{batch:>5} | {bare_cpu * 1e6:>10.0f} us | {instr_cpu * 1e6:>12.0f} us | {extra * 1e6:>7.1f} us | "
              f"{extra / batch * 1e6:>13.2f} us | {bare_wall * 1e3:>11.2f} ms | {instr_wall * 1e3:>13.2f} ms | "
              f"{extra / bare_wall * 100:>13.2f}%")


if __name__ == "__main__":
    main()
