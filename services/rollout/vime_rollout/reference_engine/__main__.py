"""``python -m vime_rollout.reference_engine``: start the CPU stand-in for vLLM on a port.

Its options carry `vllm serve`'s names, so the rollout manager starts both from one command
builder (`vime_rollout.engines.commands`).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Literal

import typer

from vime.service import serve
from vime.service_cli import run_command, setup_logging

from .sampler import LogprobsMode


def parse_bytes(text: str | int) -> int:
    """``4G``, ``512M``, ``1048576``: a byte count as vLLM's --kv-cache-memory-bytes takes it."""
    if isinstance(text, int):  # the default
        return text
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError as exc:
        raise typer.BadParameter(f"not a byte count: {text!r}") from exc


def main(
    model: Annotated[Path, typer.Option(help="Hugging Face model directory (safetensors).")],
    host: Annotated[str, typer.Option(help="Interface to listen on (keep it private).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port.")] = 8000,
    uds: Annotated[
        str | None, typer.Option(help="Listen on this Unix socket instead of host:port (as vLLM's --uds).")
    ] = None,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name in responses (default: --model).")
    ] = None,
    max_batch: Annotated[
        int, typer.Option(min=1, help="Most sequences decoded in one pass (max_num_seqs).")
    ] = 256,
    max_model_len: Annotated[
        int | None, typer.Option(min=2, help="Context limit (default: the model's).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of unseeded sampling.")] = 0,
    prefill_token_budget: Annotated[int, typer.Option(help="Padded tokens per prefill pass.")] = 8192,
    kv_cache_memory_bytes: Annotated[
        int,
        typer.Option(
            parser=parse_bytes,
            help="Most memory the KV cache may take (e.g. 4G); fewer sequences run at once above it.",
        ),
    ] = 4 << 30,
    logprobs_mode: Annotated[
        LogprobsMode,
        typer.Option(
            help="What the reported log-probs are, as vLLM's flag: before temperature and top-k/top-p "
            "(raw_logprobs) or of the distribution sampled from (processed_logprobs)."
        ),
    ] = "raw_logprobs",
    threads: Annotated[int | None, typer.Option(help="Torch intra-op threads (default: torch's).")] = None,
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"],
        typer.Option(help="Weights and KV cache dtype (vLLM's --dtype); pushed weights are cast to it."),
    ] = "float32",
    worker_extension_cls: Annotated[
        str | None,
        typer.Option(
            help="module.Class mixed into the engine's worker, its methods callable by POST /collective_rpc "
            "(vLLM's flag; vime's direct weight load: vime_rollout.vllm_ext.direct_load.DirectLoadExtension)."
        ),
    ] = None,
    log_level: Annotated[str, typer.Option(help="Python log level.")] = "warning",
) -> None:
    """vime reference engine: the CPU stand-in for vLLM. Serves vLLM 0.26's HTTP API
    (/inference/v1/generate, /sleep, /wake_up, /pause, /resume, weight updates, ...) with a Hugging
    Face causal LM on CPU. Not a GPU engine: on a GPU host run `vllm serve`."""
    setup_logging(log_level)
    import torch

    from .app import build_app, served_model
    from .engine_core import EngineCore
    from .model_runner import ModelRunner
    from .tokenizer import load_tokenizer
    from .worker import build_worker

    if threads:
        torch.set_num_threads(threads)
    runner = ModelRunner(model, max_slots=max_batch, max_model_len=max_model_len, dtype=getattr(torch, dtype))
    worker = build_worker(runner, worker_extension_cls)
    smallest = runner.kv.projected_nbytes(1, runner.max_model_len)
    if smallest > kv_cache_memory_bytes:
        raise SystemExit(
            f"--kv-cache-memory-bytes {kv_cache_memory_bytes} cannot hold one sequence of "
            f"max_model_len={runner.max_model_len} ({smallest} bytes): raise it or lower --max-model-len"
        )
    tokenizer = load_tokenizer(model)
    if tokenizer.eos_id is not None:
        runner.eos_ids.add(tokenizer.eos_id)
    served = served_model(model, served_model_name, runner.max_model_len, runner.vocab_size)

    def core() -> EngineCore:
        return EngineCore(
            runner,
            max_batch=max_batch,
            seed=seed,
            prefill_token_budget=prefill_token_budget,
            kv_cache_bytes=kv_cache_memory_bytes,
            decode_text=tokenizer.decode,
            logprobs_mode=logprobs_mode,
            worker=worker,
        )

    app = build_app(core, served)
    aborting: set[asyncio.Task[int]] = set()

    def abort_all() -> None:
        """Requests held by a pause or a sleep would keep the graceful shutdown waiting for a
        resume that never comes: each gets its normal response with ``finish_reason="abort"``."""
        started = getattr(app.state, "core", None)
        if started is not None:
            task = asyncio.ensure_future(started.abort(None))
            aborting.add(task)  # the loop keeps only a weak reference
            task.add_done_callback(aborting.discard)

    serve(app, host, port, log_level, uds=uds, on_signal=abort_all)


if __name__ == "__main__":
    run_command(main, "python -m vime_rollout.reference_engine")
