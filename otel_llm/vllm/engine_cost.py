"""What each engine request cost, accounted in vLLM's engine-core process (docs/cost-accounting.md).

The engine core schedules and runs the model in a busy loop on its main thread. Every piece of its
wall time goes to exactly one bucket:

- a step's requests: the time from the previous cut to the return of `update_from_output` (one
  pipeline beat in the overlapped loop), split over the batch's requests in proportion to their
  scheduled tokens with integer shares that add up to the step exactly;
- idle: the engine blocked waiting for input, the tail after its last step, and steps that
  scheduled no token.

So over any span of cuts, the requests' shares plus idle equal the engine's wall time, in integer
nanoseconds. KV-cache occupancy is integrated per request in block-nanoseconds: the blocks a
request allocated, while it holds them (blocks found in the prefix cache are paid by their
allocator), so the requests' block-nanoseconds never exceed the pool's capacity x time.

Per step the work is O(requests scheduled): a dict entry per request, integer arithmetic, a
`len()` per KV-cache group; closing a window also visits the requests holding blocks (at most once
per window, none when the engine goes idle). No per-token objects, no locks: only the engine's main
thread touches a `CostBook`. Finished requests and window totals become usage records (otel_llm/usage.py's
`EngineSpool`), one `os.write` per step that finished some.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from otel_llm import semconv
from otel_llm.usage import EngineSpool, json_line
from otel_llm.vllm import contract
from otel_llm.warn import guarded

_log = logging.getLogger("otel_llm.vllm")


class Acc:
    """One engine request's running account (integers: nanoseconds and counts)."""

    __slots__ = (
        "busy_ns",
        "prefill_ns",
        "tokens",
        "prompt_left",
        "inflight",
        "blocks",
        "hits",
        "since",
        "block_ns",
        "hit_block_ns",
        "preemptions",
        "preempted_at",
        "preempted_ns",
        "preempt_log",
        "cached_tokens",
        "external_tokens",
        "headers",
        "finished",
    )

    def __init__(self, now: int):
        self.busy_ns = self.prefill_ns = self.tokens = self.inflight = self.blocks = self.hits = 0
        self.prompt_left = 0  # prompt tokens still to compute (set when admitted): its steps until then are prefill
        self.since = now
        self.block_ns = self.hit_block_ns = self.preemptions = self.preempted_at = self.preempted_ns = 0
        self.cached_tokens = -1  # its prefix-cache hit at its first admission (-1: not admitted yet)
        self.external_tokens = 0  # the part of that hit a KV connector loaded
        self.preempt_log: list | None = None  # [[preempted at (Unix ns), for how long (ns)], ...]
        self.headers: dict | None = None  # what an instrumented frontend sent (contract.read_admitted)
        self.finished: contract.CoreRequest | None = None


class CostBook:
    """The accounts of one engine (one Scheduler). Main thread only."""

    def __init__(
        self,
        scheduler,
        writer,
        *,
        instance: str,
        service: str,
        engine_instance: str,
        window_ns: int,
        attribution=None,
        clock=time.monotonic_ns,
    ):
        self.clock = clock
        now = clock()
        kv = contract.read_kv_pool(scheduler)
        self.groups = kv.groups  # each KV-cache group's request id -> block list (vLLM's own dicts)
        self.block_sizes = kv.block_sizes
        self.capacity_blocks = kv.capacity_blocks
        self.requests = contract.read_scheduler_requests(scheduler)
        self.model = contract.read_scheduler_model(scheduler)
        self.writer = writer
        self.instance, self.service, self.engine_instance = instance, service, engine_instance
        self.attribution = attribution
        self.window_ns = window_ns
        self.unix_offset = time.time_ns() - now
        self.acc: dict[str, Acc] = {}
        self.last_cut = now
        self.window_start = now
        self.busy_ns = self.idle_ns = 0  # in the current window
        self.window_block_ns = 0
        self.pending: list[bytes] = []
        self.prefilling: dict[int, set] = {}  # id(SchedulerOutput) -> request ids prefilling in it

    # --- the hooks (the wrappers at the end of this module call these) ----------------------------------
    def scheduled(self, so) -> None:
        """After `Scheduler.schedule`: count the batch's requests in flight, their tokens and blocks."""
        now = self.clock()
        tokens, _ = contract.read_scheduled(so)
        acc = self.acc
        admitted = contract.read_admitted(so, self.requests)
        for rid, computed, prompt, headers, external in admitted:  # new, or resumed after a preemption
            a = acc.get(rid)
            if a is None:
                a = acc[rid] = Acc(now)
            if a.cached_tokens < 0:
                a.cached_tokens = computed
                a.external_tokens = external
            if headers is not None:  # kept before they leave the Request: a failure here never loses "billed"
                a.headers = headers
                contract.drop_frontend_headers(self.requests[rid])
            a.prompt_left = prompt - computed
        groups = self.groups
        single = groups[0] if len(groups) == 1 else None
        prefilling = None
        for rid, n in tokens.items():
            a = acc.get(rid)
            if a is None:
                a = acc[rid] = Acc(now)
            a.inflight += 1
            a.tokens += n
            if a.prompt_left > 0:
                a.prompt_left -= n
                if prefilling is None:
                    prefilling = self.prefilling[id(so)] = set()
                prefilling.add(rid)
            if a.preempted_at:
                self._resumed(a, now)
            if single is not None:
                held = len(single.get(rid) or ())
            else:
                held = 0
                for group in groups:
                    held += len(group.get(rid) or ())
            if held != a.blocks:
                self._blocks(a, now)
                a.blocks = held
        for rid, computed, *_ in admitted:
            a = acc[rid]
            a.hits = min(a.blocks, sum(computed // size for size in self.block_sizes))

    def updated(self, so, outputs=None) -> None:
        """After `Scheduler.update_from_output`: the beat since the last cut is this batch's. The
        figures of requests finished with it go on their final outputs (`outputs`, what
        update_from_output returns) for an instrumented frontend's span."""
        now = self.clock()
        beat = now - self.last_cut
        self.last_cut = now
        tokens, total = contract.read_scheduled(so)
        prefilling = self.prefilling.pop(id(so), ())
        acc = self.acc
        summaries = None
        if total <= 0:
            self.idle_ns += beat
        else:
            self.busy_ns += beat
            done = charged = 0
            for rid, n in tokens.items():
                done += n
                share = beat * done // total - charged
                charged += share
                a = acc.get(rid)
                if a is None:  # cannot happen (scheduled() made it); the share stays busy, unattributed
                    continue
                a.busy_ns += share
                if rid in prefilling:
                    a.prefill_ns += share
                a.inflight -= 1
                if a.finished is not None and a.inflight == 0 and a.blocks == 0:
                    summary = self._finalize(rid, a, now)
                    if summary is not None and outputs:
                        if summaries is None:
                            summaries = {}
                        summaries[rid] = summary
        if summaries:
            contract.set_final_output_cost(outputs, summaries)
        if now - self.window_start >= self.window_ns:
            self._close_window(now)
        self.flush()

    def preempted(self, request) -> None:
        """Before `Scheduler._preempt_request` (which frees the request's blocks next)."""
        a = self.acc.get(contract.read_core_request_id(request))
        if a is not None:
            a.preemptions += 1
            a.preempted_at = self.clock()
            if a.preempt_log is None:
                a.preempt_log = []
            a.preempt_log.append([self.unix_offset + a.preempted_at, 0])

    def freeing(self, request) -> None:
        """Before `Scheduler._free_request_blocks`: the request holds no blocks from now on."""
        rid = contract.read_core_request_id(request)
        a = self.acc.get(rid)
        if a is None:
            return
        now = self.clock()
        self._blocks(a, now)
        a.blocks = a.hits = 0
        if a.finished is not None and a.inflight == 0:
            self._finalize(rid, a, now)

    def finished(self, request) -> None:
        """After `Scheduler._free_request`: finished (any cause); its record is written once it is
        out of every batch in flight and holds no block."""
        rid = contract.read_core_request_id(request)
        now = self.clock()
        a = self.acc.get(rid)
        if a is None:  # never scheduled (aborted while waiting)
            a = self.acc[rid] = Acc(now)
        a.finished = contract.read_core_request(request, a.headers)
        if a.preempted_at:
            self._resumed(a, now)
        if a.inflight == 0 and a.blocks == 0:
            self._finalize(rid, a, now)

    def waiting_for_input(self) -> None:
        """The engine is about to block on its input queue: the time since the last cut is idle. A
        window with busy time in it (or one that is due) is written now: no request is in flight, and
        an engine killed while idle (vLLM's shutdown kills its engine core at once) loses only idle time."""
        now = self._idle_cut()
        if self.busy_ns or now - self.window_start >= self.window_ns:
            self._close_window(now)
            self.flush()

    def got_input(self) -> None:
        now = self._idle_cut()
        if now - self.window_start >= self.window_ns:
            self._close_window(now)
        self.flush()

    def shutdown(self) -> None:
        """Close the last window at a cut (the time since the last one is idle) and write it."""
        self._close_window(self._idle_cut())
        self.flush()

    def _idle_cut(self) -> int:
        """A cut: the time since the last one was idle. Returns the cut's time."""
        now = self.clock()
        self.idle_ns += now - self.last_cut
        self.last_cut = now
        return now

    # --- accounting ---------------------------------------------------------------------------------
    @staticmethod
    def _resumed(a: Acc, now: int) -> None:
        """Scheduled again (or finished) after a preemption."""
        waited = now - a.preempted_at
        a.preempted_ns += waited
        a.preempted_at = 0
        a.preempt_log[-1][1] = waited

    def _blocks(self, a: Acc, now: int) -> None:
        held = now - a.since
        if held > 0 and a.blocks:
            owned = a.blocks - a.hits
            a.block_ns += owned * held
            a.hit_block_ns += a.hits * held
            self.window_block_ns += owned * held
        a.since = now

    def _close_window(self, now: int) -> None:
        for a in self.acc.values():  # blocks held across the cut count in this window up to it
            if a.blocks:
                self._blocks(a, now)
        record = {
            semconv.USAGE_ID: f"{self.engine_instance}/window/{self.unix_offset + now}",
            semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
            semconv.USAGE_KIND: semconv.USAGE_KIND_ENGINE_WINDOW,
            semconv.SERVICE_NAME: self.service,
            semconv.SERVICE_INSTANCE_ID: self.instance,
            semconv.VLLM_ENGINE_INSTANCE: self.engine_instance,
            semconv.ENGINE_WINDOW_START: self.unix_offset + self.window_start,
            semconv.USAGE_TIME: self.unix_offset + now,
            semconv.ENGINE_BUSY_NS: self.busy_ns,
            semconv.ENGINE_IDLE_NS: self.idle_ns,
            semconv.ENGINE_KV_CAPACITY_BLOCKS: self.capacity_blocks,
            semconv.ENGINE_KV_BLOCK_SIZE: self.block_sizes[0] if self.block_sizes else 0,
            semconv.ENGINE_KV_BLOCK_NS: self.window_block_ns,
        }
        if self.model:
            record[semconv.GEN_AI_REQUEST_MODEL] = self.model
        self.pending.append(json_line(record))
        self.window_start = now
        self.busy_ns = self.idle_ns = self.window_block_ns = 0

    def _finalize(self, rid: str, a: Acc, now: int) -> str | None:
        """Queue the request's record; its figures for the frontend's span when a frontend bills it."""
        del self.acc[rid]
        info = a.finished
        record: dict[str, Any] = {
            semconv.USAGE_ID: f"{self.engine_instance}/{rid}",
            semconv.USAGE_SCHEMA_VERSION: semconv.USAGE_SCHEMA,
            semconv.USAGE_KIND: semconv.USAGE_KIND_ENGINE,
            semconv.SERVICE_NAME: self.service,
            semconv.SERVICE_INSTANCE_ID: self.instance,
            semconv.VLLM_ENGINE_INSTANCE: self.engine_instance,
            semconv.VLLM_ENGINE_REQUEST_ID: rid,
            semconv.USAGE_FRONTEND_BILLED: info.frontend_billed,
            semconv.GEN_AI_USAGE_INPUT_TOKENS: info.prompt_tokens,
            semconv.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: max(0, a.cached_tokens),
            semconv.GEN_AI_USAGE_OUTPUT_TOKENS: info.output_tokens,
            semconv.REQUEST_OUTCOME: _OUTCOMES.get(info.finish_reason, semconv.OUTCOME_FINISHED),
            semconv.USAGE_DURATION: max(0.0, (self.unix_offset + now) / 1e9 - info.arrival_time),
            semconv.USAGE_TIME: self.unix_offset + now,
            semconv.COST_COMPUTE_NS: a.busy_ns,
            semconv.COST_PREFILL_COMPUTE_NS: a.prefill_ns,
            semconv.COST_SCHEDULED_TOKENS: a.tokens,
            semconv.COST_KV_BLOCK_NS: a.block_ns,
            semconv.COST_KV_HIT_BLOCK_NS: a.hit_block_ns,
            semconv.COST_PREEMPTED_NS: a.preempted_ns,
            semconv.VLLM_PREEMPTIONS: a.preemptions,
        }
        if a.external_tokens:
            record[semconv.VLLM_EXTERNAL_CACHED_TOKENS] = a.external_tokens
        if info.finish_reason:
            record[semconv.GEN_AI_RESPONSE_FINISH_REASONS] = [info.finish_reason]
        model = info.lora_name or self.model
        if model:
            record[semconv.GEN_AI_REQUEST_MODEL] = self.model or model
            record[semconv.GEN_AI_RESPONSE_MODEL] = model
        if info.lora_name:
            record[semconv.VLLM_LORA_NAME] = info.lora_name
        if info.pd_prefill:  # billed by its decode node: never a bill here
            record[semconv.VLLM_PD_ROLE] = semconv.PD_ROLE_PREFILL
        if info.trace_headers:
            _trace_fields(record, info.trace_headers, self.attribution)
        self.pending.append(json_line(record))
        if not info.frontend_billed:
            return None
        summary = (
            f"{a.busy_ns},{a.prefill_ns},{a.block_ns},{a.hit_block_ns},{a.preempted_ns},{a.tokens},{a.external_tokens}"
        )
        if a.preempt_log:
            summary += ";" + ";".join(f"{at}:{waited}" for at, waited in a.preempt_log)
        return summary

    def flush(self) -> None:
        if self.pending:
            data, self.pending = b"".join(self.pending), []
            self.writer.write(data)


_OUTCOMES = {semconv.FINISH_REASON_ABORT: semconv.OUTCOME_ABORTED, semconv.FINISH_REASON_ERROR: semconv.OUTCOME_ERROR}


def _trace_fields(record: dict, headers, attribution) -> None:
    """Trace context and tenant from the W3C headers that reached the engine with the request
    (an instrumented frontend adds its GenAI span's traceparent; another frontend, what it sent)."""
    parent = headers.get("traceparent")
    if isinstance(parent, str):
        parts = parent.split("-")
        if len(parts) == 4 and len(parts[1]) == 32 and len(parts[2]) == 16:
            record[semconv.USAGE_TRACE_ID] = parts[1]
            record[semconv.USAGE_SPAN_ID] = parts[2]
    if attribution is not None and headers.get("baggage"):
        from opentelemetry.baggage.propagation import W3CBaggagePropagator

        tenant, scene, cost_center = attribution({}, W3CBaggagePropagator().extract({"baggage": headers["baggage"]}))
        for key, value in (
            (semconv.TENANT_ID, tenant),
            (semconv.TENANT_SCENE, scene),
            (semconv.TENANT_COST_CENTER, cost_center),
        ):
            if value is not None:
                record[key] = value


# --- the wrappers (hook table: otel_llm/vllm/hooks.py) ------------------------------------------------
# A CostBook lives on its Scheduler (attribute BOOK), made when the engine-core process's busy loop
# first waits for input; in-process engines (no busy loop) are not accounted. Every wrapper calls
# vLLM's method unchanged; its own part runs under `guarded`: a failure of ours is counted and
# logged once, the engine never sees it.

BOOK = "_otel_llm_cost_book"


def _after(method: str):
    what = f"engine cost: {method}"

    def factory(tel):
        def wrapper(wrapped, instance, args, kwargs):
            result = wrapped(*args, **kwargs)
            book = getattr(instance, BOOK, None)
            if book is not None:
                guarded(what, getattr(book, method), result if method == "scheduled" else _first(args, kwargs))
            return result

        return wrapper

    return factory


def _before(method: str):
    what = f"engine cost: {method}"

    def factory(tel):
        def wrapper(wrapped, instance, args, kwargs):
            book = getattr(instance, BOOK, None)
            if book is not None:
                guarded(what, getattr(book, method), _first(args, kwargs))
            return wrapped(*args, **kwargs)

        return wrapper

    return factory


def _first(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()), None)


scheduled = _after("scheduled")  # Scheduler.schedule -> its SchedulerOutput


def updated(tel):
    """Scheduler.update_from_output(scheduler_output, ...) -> the step's outputs per client."""

    def wrapper(wrapped, instance, args, kwargs):
        outputs = wrapped(*args, **kwargs)
        book = getattr(instance, BOOK, None)
        if book is not None:
            guarded("engine cost: updated", book.updated, _first(args, kwargs), outputs)
        return outputs

    return wrapper


finished = _after("finished")  # Scheduler._free_request(request, ...)
preempted = _before("preempted")  # Scheduler._preempt_request(request, ...)
freeing = _before("freeing")  # Scheduler._free_request_blocks(request)


def input_queue(tel):
    """EngineCoreProc._process_input_queue: makes the book on the first call; the time the engine
    blocks waiting for input (and the tail before it) is idle."""

    def wrapper(wrapped, instance, args, kwargs):
        book = guarded("engine cost: book", _book_of, tel, instance)
        waits = book is not None and guarded("engine cost: idle", _starts_waiting, book, instance)
        try:
            return wrapped(*args, **kwargs)
        finally:
            if book is not None:
                guarded("engine cost: idle", book.got_input if waits else book.flush)

    return wrapper


def _starts_waiting(book: CostBook, engine_core) -> bool:
    if contract.read_has_work(engine_core):
        return False
    book.waiting_for_input()
    return True


def shutdown(tel):
    """EngineCore.shutdown: the last window and every record still pending are written."""

    def wrapper(wrapped, instance, args, kwargs):
        guarded("engine cost: shutdown", _close, instance)
        return wrapped(*args, **kwargs)

    return wrapper


def _close(engine_core) -> None:
    scheduler = contract.read_engine_scheduler(engine_core)
    book = getattr(scheduler, BOOK, None)
    if book is not None:
        setattr(scheduler, BOOK, None)
        book.shutdown()
        book.writer.close()


def _book_of(tel, engine_core) -> CostBook | None:
    scheduler = contract.read_engine_scheduler(engine_core)
    if hasattr(scheduler, BOOK):
        return getattr(scheduler, BOOK)
    setattr(scheduler, BOOK, None)  # a book that fails to build is not tried again
    settings = tel.settings
    if not (settings.usage_dir and settings.engine_cost):
        return None
    ledger = tel.ledger
    writer = EngineSpool(
        settings.usage_dir,
        max_bytes=settings.usage_max_bytes,
        max_age_s=settings.usage_max_age_s,
        fsync_interval_s=settings.usage_fsync_interval_s,
        on_drop=ledger.count_drop,
    )
    book = CostBook(
        scheduler,
        writer,
        instance=ledger.instance,
        service=ledger.service,
        engine_instance=f"{ledger.instance}/engine{contract.read_engine_index(engine_core)}",
        window_ns=int(settings.engine_cost_window_s * 1e9),
        attribution=tel.attribution,
    )
    setattr(scheduler, BOOK, book)
    return book
