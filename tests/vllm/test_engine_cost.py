"""The engine cost book's rules where the real engine on CPU cannot go: vLLM's CPU backend turns
asynchronous scheduling off and its pipeline parallelism fails (vLLM 0.32), so the overlapped loop
(`step_with_batch_queue`: batch k+1 scheduled before batch k's output is processed) is driven here
with the call order that loop makes, on stand-ins for the scheduler's objects that hold only the
fields otel_llm/vllm/contract.py reads. The synchronous loop, preemption, prefix-cache hits and the
records' join are tested on the real engine (tests/e2e/test_engine_cost_e2e.py)."""

import json
from types import SimpleNamespace

from otel_llm import semconv
from otel_llm.vllm.engine_cost import CostBook

BLOCK = 16


class Clock:
    def __init__(self):
        self.now = 1_000

    def __call__(self):
        return self.now

    def advance(self, ns: int) -> None:
        self.now += ns


class Writer:
    def __init__(self):
        self.records = []

    def write(self, data: bytes) -> bool:
        self.records += [json.loads(line) for line in data.splitlines()]
        return True


def request(rid: str, prompt: int):
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        num_output_tokens=0,
        arrival_time=1.0,
        lora_request=None,
        trace_headers=None,
        reason="length",
        get_finished_reason=lambda: "length",
    )


def make_book(capacity=100):
    blocks: dict[str, list] = {}
    requests: dict[str, SimpleNamespace] = {}
    scheduler = SimpleNamespace(
        requests=requests,
        kv_cache_manager=SimpleNamespace(
            coordinator=SimpleNamespace(single_type_managers=[SimpleNamespace(req_to_blocks=blocks, block_size=BLOCK)]),
            block_pool=SimpleNamespace(num_gpu_blocks=capacity + 1),
        ),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny", model="tiny")),
    )
    clock, writer = Clock(), Writer()
    book = CostBook(
        scheduler,
        writer,
        instance="host:1",
        service="vllm",
        engine_instance="host:1/engine0",
        window_ns=10**12,
        clock=clock,
    )
    return book, clock, writer, blocks, requests


def schedule(book, requests, blocks, tokens: dict[str, int], new=(), resumed=()):
    """What Scheduler.schedule does that the book reads: advance num_computed_tokens, allocate blocks."""
    computed = {rid: requests[rid].num_computed_tokens for rid in resumed}
    for rid, n in tokens.items():
        r = requests[rid]
        r.num_computed_tokens += n
        blocks[rid] = [None] * -(-r.num_computed_tokens // BLOCK)
    so = SimpleNamespace(
        num_scheduled_tokens=dict(tokens),
        total_num_scheduled_tokens=sum(tokens.values()),
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0) for rid in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(computed), resumed_req_ids=set(resumed), num_computed_tokens=list(computed.values())
        ),
    )
    book.scheduled(so)
    return so


def finish(book, requests, blocks, rid):
    """Scheduler._free_request -> _free_blocks -> _free_request_blocks, then the request is gone."""
    r = requests[rid]
    book.freeing(r)
    blocks.pop(rid, None)
    del requests[rid]
    book.finished(r)
    book.flush()  # what the input-queue hook or the step's update does next


def test_the_overlapped_loop_tiles_wall_time_and_charges_in_flight_batches():
    book, clock, writer, blocks, requests = make_book()
    requests["a"], requests["b"] = request("a", 30), request("b", 10)
    clock.advance(500)  # idle before the first request arrives
    book.waiting_for_input()
    clock.advance(2_000)
    book.got_input()
    so1 = schedule(book, requests, blocks, {"a": 30, "b": 10}, new=("a", "b"))  # batch 1: both prefill
    clock.advance(300)
    so2 = schedule(book, requests, blocks, {"a": 1, "b": 1})  # batch 2 scheduled before batch 1's output
    clock.advance(700)
    book.updated(so1)  # beat 1 (1000 ns): 30 : 10
    finish(book, requests, blocks, "b")  # b stopped on batch 1's token; it is still in batch 2
    assert [r for r in writer.records if r[semconv.USAGE_KIND] == semconv.USAGE_KIND_ENGINE] == []
    so3 = schedule(book, requests, blocks, {"a": 1})
    clock.advance(999)
    book.updated(so2)  # beat 2 (999 ns): 1 : 1 -> b is out of every batch: written now
    (b,) = writer.records
    assert b[semconv.VLLM_ENGINE_REQUEST_ID] == "b"
    assert b[semconv.COST_COMPUTE_NS] == 250 + 999 - 999 // 2  # 1000 * 10 // 40, then the rounded half
    assert b[semconv.COST_PREFILL_COMPUTE_NS] == 250
    assert b[semconv.COST_SCHEDULED_TOKENS] == 11
    clock.advance(401)
    book.updated(so3)
    finish(book, requests, blocks, "a")
    clock.advance(50)
    book.waiting_for_input()
    clock.advance(5_000)
    book.shutdown()
    a = next(r for r in writer.records if r.get(semconv.VLLM_ENGINE_REQUEST_ID) == "a")
    assert a[semconv.COST_COMPUTE_NS] == 750 + 999 // 2 + 401
    assert a[semconv.COST_PREFILL_COMPUTE_NS] == 750
    # going idle after busy time closes a window (nothing in flight); shutdown closes the idle rest
    busy, rest = [r for r in writer.records if r[semconv.USAGE_KIND] == semconv.USAGE_KIND_ENGINE_WINDOW]
    assert rest[semconv.ENGINE_WINDOW_START] == busy[semconv.USAGE_TIME]
    assert busy[semconv.USAGE_TIME] - busy[semconv.ENGINE_WINDOW_START] == 500 + 2_000 + 300 + 700 + 999 + 401 + 50
    assert busy[semconv.ENGINE_BUSY_NS] == a[semconv.COST_COMPUTE_NS] + b[semconv.COST_COMPUTE_NS] == 2_400
    assert (rest[semconv.ENGINE_BUSY_NS], rest[semconv.ENGINE_IDLE_NS]) == (0, 5_000)
    for window in (busy, rest):
        wall = window[semconv.USAGE_TIME] - window[semconv.ENGINE_WINDOW_START]
        assert window[semconv.ENGINE_BUSY_NS] + window[semconv.ENGINE_IDLE_NS] == wall


def test_shares_add_up_to_the_step_exactly_whatever_the_rounding():
    book, clock, writer, blocks, requests = make_book()
    tokens = {f"r{i}": n for i, n in enumerate((1, 7, 3, 1, 13, 2, 1))}
    for rid in tokens:
        requests[rid] = request(rid, 100)
    so = schedule(book, requests, blocks, tokens, new=tokens)
    clock.advance(1_000_003)
    book.updated(so)
    shares = {rid: book.acc[rid].busy_ns for rid in tokens}
    assert sum(shares.values()) == 1_000_003 == book.busy_ns
    for rid, n in tokens.items():
        assert abs(shares[rid] - 1_000_003 * n / 28) < 1


def test_block_seconds_preemption_and_a_prefix_hit():
    book, clock, writer, blocks, requests = make_book()
    requests["a"] = request("a", 40)
    so = schedule(book, requests, blocks, {"a": 40}, new=("a",))  # 3 blocks
    clock.advance(100)
    book.updated(so)
    book.preempted(requests["a"])
    book.freeing(requests["a"])  # _preempt_request frees its blocks
    del blocks["a"]
    requests["a"].num_computed_tokens = 0
    clock.advance(1_000)  # preempted, waiting
    # resumed: 32 of its tokens still in the prefix cache (2 blocks it did not allocate this time)
    requests["a"].num_computed_tokens = 32
    so = schedule(book, requests, blocks, {"a": 8}, resumed=("a",))
    clock.advance(200)
    book.updated(so)
    finish(book, requests, blocks, "a")
    (a,) = writer.records
    assert a[semconv.VLLM_PREEMPTIONS] == 1 and a[semconv.COST_PREEMPTED_NS] == 1_000
    assert a[semconv.COST_KV_BLOCK_NS] == 3 * 100 + (3 - 2) * 200
    assert a[semconv.COST_KV_HIT_BLOCK_NS] == 2 * 200
    assert a[semconv.COST_SCHEDULED_TOKENS] == 48


def test_a_request_aborted_while_waiting_gets_a_record_with_no_cost():
    book, clock, writer, blocks, requests = make_book()
    requests["w"] = request("w", 5)
    finish(book, requests, blocks, "w")
    (w,) = writer.records
    assert (w[semconv.COST_COMPUTE_NS], w[semconv.COST_KV_BLOCK_NS], w[semconv.GEN_AI_USAGE_INPUT_TOKENS]) == (0, 0, 5)
    assert w[semconv.USAGE_FRONTEND_BILLED] is False
