"""Code that runs inside an engine: in its worker (vLLM's ``--worker-extension-cls``, or the
reference engine's, which takes the same flag) and, for vLLM, in its API server (`serve`, the
command vime starts vLLM with, adds `compact_generate`'s route)."""
