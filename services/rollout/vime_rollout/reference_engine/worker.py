"""The reference engine's worker: what ``POST /collective_rpc`` calls methods on, as in vLLM.

vLLM runs ``collective_rpc`` methods on each of its workers and mixes the class named by
``--worker-extension-cls`` into the worker class, so an extension's methods become callable. The
reference engine has one worker; it offers an extension what vLLM's does — ``model_runner``
(whose model is ``model_runner.model``), ``device`` and ``vllm_config`` (None: nothing quantised
or split) — so the same extension class runs on both.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from .model_runner import ModelRunner


class ReferenceWorker:
    """The worker of a reference engine; subclassed with the extension when one is configured."""

    def __init__(self, runner: ModelRunner) -> None:
        self.model_runner = runner
        self.device = torch.device("cpu")
        self.vllm_config: Any = None


def resolve_qualname(qualname: str) -> type:
    """``package.module.Class`` → the class (vLLM's ``resolve_obj_by_qualname``)."""
    module, _, name = qualname.rpartition(".")
    if not module:
        raise ValueError(f"--worker-extension-cls must be module.Class, got {qualname!r}")
    obj = getattr(importlib.import_module(module), name)
    if not isinstance(obj, type):
        raise ValueError(f"{qualname} is not a class")
    return obj


def build_worker(runner: ModelRunner, extension: str | None) -> ReferenceWorker:
    """The worker, with the extension's methods mixed in when ``extension`` names one."""
    if not extension:
        return ReferenceWorker(runner)
    ext = resolve_qualname(extension)
    clash = sorted(a for a in dir(ext) if not a.startswith("__") and hasattr(ReferenceWorker, a))
    if clash:
        raise ValueError(f"{extension} redefines worker attributes {clash}")
    cls = type("ReferenceWorker", (ReferenceWorker, ext), {})
    worker: ReferenceWorker = cls(runner)
    return worker
