"""Engine-core cost of otel-llm's per-request cost accounting (otel_llm/vllm/engine_cost.py), bare
vs instrumented, side by side in one run.

Two drivers each start vLLM's engine core on the tiny CPU model through vLLM's own engine-core
client (no API server): one bare, one under `opentelemetry-instrument` with the usage spool on (so
every step runs the accounting hooks and finished requests are written). Both are fed the same
workloads in turn (batch sizes 1, 16 and 64: that many requests added at once, each generating
STEPS tokens), several rounds, alternating which goes first. Per run we read:

- the engine-core process's CPU time (all its threads, /proc/PID/task/*/schedstat): the host work on
  the GPU's critical path (vLLM's CPU backend runs the model in a separate worker process, so this is
  scheduling, IPC and our hooks, not the matmuls);
- the wall time per step (the steps' own duration, what a GPU user waits for between batches).

Each run has the machine to itself (the other driver's processes are stopped, SIGSTOP), but a VM's
neighbours still move the end-to-end figures by a few % between runs. The hooks' own work is measured precisely in process, on vLLM's real
Scheduler (the tiny model's config, a KV pool of 20,000 blocks, prefix caching off) driven the way
the engine core drives it: `schedule()`, then `update_from_output()` with one sampled token per
request, batches of 1, 16 and 64 running requests of 16 prompt and 128 output tokens, finished ones
replaced, bare (the class unpatched) and with otel-llm's hooks and a cost book writing to a spool,
back to back per batch size and round (the difference is taken per pair).

Printed: per batch size, the hooks' work per step and per scheduled request (a figure a GPU user can
multiply out), as a share of the bare engine's step wall time; then the end-to-end comparison.

    .venv/bin/python benchmarks/engine_cost.py [--rounds 5] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BATCHES = (1, 16, 64)
TOKENS = 128  # generated per request in the in-process runs: a finished request is replaced every TOKENS / batch steps


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
                if (
                    "EngineCore" in Path(f"/proc/{pid}/comm").read_text()
                    or b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes()
                ):
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

    config = EngineArgs(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=128
    ).create_engine_config()
    client = EngineCoreClient.make_client(
        multiprocess_mode=True,
        asyncio_mode=False,
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
    )
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
            client.add_request(
                EngineCoreRequest(
                    request_id=rid,
                    prompt_token_ids=[5 + (i + j) % 90 for j in range(16)],
                    mm_features=None,
                    sampling_params=SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0),
                    pooling_params=None,
                    arrival_time=time.time(),
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=None,
                )
            )
        while pending:
            for output in client.get_output().outputs:
                if output.finish_reason is not None:
                    pending.discard(output.request_id)
        print(json.dumps({"wall": time.perf_counter() - started}), flush=True)
    client.shutdown()


class Driver:
    def __init__(self, name: str, instrumented: bool, model_dir: str, spool: str):
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_LOGS_EXPORTER": "none",
            "OTEL_SERVICE_NAME": "bench",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "PYTHONPATH": str(ROOT),
        }
        command = [sys.executable, __file__, "--driver", model_dir]
        if instrumented:
            env["OTEL_LLM_USAGE_DIR"] = spool
            command = [str(Path(sys.executable).with_name("opentelemetry-instrument")), *command]
        self.name = name
        self.process = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._read()
        self.engine = _engine_pid(self.process.pid)

    def _read(self) -> dict:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name} driver exited")
            if line.startswith("{"):
                return json.loads(line)

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT the driver, its engine core and its worker: an idle vLLM's processes still
        poll, and two engines share 2 cores."""
        os.killpg(self.process.pid, signal.SIGSTOP if paused else signal.SIGCONT)

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


def micro(rounds: int, steps: int = 400) -> dict[int, tuple[float, float, float]]:
    """{batch: (bare, instrumented, their paired difference)}: medians in us per step, on vLLM's real
    Scheduler."""
    import torch
    import wrapt
    from opentelemetry.instrumentation.utils import unwrap
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from devkit.devserver import DEFAULT_MODEL_DIR
    from otel_llm.usage import EngineSpool
    from otel_llm.vllm import engine_cost

    config = EngineArgs(
        model=str(DEFAULT_MODEL_DIR),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        enable_prefix_caching=False,
        max_num_seqs=256,
    ).create_engine_config()
    config.cache_config.num_gpu_blocks = 20000
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=20000,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"], spec)],
    )
    hooks = {
        "schedule": engine_cost.scheduled,
        "update_from_output": engine_cost.updated,
        "_preempt_request": engine_cost.preempted,
        "_free_request_blocks": engine_cost.freeing,
        "_free_request": engine_cost.finished,
    }
    serial = iter(range(10**9))

    def run(batch: int, instrumented: bool, spool: str) -> float:
        scheduler = Scheduler(config, kv, StructuredOutputManager(config), block_size=16)
        if instrumented:
            book = engine_cost.CostBook(
                scheduler,
                EngineSpool(spool),
                instance="bench",
                service="bench",
                engine_instance="bench/engine0",
                window_ns=60 * 10**9,
            )
            setattr(scheduler, engine_cost.BOOK, book)

        def top_up():
            while len(scheduler.requests) < batch:
                scheduler.add_request(
                    Request(
                        f"q{next(serial)}",
                        [5 + i for i in range(16)],
                        SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                        None,
                        arrival_time=time.time(),
                    )
                )

        def step():
            top_up()
            so = scheduler.schedule()
            ids = list(so.num_scheduled_tokens)
            scheduler.update_from_output(
                so,
                ModelRunnerOutput(
                    req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[7]] * len(ids)
                ),
            )

        for _ in range(64):  # warm up to a steady mix of prefills, decodes and finishes
            step()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - started) / steps * 1e6

    result = {}
    with tempfile.TemporaryDirectory() as spool:
        times = {(b, i): [] for b in BATCHES for i in (False, True)}
        for r in range(rounds):
            for batch in BATCHES:  # bare and instrumented back to back: a paired difference per round
                for instrumented in (False, True) if r % 2 == 0 else (True, False):
                    if instrumented:
                        for name, factory in hooks.items():
                            wrapt.wrap_function_wrapper(Scheduler, name, factory(None))
                    try:
                        times[(batch, instrumented)].append(run(batch, instrumented, spool))
                    finally:
                        if instrumented:
                            for name in hooks:
                                unwrap(Scheduler, name)
        for batch in BATCHES:
            bare, instr = times[(batch, False)], times[(batch, True)]
            result[batch] = (
                statistics.median(bare),
                statistics.median(instr),
                statistics.median(i - b for b, i in zip(bare, instr)),
            )
    return result


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
        drivers = {
            "bare": Driver("bare", False, model_dir, spool),
            "instrumented": Driver("instrumented", True, model_dir, spool),
        }
        try:
            for d in drivers.values():  # warm-up
                d.run(4, 8)
            cpu = {(n, b): [] for n in drivers for b in BATCHES}
            wall = {(n, b): [] for n in drivers for b in BATCHES}
            for r in range(args.rounds):
                order = list(drivers.values()) if r % 2 == 0 else list(reversed(drivers.values()))
                for batch in BATCHES:
                    for d in order:
                        for other in drivers.values():
                            other.pause(other is not d)
                        time.sleep(0.2)
                        c, w = d.run(batch, args.steps)
                        cpu[(d.name, batch)].append(c / args.steps)
                        wall[(d.name, batch)].append(w / args.steps)
            records = sum(1 for f in Path(spool).glob("usage-*.jsonl") for _ in f.open())
        finally:
            for d in drivers.values():
                d.pause(False)
                d.close()
    hooks = micro(args.rounds)
    bare_step = {b: statistics.median(wall[("bare", b)]) for b in BATCHES}
    print(
        f"the hooks' own work on vLLM's real Scheduler (schedule + update_from_output), medians of {args.rounds}"
        f" rounds of 400 steps (+: the median of paired differences), vs the bare engine's step wall time (tiny "
        f"model on CPU):\n"
    )
    print(
        f"{'batch':>5} | {'bare sched.':>11} | {'with hooks':>10} | {'+ per step':>10} | {'+ per sched. req':>16} | "
        f"{'bare engine step':>16} | {'+ of bare step':>14}"
    )
    for batch in BATCHES:
        bare, instr, extra = hooks[batch]
        print(
            f"{batch:>5} | {bare:>8.1f} us | {instr:>7.1f} us | {extra:>7.1f} us | "
            f"{extra / batch:>13.2f} us | {bare_step[batch] * 1e3:>13.2f} ms | "
            f"{extra / (bare_step[batch] * 1e6) * 100:>13.2f}%"
        )
    print(
        f"\nend to end: engine-core process CPU and step wall time, bare vs instrumented, {args.steps} steps per "
        f"run, median of {args.rounds} rounds ({records} engine records written; coarse: a few % between runs)\n"
    )
    print(
        f"{'batch':>5} | {'bare CPU/step':>13} | {'instr. CPU/step':>15} | {'+ per step':>10} | "
        f"{'+ per sched. req':>16} | {'bare step wall':>14} | {'instr. step wall':>16} | {'+ of bare step':>14}"
    )
    for batch in BATCHES:
        bare_cpu, instr_cpu = (statistics.median(cpu[(n, batch)]) for n in ("bare", "instrumented"))
        bare_wall, instr_wall = (statistics.median(wall[(n, batch)]) for n in ("bare", "instrumented"))
        extra = instr_cpu - bare_cpu
        print(
            f"{batch:>5} | {bare_cpu * 1e6:>10.0f} us | {instr_cpu * 1e6:>12.0f} us | {extra * 1e6:>7.1f} us | "
            f"{extra / batch * 1e6:>13.2f} us | {bare_wall * 1e3:>11.2f} ms | {instr_wall * 1e3:>13.2f} ms | "
            f"{extra / bare_wall * 100:>13.2f}%"
        )


if __name__ == "__main__":
    main()
