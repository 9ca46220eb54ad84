"""Python bytecodes per request on the serving thread: a count that does not move with the VM.

`server_overhead.py --part api --opcodes` runs, after the timed rounds, one more load per variant with
`sys.settrace` counting every bytecode the serving thread executes (CPython's per-opcode trace events,
`frame.f_trace_opcodes`), by the file of the code that ran. The timed figures on the 2-core VM carry a
spread of tens of microseconds per request; this count is the same in every run on the same versions,
so a change of the request path shows up whole, however small. It covers the serving thread only (the
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
    """Bytecodes executed on this thread between start() and stop(), per code file."""

    def __init__(self):
        self.by_file: Counter = Counter()

    def start(self) -> None:
        sys.settrace(self._call)

    def stop(self) -> None:
        sys.settrace(None)

    def _call(self, frame, event, arg):
        frame.f_trace_opcodes = True
        by_file, name = self.by_file, frame.f_code.co_filename

        def local(frame, event, arg):
            if event == "opcode":
                by_file[name] += 1
            return local

        return local

    def groups(self) -> dict[str, int]:
        """Bytecodes per group of GROUPS, and "other", and "total"."""
        found = dict.fromkeys([label for label, _ in GROUPS] + ["other"], 0)
        for path, count in self.by_file.items():
            label = next((label for label, part in GROUPS if part in path), "other")
            found[label] += count
        found["total"] = sum(self.by_file.values())
        return found
