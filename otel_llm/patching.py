"""Applying a layer's hook table (wrapt), shared by the vLLM and OpenAI layers.

A `Hook` names a function or method by candidate modules (newest library layout first) and the
factory of its wrapt wrapper. At instrument time each hook's module file is looked up without
importing the library (importing vLLM costs seconds); the wrapper is applied by a post-import hook
when the library imports that module. A hook that cannot be found logs one line naming it and what
is lost without it, and the library runs unpatched there. `otel-llm doctor` reads the same tables.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import wrapt
from opentelemetry.instrumentation.utils import unwrap


@dataclass(frozen=True)
class Hook:
    name: str
    modules: tuple[str, ...]  # candidates, newest library layout first
    attribute: str  # "Class.method" or "function"
    factory: Callable[[Any], Callable]  # (the layer's telemetry) -> wrapt wrapper
    purpose: str
    required: bool = True
    # other modules that bind the function by name (`from x import f`) and need the patch too
    aliases: tuple[str, ...] = ()


def module_exists(module: str) -> bool:
    """True if the module's file is there, found without importing the library."""
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])
    if spec is None or not spec.submodule_search_locations:
        return False
    for base in spec.submodule_search_locations:
        path = os.path.join(base, *parts[1:])
        if os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py")):
            return True
    return False


def locate(hook: Hook, resolve: Callable[[str], str | None] | None = None) -> str | None:
    """The first candidate module whose file exists, or the module `resolve` says it stands for
    (an alias shim replacing itself in sys.modules: a post-import hook fires on the name the
    library imports, never on the alias)."""
    module = next((m for m in hook.modules if module_exists(m)), None)
    if module is None or resolve is None:
        return module
    return resolve(module) or module


def has_attribute(module, attribute: str) -> bool:
    obj: Any = module
    for part in attribute.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True


class Patcher:
    def __init__(
        self,
        telemetry,
        hooks: tuple[Hook, ...],
        logger: logging.Logger,
        library: str,
        resolve: Callable[[str], str | None] | None = None,
    ):
        self.telemetry = telemetry
        self.hooks = hooks
        self.log = logger
        self.library = library
        self.resolve = resolve
        self.applied: list[tuple[Any, str]] = []  # (module, attribute) for unwrap
        self.missing: list[str] = []
        self.active = True

    def install(self) -> None:
        for hook in self.hooks:
            module_name = locate(hook, self.resolve)
            if module_name is None:
                self._missing(hook, "module not found: " + " | ".join(hook.modules))
                continue
            wrapt.register_post_import_hook(lambda module, hook=hook: self._apply(hook, module), module_name)

    def _apply(self, hook: Hook, module) -> None:
        if not self.active:
            return
        try:
            if not has_attribute(module, hook.attribute):
                self._missing(hook, f"{module.__name__}.{hook.attribute} not found")
                return
            if isinstance(_lookup(module, hook.attribute), wrapt.FunctionWrapper):
                return  # already ours (instrumented twice)
            wrapt.wrap_function_wrapper(module, hook.attribute, hook.factory(self.telemetry))
            self.applied.append((module, hook.attribute))
            if "." not in hook.attribute:
                patched = getattr(module, hook.attribute)
                for alias in hook.aliases:
                    other = sys.modules.get(alias)
                    if other is not None and hasattr(other, hook.attribute):
                        setattr(other, hook.attribute, patched)
                        self.applied.append((other, hook.attribute))
        except Exception:
            self.log.warning("otel-llm: could not patch %s hook %r", self.library, hook.name, exc_info=True)
            self.missing.append(hook.name)

    def _missing(self, hook: Hook, why: str) -> None:
        self.missing.append(hook.name)
        level = logging.WARNING if hook.required else logging.INFO
        self.log.log(
            level,
            "otel-llm: %s hook %r unavailable (%s); without it: no %s. The application runs on, untraced there.",
            self.library,
            hook.name,
            why,
            hook.purpose,
        )

    def uninstall(self) -> None:
        self.active = False
        for module, attribute in reversed(self.applied):
            parent: Any = module
            *path, name = attribute.split(".")
            for part in path:
                parent = getattr(parent, part)
            unwrap(parent, name)
        self.applied.clear()


def _lookup(module, attribute: str):
    *path, name = attribute.split(".")
    parent: Any = module
    for part in path:
        parent = getattr(parent, part)
    return vars(parent).get(name) if isinstance(parent, type) else getattr(parent, name, None)
