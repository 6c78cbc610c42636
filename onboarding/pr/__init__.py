"""The pr stage: a reviewable kernel PR per run. `collect` reads what a run directory proposes
(passing, self-contained modules only), `body` writes PR.md from the run's recorded rows,
`testgen` the test each module is committed with, `branch` the git side (create, list, show,
diff, approve, reject, push) through `git -C <repo>` and temporary worktrees."""

from onboarding.pr.branch import (PRRecord, approve, create_pr, default_repo, diff, list_prs,
                                  load_records, push, reject, resolve, show_body)
from onboarding.pr.collect import Proposal, collect, foreign_imports
from onboarding.pr.git import Git

__all__ = ["Git", "PRRecord", "Proposal", "approve", "collect", "create_pr", "default_repo",
           "diff", "foreign_imports", "list_prs", "load_records", "push", "reject", "resolve",
           "show_body"]
