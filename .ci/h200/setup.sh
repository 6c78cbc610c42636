# Source this at the start of an H200 device call (bash), from the repository root:
#   source .ci/h200/setup.sh
# Installs the carried wheels the device image lacks (.whl/, from ../shared/tools/gpu-wheels:
# langgraph, optuna, openai and their needs) into /tmp/site, installs this checkout editable
# (an `onboard` command on PATH), and unpacks fla-core from .whl_fla/ (when carried) to $FLA_SITE,
# which only a step that asks for the anchor puts on its PYTHONPATH. Writes the versions to $OUT/env.txt.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site
# the checkout itself, installed editable as CI does (tests/conftest.py refuses the repo root on sys.path)
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . > /tmp/pip_e.log 2>&1 \
  || { cat /tmp/pip_e.log; return 1; }
# fla-core, an anchor: only on PYTHONPATH where a step asks for it (`WITH_FLA=$FLA_SITE:$PYTHONPATH`)
if ls .whl_fla/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site_fla .whl_fla/*.whl || return 1
  export FLA_SITE=/tmp/site_fla
fi
export PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "${OUT:-/tmp}/env.txt"
import importlib, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda")
for m in ("transformers", "peft", "optuna", "langgraph", "openai", "fla"):
    try:
        print(m, getattr(importlib.import_module(m), "__version__", "?"))
    except Exception as e:
        print(m, "absent:", type(e).__name__)
PY
