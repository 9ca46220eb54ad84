"""Python bytecodes per request on the serving thread: a count that does not move with the VM.

`server_overhead.py --part api --opcodes` runs, after the timed rounds, one more load per variant with
`sys.settrace` counting every bytecode the serving thread executes (CPython's per-opcode trace events,
`frame.f_trace_opcodes`), by the file of the code that ran. The timed figures on the 2-core VM carry a
spread of tens of microseconds per request; this count is the same in every run on the same versions
(bare's and A/A's to the bytecode; native tracing's moves by a few dozen, with when its batch processor's
thread is woken from the serving thread), so a change of the request path shows up whole, however small. It covers the serving thread only (the
event loop's, where vLLM's API server serves every request): vLLM's native tracing exports its span
on the SDK's worker thread, mostly in C, which the timed figures include and this count does not;
C code (marshal, json, a syscall) counts as the one bytecode that calls it.
"""

from __future__ import annotations

import sys
from collections import Counter

# (label, what a file's path contains): the groups printed, first match wins; the rest is "other"
GROUPS = (("otel-llm", "/otel_llm/"), ("OpenTelemetry", "/opentelemetry/"))


class OpcodeCount:
    """Bytecodes executed on this thread between start() and stop(), per code object (by_file and
    by_function sum them per file and per (file, qualified name))."""

    def __init__(self):
        self.by_code: Counter = Counter()
        self._seen: set = set()  # code objects run since the last `request_done`
        self.distinct: list[int] = []  # per request: the distinct Python functions (code objects) it ran

    def request_done(self) -> None:
        """Ends a request: the distinct functions it ran (a function's first run in a request costs the CPU
        cache misses for its code and the objects it reads; docs/api-server-cost.md) are kept."""
        self.distinct.append(len(self._seen))
        self._seen = set()

    def start(self) -> None:
        sys.settrace(self._call)

    def stop(self) -> None:
        sys.settrace(None)

    def _call(self, frame, event, arg):
        frame.f_trace_opcodes = True
        by_code, code = self.by_code, frame.f_code
        self._seen.add(code)

        def local(frame, event, arg):
            if event == "opcode":
                by_code[code] += 1
            return local

        return local

    @property
    def by_file(self) -> Counter:
        found: Counter = Counter()
        for code, count in self.by_code.items():
            found[code.co_filename] += count
        return found

    def top(self, part: str, n: int) -> list[tuple[int, str]]:
        """The n functions whose file's path contains `part` that ran the most bytecodes: (count, name)."""
        found: Counter = Counter()
        for code, count in self.by_code.items():
            if part in code.co_filename:
                found[f"{code.co_filename.rpartition(part)[2]}:{code.co_qualname}"] += count
        return [(count, name) for name, count in found.most_common(n)]

    def groups(self) -> dict[str, int]:
        """Bytecodes per group of GROUPS, and "other", and "total"."""
        found = dict.fromkeys([label for label, _ in GROUPS] + ["other"], 0)
        for path, count in self.by_file.items():
            label = next((label for label, part in GROUPS if part in path), "other")
            found[label] += count
        found["total"] = sum(self.by_file.values())
        return found
