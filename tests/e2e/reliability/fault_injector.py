"""Test-only fault injection into otel-llm inside a real `opentelemetry-instrument vllm serve`.

How it gets into the server process: `opentelemetry-instrument` runs the command with its own
directory first on PYTHONPATH, so *its* `sitecustomize` is the one Python imports (a
`sitecustomize.py` of ours would be shadowed, and `.pth` files are read in site directories only,
not in PYTHONPATH entries). That sitecustomize loads the distro, the configurators, then every
`opentelemetry_pre_instrument` entry point, then the instrumentors (otel-llm's among them). The test
puts a temporary directory on PYTHONPATH holding a copy of this module and a minimal
`otel_llm_fault_injector-0.dist-info` whose entry_points.txt names `install` below in that group: the
auto-instrumentation's own plugin mechanism runs it, before otel-llm instruments vLLM, and nothing is
installed or shadowed. Without OTEL_LLM_TEST_FAULT_FILE in the environment it does nothing.

What it patches, once, at startup:

- every `_safe` guard of the GUARDED_MODULES, existing (made when they were imported: found by
  the `what` they carry) and future (the hook factories call `_safe` when vLLM imports each module): the
  guarded function gets a check in front, so target `guard:<what>` raises *inside* that guard;
- each `module:attribute.path` listed in OTEL_LLM_TEST_FAULT_TARGETS (comma-separated): the
  function is replaced by one that raises when it is the active target, and otherwise calls it.
  Functions are looked up at call time by their callers (module globals, class attributes), so the
  replacement is what runs.

Switching at run time: before each call the check reads OTEL_LLM_TEST_FAULT_FILE (the test writes it
atomically); when one of its lines is the target's name, the call raises InjectedFault(name). Each
registration and each injected fault appends one line, `registered|hit <pid> <target>`, to
OTEL_LLM_TEST_FAULT_LOG.
"""

from __future__ import annotations

import functools
import importlib
import os

SWITCH_ENV = "OTEL_LLM_TEST_FAULT_FILE"
LOG_ENV = "OTEL_LLM_TEST_FAULT_LOG"
TARGETS_ENV = "OTEL_LLM_TEST_FAULT_TARGETS"
GUARD_PREFIX = "guard:"


class InjectedFault(Exception):
    """The fault the test asked for (the message names the target)."""


def _active(switch: str) -> list[str]:
    try:
        with open(switch) as f:
            return f.read().split("\n")
    except OSError:
        return []


def _note(kind: str, name: str) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{kind} {os.getpid()} {name}\n".encode())
    finally:
        os.close(fd)


def _faulty(name: str, fn, switch: str):
    @functools.wraps(fn)
    def faulty(*args, **kwargs):
        if name in _active(switch):
            _note("hit", name)
            raise InjectedFault(name)
        return fn(*args, **kwargs)

    _note("registered", name)
    return faulty


# the modules whose `_safe` guards (otel_llm.warn.guard) wrap our bookkeeping around vLLM's code
GUARDED_MODULES = ("otel_llm.vllm.streams", "otel_llm.vllm.wrappers")


def _patch_guards(switch: str) -> None:
    modules = [importlib.import_module(name) for name in GUARDED_MODULES]
    replaced: dict[int, object] = {}  # a guard imported by another module is replaced there too
    for module in modules:
        original = module._safe

        def safe(what: str, *args, original=original):
            deco = original(what, *args)
            return lambda wrapped: deco(_faulty(GUARD_PREFIX + what, wrapped, switch))

        for attribute, value in list(vars(module).items()):
            what, fn = getattr(value, "what", None), getattr(value, "wrapped", None)
            if isinstance(what, str) and callable(fn):
                if id(value) not in replaced:
                    replaced[id(value)] = safe(what)(fn)
                setattr(module, attribute, replaced[id(value)])
        module._safe = safe


def _patch_function(target: str, switch: str) -> None:
    module_name, _, path = target.partition(":")
    parent = importlib.import_module(module_name)
    *outer, name = path.split(".")
    for part in outer:
        parent = getattr(parent, part)
    setattr(parent, name, _faulty(target, getattr(parent, name), switch))


def install() -> None:
    switch = os.environ.get(SWITCH_ENV)
    if not switch:
        return
    _patch_guards(switch)
    for target in filter(None, (t.strip() for t in os.environ.get(TARGETS_ENV, "").split(","))):
        _patch_function(target, switch)
