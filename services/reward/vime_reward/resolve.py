"""Which reward function a request names, and whether the request fits it (else a 4xx, before any work).

The function is, in order: the request's ``fn``, the batch's ``fn``, the service's
``custom_rm_path``, the sample's ``metadata.rm_type``, the service's ``rm_type`` (slime's order).
A user function (an import path) must be one the service was configured with at start
(`allowed_user_functions`): a request never names code to import. Allowed import paths are
checked by importing them once in a pool worker (never in the service process); what the import
found is remembered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from vime.config import RewardConfig
from vime.service import ServiceError
from vime.wire.reward import RewardRequest
from vime_reward.functions import BUILTINS, RewardFunction
from vime_reward.functions.user import is_import_path
from vime_reward.pool import WorkerPool


@dataclass(frozen=True)
class Target:
    """A resolved reward function: a built-in, or a user function's import path."""

    name: str
    builtin: RewardFunction | None = None
    is_async: bool = False

    @property
    def in_pool(self) -> bool:
        return self.builtin is None or self.builtin.score is not None


@dataclass
class Job:
    """One request, checked and ready to score."""

    req: RewardRequest
    target: Target
    options: dict[str, Any]
    """Validated options (built-ins: with defaults filled in)."""
    parsed_options: BaseModel | None = None


def known_names() -> list[str]:
    return sorted(BUILTINS)


def allowed_user_functions(cfg: RewardConfig) -> frozenset[str]:
    """The import paths requests may name: ``allowed_functions``, ``custom_rm_path``, and
    ``rm_type`` when it is an import path."""
    named = [*cfg.allowed_functions, cfg.custom_rm_path, cfg.rm_type]
    return frozenset(n for n in named if n and is_import_path(n))


class Resolver:
    """Turns requests into `Job`s, raising `ServiceError` 400/422 for what cannot be scored."""

    def __init__(self, cfg: RewardConfig, pool: WorkerPool) -> None:
        self.cfg = cfg
        self.pool = pool
        self.allowed = allowed_user_functions(cfg)
        self._user: dict[str, Target] = {}

    @property
    def default_name(self) -> str:
        return self.cfg.custom_rm_path or self.cfg.rm_type

    def choose(self, req: RewardRequest, batch_fn: str | None = None) -> str:
        """The function name a request asks for (see the module docstring for the order)."""
        if req.fn or batch_fn:
            return str(req.fn or batch_fn)
        if self.cfg.custom_rm_path:
            return self.cfg.custom_rm_path
        rm_type = req.metadata.get("rm_type")
        return rm_type if isinstance(rm_type, str) and rm_type else self.cfg.rm_type

    async def target(self, name: str, where: str = "fn") -> Target:
        """The function called ``name``: 400 naming the known ones when there is none."""
        builtin = BUILTINS.get(name)
        if builtin is not None:
            return Target(name, builtin)
        if name in self._user:
            return self._user[name]
        if not is_import_path(name):
            raise ServiceError(
                400,
                f"{where}: unknown reward function {name!r}; known: {', '.join(known_names())}, "
                "or a user function as package.module:function",
                known=known_names(),
            )
        if name not in self.allowed:
            raise ServiceError(
                403,
                f"{where}: reward function {name!r} is not allowed: user functions are named at start "
                "(reward.custom_rm_path, reward.allowed_functions), never by a request",
                allowed=sorted(self.allowed),
            )
        result = await self.pool.run({"kind": "resolve", "fn": name}, self.cfg.timeout_s)
        if result.status != "ok":
            raise ServiceError(400, f"{where}: cannot load reward function {name}: {result.error}")
        target = Target(name, None, bool(result.reply["value"].get("is_async")))
        self._user[name] = target
        return target

    async def job(
        self, req: RewardRequest, *, authorized: bool, where: str = "", batch_fn: str | None = None
    ) -> Job:
        """Check ``req`` against its function; 400 for an unknown function, 422 for a bad fit.

        An import path outside the allowed ones is 403, before anything is imported. Without
        ``authorized`` (the bearer token) a request may not name an allowed import path or a remote
        URL other than the configured ones: 401, before anything is loaded.
        """
        name = self.choose(req, batch_fn)
        if (
            not authorized
            and name in self.allowed
            and name not in (self.cfg.custom_rm_path, self.cfg.rm_type)
        ):
            raise ServiceError(401, f"{where}fn: naming a user function needs the bearer token")
        target = await self.target(name, f"{where}fn")
        spec = target.builtin
        if spec is None:
            return Job(req, target, dict(req.options))
        if spec.needs_label and req.label is None:
            raise ServiceError(422, f"{where}label: the {spec.name} reward function needs a label")
        if spec.needs_text and req.response is None:
            raise ServiceError(
                422,
                f"{where}response: the {spec.name} reward function needs the response text, not only token ids",
            )
        if spec.check_label is not None and (problem := spec.check_label(req.label)):
            raise ServiceError(422, f"{where}label: {problem}")
        try:
            parsed = spec.options.model_validate(req.options)
        except ValidationError as exc:
            problems = [
                f"{where}options.{'.'.join(str(p) for p in e['loc']) or '?'}: {e['msg']}"
                for e in exc.errors()
            ]
            raise ServiceError(422, "invalid options: " + "; ".join(problems), fields=problems) from None
        url = getattr(parsed, "url", None)
        if spec.name == "remote" and url and url != self.cfg.remote_url and not authorized:
            raise ServiceError(
                401, f"{where}options.url: sending samples to another URL needs the bearer token"
            )
        return Job(req, target, parsed.model_dump(mode="json"), parsed)
