"""Imported once by the pool's fork server, so every worker forks warm.

The first math-verify call builds parsers and sympy caches (hundreds of milliseconds); doing it
here, before any fork, makes a replacement worker ready in milliseconds after a kill.
"""

from __future__ import annotations

import contextlib

from vime_reward import worker  # noqa: F401 - the worker code itself, imported before forking
from vime_reward.functions import BUILTINS

with contextlib.suppress(Exception):
    math = BUILTINS["math"]
    if math.score is not None:
        math.score("so \\boxed{\\frac{1}{2}}", "0.5", math.options())
