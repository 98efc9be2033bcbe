"""Code that runs inside vLLM's worker processes (``vllm serve --worker-extension-cls ...``)."""
