"""The vime reference engine: the CPU stand-in for vLLM.

It serves vLLM 0.26's HTTP API — the token-in/token-out ``POST /inference/v1/generate``, the
sleep/wake and pause/resume routes, the weight-update routes — with vLLM's JSON shapes, running a
Hugging Face causal LM with torch on CPU (fp32). It exists so that the rollout manager, the
trainer and their tests run unchanged on machines without a GPU; on a GPU host the real
``vllm serve`` is used instead, and ``tests/contract`` runs the same checks against both.

What it does like vLLM: continuous batching (hundreds of requests in flight, one forward pass per
step for all of them, with a KV cache), log-probs of the sampled tokens raw or after temperature and
top-k/top-p (``--logprobs-mode``, vLLM's flag and default), sleep levels 1 and 2
that really free memory, requests held while asleep or paused, pause modes abort/wait/keep.
What is its own: weights arrive as safetensors files (``{"backend": "shm", "path": ...}``), since
CUDA IPC handles cannot be opened on a CPU; with ``--worker-extension-cls`` (vLLM's flag) the
extension's methods answer ``/collective_rpc``, so vime's direct weight load runs here over
shared-memory staging buffers. Start it with
``python -m vime_rollout.reference_engine --model DIR --port P``.
"""
