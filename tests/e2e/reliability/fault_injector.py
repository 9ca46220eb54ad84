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
  replacement is what runs;
- every entry point of otel-llm (a function of ours another library calls, marked by
  otel_llm/warn.py `entry` or `inline_entry`: found by `warn.entry_points` in each otel_llm module
  as it is imported), target `entry:<module>:<qualified name>`. The fault is raised inside its
  guard, in place, so that every reference to it (a hook the FastAPI instrumentation holds, a
  method) gets it: for `entry`, the function its wrapper calls is swapped in the wrapper's closure;
  for `inline_entry`, the function's code is recompiled from its source with a check as the first
  statement of its `try`. Each one is noted `registered`, with a `what <pid> <target> <what>` line
  naming the point its failures are counted under.

Switching at run time: before each call the check reads OTEL_LLM_TEST_FAULT_FILE (the test writes it
atomically); when one of its lines is the target's name, the call raises InjectedFault(name). Each
registration and each injected fault appends one line, `registered|hit <pid> <target>`, to
OTEL_LLM_TEST_FAULT_LOG.
"""

from __future__ import annotations
import __future__

import ast
import functools
import importlib
import inspect
import os
import textwrap

SWITCH_ENV = "OTEL_LLM_TEST_FAULT_FILE"
LOG_ENV = "OTEL_LLM_TEST_FAULT_LOG"
TARGETS_ENV = "OTEL_LLM_TEST_FAULT_TARGETS"
GUARD_PREFIX = "guard:"
ENTRY_PREFIX = "entry:"
CHECK = "__otel_llm_fault__"  # the name of the check an inline entry point gets, in its module's globals


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


def inject(fn, name: str, check):
    """Make the marked entry point `fn` call check(name) inside its guard, before its own code.
    Returns what undoes it (unit tests)."""
    if fn.entry == "wrapper":  # warn.guard's wrapper: the function in its closure
        cell = fn.__closure__[fn.__code__.co_freevars.index("fn")]
        inner = cell.cell_contents

        @functools.wraps(inner)
        def checked(*args, **kwargs):
            check(name)
            return inner(*args, **kwargs)

        cell.cell_contents = checked
        return lambda: setattr(cell, "cell_contents", inner)
    target = inspect.unwrap(fn)  # (a @contextmanager's generator function)
    tree = ast.parse(textwrap.dedent(inspect.getsource(target)))
    (function,) = tree.body
    function.decorator_list = []
    body = function.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    guarded = body[1 if docstring else 0]
    assert isinstance(guarded, ast.Try), f"{name}: its first statement is not its guard's try"
    guarded.body.insert(0, ast.Expr(ast.Call(ast.Name(CHECK, ast.Load()), [ast.Constant(name)], [])))
    ast.fix_missing_locations(tree)
    ast.increment_lineno(tree, target.__code__.co_firstlineno - 1)
    flags = target.__code__.co_flags & __future__.annotations.compiler_flag
    namespace: dict = {}
    exec(
        compile(tree, target.__code__.co_filename, "exec", flags=flags, dont_inherit=True),  # noqa: S102
        target.__globals__,
        namespace,
    )
    target.__globals__[CHECK] = check
    original, target.__code__ = target.__code__, namespace[function.name].__code__
    return lambda: setattr(target, "__code__", original)


def _check(switch: str):
    """An entry point's fault: raised when its name is active, in the process a `pid=<pid>` line
    of the switch names (if there is one; the API server's: vLLM's engine core runs the metric
    callback too)."""

    def check(name: str) -> None:
        active = _active(switch)
        if name in active and (f"pid={os.getpid()}" in active or not any(a.startswith("pid=") for a in active)):
            _note("hit", name)
            raise InjectedFault(name)

    return check


def _patch_entry_points(switch: str) -> None:
    """Every otel_llm module, as it is imported (now, for those already imported)."""
    import wrapt

    import otel_llm

    check = _check(switch)
    root = os.path.dirname(otel_llm.__file__)
    for directory, _, files in os.walk(root):
        package = ["otel_llm", *os.path.relpath(directory, root).split(os.sep)]
        package = [p for p in package if p != "."]
        for file in files:
            if file.endswith(".py"):
                name = ".".join(package if file == "__init__.py" else [*package, file[:-3]])
                wrapt.register_post_import_hook(functools.partial(_patch_module, check=check), name)


_injected: set[int] = set()


def _patch_module(module, check) -> None:
    from otel_llm.warn import entry_points

    for qualified, fn in entry_points(module):
        if id(fn) in _injected:
            continue
        _injected.add(id(fn))
        name = f"{ENTRY_PREFIX}{module.__name__}:{qualified}"
        inject(fn, name, check)
        _note("registered", name)
        _note("what", f"{name} {fn.what}")


def install() -> None:
    switch = os.environ.get(SWITCH_ENV)
    if not switch:
        return
    _patch_guards(switch)
    _patch_entry_points(switch)
    for target in filter(None, (t.strip() for t in os.environ.get(TARGETS_ENV, "").split(","))):
        _patch_function(target, switch)
