#!/usr/bin/env bash
# Rebuild the git-ignored folders an H200 device call carries, on this (CPU) machine, from the
# package registries. A new checkout has none of them; each script under .ci/h200/ names the ones
# it needs in its header ("carry: ...").
#   bash .ci/h200/carry.sh [whl] [fla] [anchors]      (no argument: all three)
#   .whl/      langgraph, optuna, openai and their needs, which the device image lacks
#              (../shared/tools/gpu-wheels; installed on the device by setup.sh)
#   .whl_fla/  fla-core 0.6.0 without dependencies: the flash-linear-attention anchor, put on the
#              path only by the steps that ask for it (setup.sh's $FLA_SITE)
#   .anchors/  mamba-ssm 2.3.2.post1's Python source tree (PyPI's sdist; its CUDA extensions are
#              not built: the bench loads only its Triton SSD, without the package __init__) and
#              .anchors/wheels/einops-*.whl
# Each folder is listed in .git/info/exclude, so git never tracks it; an existing folder is
# replaced only when named (or with no argument).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
want=("$@"); [ ${#want[@]} -eq 0 ] && want=(whl fla anchors)
exclude() { grep -qx "$1" .git/info/exclude 2>/dev/null || echo "$1" >> .git/info/exclude; }
fetch_nodeps() {  # fetch_nodeps DIR SPEC...: wheels only, no dependencies, for the image's Python 3.12
  local dir=$1; shift
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" "$@"
}
for w in "${want[@]}"; do
  case "$w" in
    whl) ../shared/tools/gpu-wheels ;;
    fla)
      exclude '/.whl_fla/'; rm -rf .whl_fla; mkdir -p .whl_fla
      fetch_nodeps .whl_fla fla-core==0.6.0
      echo ".whl_fla: $(ls .whl_fla)" ;;
    anchors)
      exclude '/.anchors/'; rm -rf .anchors; mkdir -p .anchors/wheels
      tmp=$(mktemp -d)
      # the sdist from the index's simple page: `pip download` of it would run its setup.py (torch, CUDA)
      python3 - "$tmp" <<'PY'
import re, sys, urllib.request
page = urllib.request.urlopen("https://pypi.org/simple/mamba-ssm/").read().decode()
url = next(u for u in re.findall(r'href="([^"]+)"', page) if "mamba_ssm-2.3.2.post1.tar.gz" in u).split("#")[0]
urllib.request.urlretrieve(url, f"{sys.argv[1]}/mamba_ssm-2.3.2.post1.tar.gz")
PY
      tar -xzf "$tmp"/mamba_ssm-*.tar.gz -C "$tmp"
      cp -r "$tmp"/mamba_ssm-*/mamba_ssm .anchors/
      rm -rf "$tmp"
      fetch_nodeps .anchors/wheels einops==0.8.2
      echo ".anchors: $(find .anchors -name '*.py' | wc -l) Python files, $(ls .anchors/wheels)" ;;
    *) echo "unknown folder '$w' (whl, fla or anchors)" >&2; exit 2 ;;
  esac
done
du -sh .whl .whl_fla .anchors 2>/dev/null || true
echo "the device call's carry limit is 64 MiB in all"
