"""``python -m vime_rollout.reference_engine``: start the CPU stand-in for vLLM on a port."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import get_args

from .sampler import LogprobsMode

DESCRIPTION = (
    "vime reference engine: the CPU stand-in for vLLM. Serves vLLM 0.26's HTTP API "
    "(/inference/v1/generate, /sleep, /wake_up, /pause, /resume, weight updates, ...) with a "
    "Hugging Face causal LM on CPU. Not a GPU engine: on a GPU host run `vllm serve`."
)


def _bytes(text: str) -> int:
    """``4G``, ``512M``, ``1048576``: a byte count as vLLM's --kv-cache-memory-bytes takes it."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from exc


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vime_rollout.reference_engine", description=DESCRIPTION)
    p.add_argument("--model", required=True, type=Path, help="Hugging Face model directory (safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (keep it private)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="model name in responses (default: --model)")
    p.add_argument(
        "--max-batch", type=int, default=256, help="most sequences decoded in one pass (max_num_seqs)"
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context limit (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--prefill-token-budget", type=int, default=8192, help="padded tokens per prefill pass")
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=_bytes,
        default=4 << 30,
        help="most memory the KV cache may take (e.g. 4G); fewer sequences run at once above it",
    )
    p.add_argument(
        "--logprobs-mode",
        choices=get_args(LogprobsMode),
        default="raw_logprobs",
        help="what the reported log-probs are, as vLLM's flag: before temperature and top-k/top-p "
        "(raw_logprobs, the default) or of the distribution sampled from (processed_logprobs)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="weights and KV cache dtype (vLLM's --dtype); pushed weights are cast to it",
    )
    p.add_argument(
        "--worker-extension-cls",
        default=None,
        help="module.Class mixed into the engine's worker, its methods callable by POST /collective_rpc "
        "(vLLM's flag; vime's direct weight load: vime_rollout.vllm_ext.direct_load.DirectLoadExtension)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--log-level", default="warning")
    args = p.parse_args(argv)
    if args.max_batch < 1:
        p.error("--max-batch must be >= 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        p.error("--max-model-len must be >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import torch

    from .app import build_app, served_model
    from .engine_core import EngineCore
    from .model_runner import ModelRunner
    from .server import run
    from .tokenizer import load_tokenizer
    from .worker import build_worker

    if args.threads:
        torch.set_num_threads(args.threads)
    runner = ModelRunner(
        args.model,
        max_slots=args.max_batch,
        max_model_len=args.max_model_len,
        dtype=getattr(torch, args.dtype),
    )
    worker = build_worker(runner, args.worker_extension_cls)
    smallest = runner.kv.projected_nbytes(1, runner.max_model_len)
    if smallest > args.kv_cache_memory_bytes:
        raise SystemExit(
            f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes} cannot hold one sequence of "
            f"max_model_len={runner.max_model_len} ({smallest} bytes): raise it or lower --max-model-len"
        )
    tokenizer = load_tokenizer(args.model)
    if tokenizer.eos_id is not None:
        runner.eos_ids.add(tokenizer.eos_id)
    served = served_model(args.model, args.served_model_name, runner.max_model_len, runner.vocab_size)

    def core() -> EngineCore:
        return EngineCore(
            runner,
            max_batch=args.max_batch,
            seed=args.seed,
            prefill_token_budget=args.prefill_token_budget,
            kv_cache_bytes=args.kv_cache_memory_bytes,
            decode_text=tokenizer.decode,
            logprobs_mode=args.logprobs_mode,
            worker=worker,
        )

    run(build_app(core, served), args.host, args.port, args.log_level)


if __name__ == "__main__":
    main()
