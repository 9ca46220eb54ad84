"""A client of vLLM's engine core that is not vLLM's OpenAI server: it builds EngineCoreRequests
itself and drives the engine-core process through vLLM's SyncMPClient, as a Rust or gRPC frontend
would. Run under `opentelemetry-instrument` (so the engine-core process it forks is instrumented);
prints one JSON line per request: its id, the tokens the engine returned, its finish reason.

usage: engine_client.py MODEL_DIR N_REQUESTS KV_CACHE_BYTES [TRACEPARENT BAGGAGE]
"""

import json
import sys
import time


def main() -> None:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.executor import Executor

    model_dir, count, kv_cache_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    headers = {"traceparent": sys.argv[4], "baggage": sys.argv[5]} if len(sys.argv) > 5 else None
    config = EngineArgs(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=kv_cache_bytes
    ).create_engine_config()
    client = EngineCoreClient.make_client(
        multiprocess_mode=True,
        asyncio_mode=False,
        vllm_config=config,
        executor_class=Executor.get_class(config),
        log_stats=False,
    )
    try:
        seen: dict[str, dict] = {}
        for i in range(count):
            rid = f"direct-{i}"
            params = SamplingParams(max_tokens=8 + i, ignore_eos=True, temperature=0.0)
            client.add_request(
                EngineCoreRequest(
                    request_id=rid,
                    prompt_token_ids=list(range(5, 25 + 3 * i)),
                    mm_features=None,
                    sampling_params=params,
                    pooling_params=None,
                    arrival_time=time.time(),
                    lora_request=None,
                    cache_salt=None,
                    data_parallel_rank=None,
                    trace_headers=headers,
                )
            )
            seen[rid] = {"id": rid, "prompt": 20 + 3 * i, "output": 0, "finish": None}
        deadline = time.monotonic() + 120
        while any(r["finish"] is None for r in seen.values()) and time.monotonic() < deadline:
            for output in client.get_output().outputs:
                record = seen[output.request_id]
                record["output"] += len(output.new_token_ids)
                if output.finish_reason is not None:
                    record["finish"] = str(output.finish_reason)
        for record in seen.values():
            print(json.dumps(record), flush=True)
    finally:
        client.shutdown()


if __name__ == "__main__":
    main()
