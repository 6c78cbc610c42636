# Source this at the start of a device call that must run a commit, not the working tree (other
# engineers' uncommitted edits travel with the tree): unpacks .clean/head.tgz (made here with
# `git archive HEAD | gzip > .clean/head.tgz`, git-ignored, carried with .whl and .whl_fla) to
# /tmp/clean, moves there, and sources setup.sh.
#   source .ci/h200/clean.sh || exit 1      (carry .whl, .whl_fla, .clean)
rm -rf /tmp/clean && mkdir -p /tmp/clean && tar xzf .clean/head.tgz -C /tmp/clean || return 1
cp -r .whl .whl_fla /tmp/clean/ && cd /tmp/clean && git init -q 2>/dev/null
source .ci/h200/setup.sh
