"""Alerts of a long training run: a stalled step or a non-finite loss stops it, loudly.

An alert prints one ``ALERT`` line to stderr, writes ``<out>/train/alert.json`` (so the launcher
can tell an alert from a crash, also through torchrun), POSTs the same JSON to the optional
webhook, and ends the process with exit code 4 (`onboarding.errors.EXIT_ALERT`). A stall is no
finished step for ``stall_timeout`` seconds, watched by a daemon thread: a hung collective or a
dead peer never returns, so the step loop itself could not notice. The non-finite check runs on
the world-mean loss, before the step's checkpoint, so the last checkpoint is a finite one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from onboarding.errors import EXIT_ALERT

ALERT_FILE = "alert.json"


def post_json(url: str, payload: dict, timeout: float = 10.0) -> str | None:
    """POST ``payload`` as JSON; returns None when it was delivered, else why not."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
    except OSError as exc:  # URLError, timeouts, refused connections
        return str(exc)


class Alerts:
    """Watchdog and loss check of one training process (rank ``rank`` of run ``out``)."""

    def __init__(self, out: Path, *, rank: int = 0, stall_timeout: float = 0.0,
                 webhook: str | None = None, run: str = "",
                 exit_fn: Callable[[int], None] | None = None):
        self.out, self.rank, self.timeout, self.webhook = Path(out), rank, stall_timeout, webhook
        self.run, self.exit_fn = run, exit_fn
        self.step = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._fired = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> Alerts:
        self._last = time.monotonic()
        if self.timeout > 0:
            self._thread = threading.Thread(target=self._watch, name="onboard-stall-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def progress(self, step: int) -> None:
        """A step finished: the stall clock restarts."""
        self.step, self._last = step, time.monotonic()

    def check_loss(self, step: int, loss: float) -> None:
        if not math.isfinite(loss):
            self.fire("nonfinite_loss", f"step {step}: loss is {loss}; no checkpoint of this "
                      "step is written, resume continues from the last finite one", step=step,
                      loss=str(loss))

    def _watch(self) -> None:
        tick = min(1.0, max(self.timeout / 10, 0.01))
        while not self._stop.wait(tick):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                self.fire("stall", f"no step finished for {idle:.1f} s (stall timeout "
                          f"{self.timeout:g} s) after step {self.step}", step=self.step + 1,
                          idle_s=round(idle, 3))
                return

    def fire(self, kind: str, message: str, **details) -> None:
        """Log, record, notify and exit with `EXIT_ALERT` (once per process)."""
        if not self._fired.acquire(blocking=False):
            return
        payload = {"alert": kind, "message": message, "run": self.run, "rank": self.rank,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                   "exit_code": EXIT_ALERT, **details}
        print(f"ALERT [{kind}] rank {self.rank}: {message} (exit {EXIT_ALERT})",
              file=sys.stderr, flush=True)
        if self.rank == 0 or kind == "stall":
            try:
                self.out.mkdir(parents=True, exist_ok=True)
                (self.out / ALERT_FILE).write_text(json.dumps(payload, indent=1) + "\n")
            except OSError as exc:
                print(f"ALERT: could not write {self.out / ALERT_FILE}: {exc}", file=sys.stderr,
                      flush=True)
        if self.webhook:
            why = post_json(self.webhook, payload)
            print(f"ALERT: webhook {self.webhook}: " + ("delivered" if why is None
                                                        else f"not delivered ({why})"),
                  file=sys.stderr, flush=True)
        sys.stdout.flush()
        (self.exit_fn or os._exit)(EXIT_ALERT)  # os._exit: a watchdog thread ends the process
