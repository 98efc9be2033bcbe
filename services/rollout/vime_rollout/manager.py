"""The rollout manager: owns the engines, the data sources and the batch sinks, and runs rollouts
(and publishes the trainer's supervised warm-up batches, `vime_rollout.sft`).

One rollout at a time (seed steps 14–32): refuse while engines sleep (or, for training, while
admission is paused), run
the loop, hand aborted groups back (partial rollout), build and publish the batch. A rollout that
fails restores the data source's position, so its prompts are not lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from vime.config import RunConfig
from vime.service import ServiceError
from vime.wire.rollout import RolloutJob, SftBatch
from vime_rollout.batch_builder import BatchSink, build_batch
from vime_rollout.data import DataSource, PromptDataset
from vime_rollout.engines.group import EngineGroup
from vime_rollout.engines.health import HealthMonitor
from vime_rollout.filters import load_function
from vime_rollout.jobs import JobRegistry
from vime_rollout.preview import preview_samples
from vime_rollout.producer import Producer
from vime_rollout.rollout.loop import RolloutOutput, generate_rollout
from vime_rollout.rollout.metrics import engine_request_metrics, eval_metrics, rollout_metrics
from vime_rollout.rollout.state import GenerateState, Generator, SamplingSettings, Scorer
from vime_rollout.sft import SftExamples, build_sft_batch

log = logging.getLogger("vime.rollout.manager")


class Admission:
    """Whether new training rollouts may start (seed steps 9, 44, 53); evals are not gated. The
    async producer waits on it before each rollout and each round of groups (`wait_open`)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @paused.setter
    def paused(self, value: bool) -> None:
        if value:
            self._open.clear()
        else:
            self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()

    def pause(self) -> bool:
        """Step 44 (`pause_rollout_admission`): pause; returns whether admission already was
        paused (``was_paused``), in which case step 53 leaves it paused."""
        was_paused, self.paused = self.paused, True
        return was_paused

    def resume(self, was_paused: bool) -> None:
        """Step 53 (`resume_rollout_admission`): undo step 44's pause unless it found admission
        paused already (``was_paused`` True: nothing of ours to undo)."""
        if not was_paused:
            self.paused = False


class RolloutManager:
    """Everything a rollout needs, wired together; the REST app calls into it."""

    def __init__(
        self,
        cfg: RunConfig,
        *,
        run_id: str,
        tokenizer: Any,
        model_name: str,
        engines: EngineGroup,
        monitor: HealthMonitor,
        generator: Generator,
        scorer: Scorer,
        train_data: DataSource,
        eval_data: dict[str, PromptDataset],
        sink: BatchSink | None,
        sft_sink: BatchSink | None = None,
    ) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.engines = engines
        self.monitor = monitor
        self.generator = generator
        self.scorer = scorer
        self.data = train_data
        self.state_before_rollout: dict[str, Any] | None = None
        """The data source's position when the training rollout under way began."""
        self.eval_data = eval_data
        self.sink = sink
        self.sft_sink = sft_sink
        self.sft = SftExamples(
            train_data.dataset,
            tokenizer,
            label_key=cfg.data.label_key,
            max_response_len=cfg.rollout_max_response_len,
            shuffle=cfg.data.rollout_shuffle,
            seed=cfg.rollout_seed,
        )
        self.jobs = JobRegistry(run_id)
        self.admission = Admission()
        self.producer = Producer(self)
        self.filter = (
            load_function(cfg.dynamic_sampling_filter_path) if cfg.dynamic_sampling_filter_path else None
        )

    # --- rollouts --------------------------------------------------------------------------------
    def check_can_roll_out(self, evaluation: bool = False, publish: bool = True) -> None:
        """409 when engines sleep, or admission is paused for a training rollout.

        A sleeping engine would hang the rollout. Admission (seed steps 44, 53) gates training
        rollouts only: it keeps a new batch from being generated across a weight push. An eval or
        a preview publishes nothing, so it may run while admission stays paused after the last step.
        """
        if self.producer.running and not evaluation:
            raise ServiceError(409, "the async producer is running: it alone rolls out for training")
        if self.admission.paused and not evaluation and publish:
            raise ServiceError(409, "rollout admission is paused: POST /v1/admission/resume first")
        asleep = sorted({t for r in self.engines.live() for t in r.asleep})
        if asleep:
            raise ServiceError(
                409, f"engines are offloaded ({', '.join(asleep)} asleep): POST /v1/engines/onload first"
            )
        if not self.engines.serving() and not (publish and self.engines.coming_back()):
            # A run's rollout waits for an engine coming back (its requests are retried for
            # router.retry_window_s; the trainer pushes weights to it meanwhile); a preview, which
            # no trainer pushes weights for, is refused.
            raise ServiceError(503, "no engine is serving (all dead, restarting or waiting for weights)")

    def state(self, evaluation: bool) -> GenerateState:
        cfg = self.cfg
        sampling = SamplingSettings.for_eval(cfg) if evaluation else SamplingSettings.for_training(cfg)
        return GenerateState(
            cfg=cfg,
            tokenizer=self.tokenizer,
            generator=self.generator,
            scorer=self.scorer,
            model_name=self.model_name,
            sampling=sampling,
            concurrency=cfg.vllm_server_concurrency * max(1, len(self.engines.records)),
            weight_version=lambda: self.engines.current_version,
            evaluation=evaluation,
            abort_engines=self.engines.abort_all,
            continue_aborted=cfg.mode == "async" and cfg.inflight_update == "abort",
            admitted=None if evaluation or cfg.mode != "async" else self.admission.wait_open,
        )

    async def generate(self, job: RolloutJob) -> tuple[RolloutOutput, dict[str, float]]:
        """Seed steps 15–29 for training rollout ``job.rollout_id``: its groups and metrics."""
        cfg = self.cfg
        self.monitor.resume("offload")  # seed step 14: health monitoring resumes with each rollout
        job.weight_version = version = self.engines.current_version
        state = self.state(evaluation=False)
        t0 = time.perf_counter()
        served_before = await self.engines.finished_requests()
        engine_metrics_s = time.perf_counter() - t0
        out = await generate_rollout(
            state,
            job.rollout_id,
            self.data.get_samples,
            target=cfg.rollout_batch_size,
            over_sampling=cfg.over_sampling_batch_size or cfg.rollout_batch_size,
            dynamic_filter=self.filter,
        )
        metrics = rollout_metrics(out.groups, state.counters, out.wall_s)
        t0 = time.perf_counter()
        served_after = await self.engines.finished_requests()
        metrics["rollout/t_engine_metrics_s"] = engine_metrics_s + time.perf_counter() - t0
        metrics.update(engine_request_metrics(served_before, served_after))
        metrics["rollout/weight_version"] = float(version)
        metrics["rollout/prompts_dropped_too_long"] = float(self.data.dataset.num_dropped_too_long)
        return out, metrics

    async def run_preview(self, job: RolloutJob) -> None:
        """A training rollout whose samples come back in the job: nothing is published, and the data
        source's position is restored, so a run started later sees the same prompts as if it never ran."""
        snapshot = self.state_before_rollout = self.data.state_dict()
        try:
            out, metrics = await self.generate(job)
            job.samples = await asyncio.to_thread(preview_samples, self.cfg, out.groups)
        finally:
            self.data.load_state_dict(snapshot)
            self.state_before_rollout = None
        job.num_samples, job.metrics = len(job.samples), metrics
        log.info("rollout %d previewed: %d samples, %.1fs", job.rollout_id, job.num_samples, out.wall_s)

    async def run_training(self, job: RolloutJob, dp_size: int) -> None:
        """Seed steps 15–31 for rollout ``job.rollout_id``, then publish the batch."""
        cfg = self.cfg
        snapshot = self.state_before_rollout = self.data.state_dict()
        job.dp_size = dp_size
        try:
            out, metrics = await self.generate(job)
            version = job.weight_version or 0
            if cfg.partial_rollout and out.aborted_groups:
                self.data.add_samples(out.aborted_groups)
            if self.sink is None:
                raise ServiceError(503, "no Redis configured: the batch cannot be published")
            batch_id = await self.sink.next_batch_id(job.rollout_id)
            t0 = time.perf_counter()
            built = await asyncio.to_thread(
                build_batch,
                cfg,
                out.groups,
                batch_id=batch_id,
                run_id=self.run_id,
                rollout_id=job.rollout_id,
                weight_version=version,
                dp_size=dp_size,
                metrics=metrics,
            )
            t1 = time.perf_counter()
            published = await self.sink.publish(built)
            t2 = time.perf_counter()
        except BaseException:
            self.data.load_state_dict(snapshot)
            raise
        finally:
            self.state_before_rollout = None
        job.batch_id, job.entry_id = published.batch_id, published.entry_id
        job.num_samples = built.batch.num_samples
        job.metrics = {**built.batch.metrics, "rollout/t_build_s": t1 - t0, "rollout/t_publish_s": t2 - t1}
        log.info(
            "rollout %d: batch %s, %d samples, %.1fs",
            job.rollout_id,
            job.batch_id,
            job.num_samples,
            out.wall_s,
        )

    async def run_eval(self, job: RolloutJob) -> None:
        """Every eval dataset, each prompt ``n_samples_per_eval_prompt`` times; nothing is published."""
        if not self.eval_data:
            raise ServiceError(400, "no eval dataset configured (data.eval_prompt_data)")
        metrics: dict[str, float] = {}
        job.weight_version = self.engines.current_version
        for name, dataset in self.eval_data.items():
            source = DataSource(dataset, self.cfg.data.n_samples_per_eval_prompt, shuffle=False)
            state = self.state(evaluation=True)
            out = await generate_rollout(
                state, job.rollout_id, source.get_samples, target=len(dataset), over_sampling=len(dataset)
            )
            metrics.update(eval_metrics(name, out.groups, out.wall_s))
            job.num_samples += sum(len(g) for g in out.groups)
        job.metrics = metrics

    # --- supervised warm-up ------------------------------------------------------------------------
    async def publish_sft(self, step: int, dp_size: int) -> SftBatch:
        """Warm-up step ``step``: ``global_batch_size`` prompts with their labels, published like a
        rollout's batch (on the ``:sft`` stream). Raises SftLabelError / BatchBuildError for data or
        sizes that cannot make one."""
        samples = self.sft.samples(step, self.cfg.global_batch_size or 0)
        if self.sft_sink is None:
            raise ServiceError(503, "no Redis configured: the warm-up batch cannot be published")
        batch_id = await self.sft_sink.next_batch_id(step)
        built = await asyncio.to_thread(
            build_sft_batch,
            self.cfg,
            samples,
            batch_id=batch_id,
            run_id=self.sft_sink.run_id,
            step=step,
            dp_size=dp_size,
        )
        published = await self.sft_sink.publish(built)
        return SftBatch(
            step=step,
            run_id=self.sft_sink.run_id,
            batch_id=published.batch_id,
            entry_id=published.entry_id,
            num_samples=built.batch.num_samples,
            dp_size=dp_size,
            metrics=dict(built.batch.metrics),
        )

    # --- data-source state -------------------------------------------------------------------------
    def data_state(self) -> dict[str, Any]:
        """The position after the last batch published, a rollout under way excluded (a checkpoint
        saved during it resumes with that rollout's prompts); once the async producer has started,
        its own record of it, with its next rollout id."""
        if self.producer.published_state is not None:
            return self.producer.published_state
        if self.state_before_rollout is not None:
            return self.state_before_rollout
        return self.data.state_dict()

    def set_data_state(self, state: dict[str, Any]) -> None:
        if self.jobs.running is not None or self.producer.running:
            raise ServiceError(409, "a rollout is running: restore the data-source state between rollouts")
        self.producer.published_state = None
        self.data.load_state_dict(state)
        self.jobs.forget_finished()

    async def aclose(self) -> None:
        await self.producer.stop()
        await self.jobs.cancel_all()
        await self.monitor.stop()
        await self.engines.stop()
        for client in (self.generator, self.scorer):
            closer = getattr(client, "aclose", None)
            if closer is not None:
                await closer()
        for sink in (self.sink, self.sft_sink):
            if sink is not None:
                await sink.aclose()
