"""Wiring of the onboarding agent, checkpointed in the run directory:

load -> parse -> map -> generate -> align -> tune -> report, where a failed alignment loops back
to generate (bounded by `RunConfig.max_align_retries`) without the culprit's kernel; with
`RunConfig.review`, report -> review (opens the kernel PR, then `interrupt`) -> pr (merges or
deletes it on the human's answer; `agents.review`).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from agents.nodes import (after_align, align_node, generate_node, load_node, map_node,
                          parse_node, plan_node, report_node, train_node, tune_node)
from agents.review import after_report, pr_node, review_node
from agents.state import RunState

NODES = ("load", "parse", "plan", "map", "generate", "align", "tune", "train", "report")
CHECKPOINT_DB = "checkpoint.sqlite"


def build_graph():
    g = StateGraph(RunState)
    for name, node in (("load", load_node), ("parse", parse_node), ("plan", plan_node),
                       ("map", map_node),
                       ("generate", generate_node), ("align", align_node),
                       ("tune", tune_node), ("train", train_node), ("report", report_node)):
        g.add_node(name, node)
    g.add_edge(START, "load")
    for a, b in (("load", "parse"), ("parse", "plan"), ("plan", "map"), ("map", "generate"),
                 ("generate", "align")):
        g.add_edge(a, b)
    g.add_conditional_edges("align", after_align, {"generate": "generate", "tune": "tune"})
    g.add_edge("tune", "train")
    g.add_edge("train", "report")
    g.add_node("review", review_node)
    g.add_node("pr", pr_node)
    g.add_conditional_edges("report", after_report, {"review": "review", END: END})
    g.add_edge("review", "pr")
    g.add_edge("pr", END)
    return g


def compile_graph(run_dir: Path):
    """The graph compiled with a SQLite checkpointer in ``run_dir`` (caller closes ``.conn``)."""
    conn = sqlite3.connect(str(run_dir / CHECKPOINT_DB), check_same_thread=False)
    # Our state types are the only custom classes the checkpoint may revive.
    serde = JsonPlusSerializer(allowed_msgpack_modules=[("agents.state", "RunConfig"),
                                                        ("agents.state", "RunState")])
    saver = SqliteSaver(conn, serde=serde)
    app = build_graph().compile(checkpointer=saver)
    return app, conn


def thread_config(run_dir: Path, run_id: str) -> dict:
    """The graph's config for the run ``run_id`` in ``run_dir``: nodes write where the folder is
    now (``run_dir``, absolute), never where the run began (`node_run_dir`)."""
    return {"configurable": {"thread_id": run_id, "run_dir": str(run_dir.resolve())}}


def run_thread(run_dir: Path) -> str:
    """The checkpoint thread of the run in ``run_dir``, checked readable before anything opens it
    for writing: ``run.json``'s id (a run from before ids were kept: the checkpoint's only
    thread). An empty, corrupt or foreign checkpoint is bad input ("checkpoint unreadable")."""
    from onboarding.errors import InputError
    from onboarding.rundir import read_run_id

    db = run_dir / CHECKPOINT_DB
    if not db.is_file():
        raise InputError(f"--resume {run_dir}: not a run directory (no {CHECKPOINT_DB})")
    if db.stat().st_size == 0:
        raise InputError(f"--resume {run_dir}: checkpoint unreadable: {db} is empty (0 bytes)")
    run_id = read_run_id(run_dir)
    try:  # read-only: a failed check changes nothing in the folder
        conn = sqlite3.connect(f"file:{db.resolve()}?mode=ro", uri=True)
        try:
            threads = [r[0] for r in conn.execute("SELECT DISTINCT thread_id FROM checkpoints")]
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise InputError(f"--resume {run_dir}: checkpoint unreadable: {db}: {exc}") from None
    if run_id is None and len(threads) == 1:
        run_id = threads[0]
    if run_id is None or run_id not in threads:
        what = f"run {run_id}" if run_id else "its run (no run.json)"
        raise InputError(f"--resume {run_dir}: checkpoint unreadable: {db} holds no checkpoint "
                         f"of {what} ({len(threads)} other threads)")
    return run_id
