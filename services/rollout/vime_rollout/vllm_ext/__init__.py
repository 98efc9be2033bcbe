"""Code that runs inside an engine's worker: vLLM's (``vllm serve --worker-extension-cls ...``), or the
reference engine's, which takes the same flag."""
