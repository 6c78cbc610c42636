"""A tuning run's shared workers and open searches.

`shared_workers` gives every study inside it (`search.tune_module`, its re-timing) worker
subprocesses from one `WorkerPool`, and an `OpenSearches` board where a run's study thread with no
study left to start (`run.tune_run`) joins a search still running as one more worker.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable

from onboarding.tune.worker import WorkerPool

# Set by `shared_workers`: the pool the objectives of the studies inside it take their workers from.
_POOL: contextvars.ContextVar[WorkerPool | None] = contextvars.ContextVar("tune_worker_pool", default=None)


class Search:
    """A study's search in flight, as helpers see it (`OpenSearches`)."""

    def __init__(self, join: Callable[[], int]) -> None:
        self.join = join
        self.helpers = 0  # helper threads in it now
        self.done = False  # nothing more to claim, or its own workers ended


class OpenSearches:
    """The searches of a run's studies still claiming trials. A study thread with no study left
    to start (`tune_run`'s slots) joins one as one more worker (`help`), so the heavy studies,
    whose trials each build for tens of seconds, get the cores the light ones leave when they
    end: on an H100 nine of the example's eleven studies ran their 30 trials in 33-65 s of a 90 s
    budget while moe_experts and gated_delta ran 3 and 4 (docs/LOG.md, forty-sixth session)."""

    MAX_HELPERS = 3  # per search: each helper's worker holds its own timing inputs on the GPU

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open: list[Search] = []

    def add(self, search: Search) -> None:
        with self.lock:
            self.open.append(search)

    def close(self, search: Search) -> None:
        with self.lock:
            search.done = True
            if search in self.open:
                self.open.remove(search)

    def _pick(self) -> Search | None:
        """The open search with the fewest helpers, then the first opened: `tune_run` starts its
        studies heaviest first (by the roofline time of the blocks each serves), and a light
        study that started late ends soon without help. (By fewest trials run, helpers went to
        the last, lightest study of the CPU's `onboard tune --parallel 6 --trials 3`.)"""
        with self.lock:
            live = [x for x in self.open if x.helpers < self.MAX_HELPERS]  # (closed: not there)
            if not live:
                return None
            pick = min(live, key=lambda x: (x.helpers, self.open.index(x)))
            pick.helpers += 1
            return pick

    def help(self, stop: threading.Event | None = None) -> int:
        """Join open searches, one after another, until none takes a helper; the trials run."""
        ran = 0
        while stop is None or not stop.is_set():
            pick = self._pick()
            if pick is None:
                return ran
            try:
                n = pick.join()
            finally:
                with self.lock:
                    pick.helpers -= 1
            ran += n
            if n == 0:  # nothing left to claim there
                self.close(pick)
        return ran


_SEARCHES: contextvars.ContextVar[OpenSearches | None] = contextvars.ContextVar(
    "tune_open_searches", default=None)


@contextlib.contextmanager
def shared_workers():
    """Within it, every study (`tune_module`, its re-timing) takes its worker subprocesses from one
    `WorkerPool` and gives them back when done, so a run of many studies starts each kind of worker
    once per worker thread instead of once per study; the pool's workers end with the outermost
    block (an inner one, e.g. `tune_buckets` called inside a run's, keeps the outer pool)."""
    outer = _POOL.get()
    if outer is not None:
        yield outer
        return
    pool = WorkerPool()
    token, board = _POOL.set(pool), _SEARCHES.set(OpenSearches())
    try:
        yield pool
    finally:
        _SEARCHES.reset(board)
        _POOL.reset(token)
        pool.close()


def current_pool() -> WorkerPool | None:
    """The pool of the innermost `shared_workers` block, or None outside one."""
    return _POOL.get()


def open_searches() -> OpenSearches | None:
    """The run's open searches (within `shared_workers`), for `tune_run`'s idle study threads."""
    return _SEARCHES.get()
