"""Wiring of the onboarding agent, checkpointed in the run directory:

load -> parse -> map -> generate -> align -> tune -> report, where a failed alignment loops back
to generate (bounded by `RunConfig.max_align_retries`) without the culprit's kernel.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from agents.nodes import (after_align, align_node, generate_node, load_node, map_node,
                          parse_node, report_node, train_node, tune_node)
from agents.state import RunState

NODES = ("load", "parse", "map", "generate", "align", "tune", "report")
CHECKPOINT_DB = "checkpoint.sqlite"


def build_graph():
    g = StateGraph(RunState)
    for name, node in (("load", load_node), ("parse", parse_node), ("map", map_node),
                       ("generate", generate_node), ("align", align_node),
                       ("tune", tune_node), ("train", train_node), ("report", report_node)):
        g.add_node(name, node)
    g.add_edge(START, "load")
    for a, b in (("load", "parse"), ("parse", "map"), ("map", "generate"),
                 ("generate", "align")):
        g.add_edge(a, b)
    g.add_conditional_edges("align", after_align, {"generate": "generate", "tune": "tune"})
    g.add_edge("tune", "train")
    g.add_edge("train", "report")
    g.add_edge("report", END)
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


def thread_config(run_dir: Path) -> dict:
    return {"configurable": {"thread_id": run_dir.resolve().name}}
