"""Container health check: exit 0 when ``GET http://127.0.0.1:PORT/health`` answers 200.

Images carry no curl; this uses only the standard library so the same check works in the slim,
CPU and GPU images (compose ``healthcheck`` runs it; Kubernetes probes call /health directly).
Usage: ``python healthcheck.py PORT [PATH]``.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    """Probe the local service once; print why when it is not healthy."""
    if not argv or not argv[0].isdigit():
        print("usage: healthcheck.py PORT [PATH]", file=sys.stderr)
        return 2
    path = argv[1] if len(argv) > 1 else "/health"
    url = f"http://127.0.0.1:{argv[0]}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            ok = resp.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1
    if not ok:
        print(f"{url}: HTTP {resp.status}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
