"""Waiting and retrying, one way for the whole repo (tenacity underneath).

- `poll_until` / `poll_until_blocking`: call a check every ``interval_s`` until it returns something
  truthy, and return that; after ``timeout_s`` (None: never) raise `TimeoutError` naming what was
  awaited. An exception raised by the check ends the wait at once.
- `RetryPolicy`: how a client sends a call again: exponential backoff with jitter, bounded by a
  number of attempts, a time budget, or both. Which failures may be retried is the caller's
  decision (`vime.clients.base`: only what cannot have been processed, or idempotent calls).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    stop_any,
    stop_never,
    wait_exponential_jitter,
    wait_fixed,
)

log = logging.getLogger("vime.retry")

T = TypeVar("T")


def _polling(timeout_s: float | None, interval_s: float, what: str) -> dict[str, Any]:
    """What `AsyncRetrying` / `Retrying` take to poll: retry while the result is falsy."""

    def raise_timeout(state: RetryCallState) -> NoReturn:
        raise TimeoutError(f"{what}: not after {timeout_s:g}s ({state.attempt_number} checks)")

    return {
        "stop": stop_never if timeout_s is None else stop_after_delay(timeout_s),
        "wait": wait_fixed(interval_s),
        "retry": retry_if_result(lambda value: not value),
        "retry_error_callback": raise_timeout,
    }


async def poll_until(
    check: Callable[[], Awaitable[T | None]], *, timeout_s: float | None, interval_s: float, what: str
) -> T:
    """Await ``check()`` every ``interval_s`` until it returns a truthy value, and return it."""

    async def attempt() -> T | None:  # awaited here: tenacity would not await a plain callable's result
        return await check()

    return cast(T, await AsyncRetrying(**_polling(timeout_s, interval_s, what))(attempt))


def poll_until_blocking(
    check: Callable[[], T | None], *, timeout_s: float | None, interval_s: float, what: str
) -> T:
    """`poll_until` for code that is not async (the check and the sleeps block the thread)."""
    return cast(T, Retrying(**_polling(timeout_s, interval_s, what))(check))


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    log.debug("attempt %d failed (%s); retrying", state.attempt_number, exc)


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff from ``backoff_s`` doubling up to ``max_backoff_s`` (with up to ``backoff_s`` of
    jitter), until ``attempts`` calls were made or ``budget_s`` seconds passed (None: no such bound;
    with both None it retries forever)."""

    attempts: int | None = 4
    budget_s: float | None = None
    backoff_s: float = 0.2
    max_backoff_s: float = 4.0

    def retrying(self, retryable: Callable[[BaseException], bool]) -> AsyncRetrying:
        """An `AsyncRetrying` that re-runs its block on the exceptions ``retryable`` accepts and
        re-raises the last one when the policy is spent."""
        stops: list[Any] = []
        if self.attempts is not None:
            stops.append(stop_after_attempt(self.attempts))
        if self.budget_s is not None:
            stops.append(stop_after_delay(self.budget_s))
        return AsyncRetrying(
            stop=stop_any(*stops) if stops else stop_never,
            wait=wait_exponential_jitter(
                initial=self.backoff_s, max=self.max_backoff_s, jitter=self.backoff_s
            ),
            retry=retry_if_exception(retryable),
            before_sleep=_log_retry,
            reraise=True,
        )
