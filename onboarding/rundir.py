"""Run directories: ``runs/<model>-<timestamp>/`` holding every artifact and the checkpoint.

The one place of the rule "bad input leaves nothing behind": `check_out` refuses an unusable
``--out`` before any work, `owned_dir` creates the directory, holds its lock (two processes never
write one run) and removes what it created when the command fails on bad input or is interrupted
(a resumable run is kept), never anything that was there before.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from onboarding.errors import InputError

LOCK_FILE = "run.lock"  # flock'ed while a process writes the directory; holds its pid
RUN_FILE = "run.json"  # the run's identity: its id names the checkpoint's thread


def check_out(path: Path, flag: str = "--out") -> None:
    """Refuse a path no run directory can be made at, with one line naming why: a file, below a
    file, a folder this user cannot write (or a read-only or immutable one, found on creation)."""
    if path.exists() and not path.is_dir():
        raise InputError(f"{flag} {path}: exists and is not a directory")
    parent = path
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if parent != path and not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: {parent} is not writable by this user")
    if parent != path:  # what only trying tells (read-only, immutable, /proc): one level, undone
        top = path
        while top.parent != parent:
            top = top.parent
        try:
            top.mkdir()
        except FileExistsError:
            return
        except OSError as exc:
            raise InputError(f"{flag} {path}: cannot create {top}: {_why(exc)}") from None
        try:
            top.rmdir()
        except OSError:  # another process put something in it meanwhile: theirs now
            pass


def new_run_dir(model_name: str, out: str | None) -> Path:
    """A fresh run directory path (not created): ``out`` if given, else ``runs/<name>-<ts>``."""
    if out:
        path = Path(out)
        check_out(path)
        if path.exists() and any(path.iterdir()):
            raise InputError(f"--out {out}: directory exists and is not empty; "
                             "choose another or remove it")
        return path
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_name).strip("_") or "model"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path("runs") / f"{safe}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = Path("runs") / f"{safe}-{stamp}-{n}"
    check_out(path)
    return path


def _mkdirs(path: Path) -> Path | None:
    """Create ``path`` and its missing parents; returns the topmost folder created (None: it
    existed). An OS refusal is bad input naming the path and the reason."""
    missing = []
    p = path
    while not p.exists() and p.parent != p:
        missing.append(p)
        p = p.parent
    for i, d in enumerate(reversed(missing)):
        try:
            d.mkdir()
        except FileExistsError:  # made meanwhile by another process: not ours
            if d.is_dir():
                continue
            raise InputError(f"--out {path}: {d} exists and is not a directory") from None
        except OSError as exc:
            top = missing[-1] if i else None
            if top is not None:
                shutil.rmtree(top, ignore_errors=True)
            raise InputError(f"--out {path}: cannot create {d}: {_why(exc)}") from None
    return missing[-1] if missing else None


def _why(exc: OSError) -> str:
    if exc.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
        return f"{exc.strerror} (read-only, immutable or not writable)"
    if exc.errno == errno.ENOENT:  # the parent exists: a file system that takes no new folders
        return f"{exc.strerror} (this file system takes no new folders)"
    return exc.strerror or str(exc)


class RunLock:
    """An exclusive `flock` on ``<dir>/run.lock``: a second process writing the same directory
    (two ``--resume`` of one run, two runs with one ``--out``) is refused, not interleaved. The
    kernel drops the lock when the process ends, however it ends."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        self.fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise InputError(f"--out {self.path.parent}: cannot write there: {_why(exc)}") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise InputError(f"{self.path.parent}: another onboard process (pid {holder}) is "
                             f"writing this run directory ({self.path} is locked); wait for it "
                             "or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays (removing it races)
            self.fd = None


@contextmanager
def owned_dir(path: Path, *, created_here: bool, fresh: bool | None = None,
              resumable: bool | Callable[[], bool] = False) -> Iterator[Path]:
    """Create ``path`` (when ``created_here``) and hold its lock for the block.

    ``fresh`` (default: ``created_here``): the directory must hold nothing once locked (another
    run that began meanwhile is refused). When the block fails on bad input, or is interrupted
    and the run is not ``resumable``, what this call created is removed again; anything that
    existed before never is. ``resumable`` may be a function, asked at the interrupt (a run that
    becomes resumable part-way, e.g. once its config file is written).
    """
    fresh = created_here if fresh is None else fresh
    if created_here:
        check_out(path)
        top = _mkdirs(path)
    else:
        top = None
    lock = RunLock(path)
    try:
        lock.acquire()
    except InputError:
        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        raise
    try:
        if fresh and any(p.name != LOCK_FILE for p in path.iterdir()):
            raise InputError(f"--out {path}: directory exists and is not empty; choose another "
                             "or remove it")
    except InputError:
        lock.release()
        raise
    try:
        yield path
    except BaseException as exc:
        # bad input, user code that exited, or an interrupted command that cannot resume
        bad = isinstance(exc, (InputError, SystemExit)) or (
            isinstance(exc, KeyboardInterrupt)
            and not (resumable() if callable(resumable) else resumable))
        if bad and top is not None:
            shutil.rmtree(top, ignore_errors=True)
        elif bad and created_here and fresh:  # the folder was there, empty: empty it again
            for p in path.iterdir():
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        raise
    finally:
        lock.release()


def new_run_id(run_dir: Path, **info: Any) -> str:
    """Give a new run its identity (``run.json``): the checkpoint's thread is named by it, so the
    run is found by what its folder holds, wherever the folder is moved or copied."""
    run_id = uuid.uuid4().hex
    write_json(run_dir / RUN_FILE, {"run_id": run_id, "created": time.strftime(
        "%Y-%m-%d %H:%M:%S"), **info})
    return run_id


def read_run_id(run_dir: Path) -> str | None:
    """The id in ``run.json`` (None: a run from before ids were kept)."""
    f = run_dir / RUN_FILE
    if not f.is_file():
        return None
    try:
        run_id = json.loads(f.read_text()).get("run_id")
    except (json.JSONDecodeError, AttributeError, OSError) as exc:
        raise InputError(f"{f}: unreadable ({exc}); the run's identity is lost") from None
    if not isinstance(run_id, str) or not run_id:
        raise InputError(f"{f}: no run_id")
    return run_id


def write_json(path: Path, data: Any) -> None:
    """Write JSON atomically (temp file + rename) so a kill never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)


def append_event(run_dir: Path, event: dict[str, Any]) -> None:
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"time": time.time(), **event}) + "\n")
