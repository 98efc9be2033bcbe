"""What the trainer reports about the batch it trained, from the summary each DP rank returns of
its share: the seed's split, 4 DP ranks × 64 samples in 8 micro-batches each, and the weight
versions that generated the samples."""

from __future__ import annotations

from vime_trainer.batches import ShareSummary
from vime_trainer.ops import batch_metrics

from tests.unit.test_batch import make_batch, make_samples
from vime.algorithms import build_dp_schedule
from vime.batch import split_by_dp


def test_seed_split_is_reported_per_rank() -> None:
    batch = make_batch(make_samples())
    shares = split_by_dp(batch, build_dp_schedule(batch.total_lengths().tolist(), 256, 8, 4))
    assert batch_metrics([ShareSummary.of(s) for s in shares]) == {
        "batch/samples": 256.0,
        "batch/weight_version_min": 3.0,
        "batch/weight_version_max": 4.0,
        "batch/first_weight_version_min": 3.0,  # no sample was updated in flight
        "batch/dp_ranks": 4.0,
        "batch/rank_samples_min": 64.0,
        "batch/rank_samples_max": 64.0,
        "batch/rank_micro_batches_min": 8.0,
        "batch/rank_micro_batches_max": 8.0,
    }


def test_micro_batches_count_every_optimizer_step_of_the_rollout() -> None:
    batch = make_batch(make_samples(n=64))  # two steps of 32 per rollout, 2 DP ranks, micro 8
    shares = split_by_dp(batch, build_dp_schedule(batch.total_lengths().tolist(), 32, 8, 2))
    m = batch_metrics([ShareSummary.of(s) for s in shares])
    assert (m["batch/dp_ranks"], m["batch/rank_samples_min"], m["batch/rank_samples_max"]) == (2, 32, 32)
    assert m["batch/rank_micro_batches_min"] == m["batch/rank_micro_batches_max"] == 4  # 2 per step
