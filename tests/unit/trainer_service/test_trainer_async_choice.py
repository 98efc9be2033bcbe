"""The async mode's choice of the batch to train: the newest within ``max_staleness`` of the
trainer's version, every other waiting batch dropped."""

from __future__ import annotations

from vime_trainer.async_batches import choose

from vime.queue_waiting import StreamEntry


def _e(rollout_id: int, oldest: int) -> StreamEntry:
    return StreamEntry(f"{rollout_id}-0", f"r:{rollout_id}:0", rollout_id, oldest, 8, {})


def test_the_newest_fresh_batch_is_trained_and_the_others_dropped() -> None:
    waiting = [_e(4, 3), _e(5, 4), _e(6, 5)]
    chosen, dropped = choose(waiting, version=5, max_staleness=1)
    assert chosen == _e(6, 5) and dropped == [_e(4, 3), _e(5, 4)]  # 5 − 4 = 1 is fresh, but older
    chosen, dropped = choose(waiting[:1], version=5, max_staleness=2)
    assert chosen == _e(4, 3) and dropped == []  # staleness exactly the bound: trained


def test_nothing_fresh_drops_everything_and_nothing_waiting_drops_nothing() -> None:
    chosen, dropped = choose([_e(1, 1), _e(2, 2)], version=5, max_staleness=2)
    assert chosen is None and dropped == [_e(1, 1), _e(2, 2)]
    assert choose([], version=5, max_staleness=1) == (None, [])


def test_a_newer_batch_with_an_older_token_is_dropped_for_an_older_fresh_one() -> None:
    """A continued partial sample can make a later batch staler than an earlier one."""
    chosen, dropped = choose([_e(7, 6), _e(8, 4)], version=7, max_staleness=1)
    assert chosen == _e(7, 6) and dropped == [_e(8, 4)]
