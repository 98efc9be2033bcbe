"""User reward functions named by import path (``package.module:function``), sync or async.

They are imported and called only inside pool workers, never in the service process, so a
function that hangs, crashes or calls ``os._exit`` at import or call time costs one worker.
A function receives a `RewardRequest` (a list of them for a group batch) and returns a number,
a bool, or a dict with ``reward``/``score`` (see `as_outcome`).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

_loaded: dict[str, Callable[..., Any]] = {}


def is_import_path(name: str) -> bool:
    """Whether ``name`` looks like ``package.module:function``."""
    return bool(IMPORT_PATH.match(name))


def load(path: str) -> Callable[..., Any]:
    """Import ``package.module:attr.attr`` (cached per process) and check that it is callable."""
    fn = _loaded.get(path)
    if fn is not None:
        return fn
    if not is_import_path(path):
        raise ValueError(f"{path!r} is not an import path of the form package.module:function")
    module_name, _, attrs = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in attrs.split("."):
        obj = getattr(obj, attr)
    if not callable(obj):
        raise TypeError(f"{path} is a {type(obj).__name__}, not a function")
    _loaded[path] = obj
    return obj


def describe(path: str) -> dict[str, Any]:
    """What the service needs to know about a user function: async or not, and its doc line."""
    fn = load(path)
    doc = (inspect.getdoc(fn) or "").strip().splitlines()
    return {"is_async": _is_async(fn), "doc": doc[0] if doc else ""}


def call(path: str, arg: Any) -> Any:
    """Call the function with ``arg``; an async one runs to completion in a fresh event loop."""
    fn = load(path)
    result = fn(arg)
    if inspect.isawaitable(result):
        return asyncio.run(_await(result))
    return result


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _is_async(fn: Callable[..., Any]) -> bool:
    call_method = type(fn).__call__ if not inspect.isfunction(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call_method)
