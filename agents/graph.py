"""Wiring of the onboarding agent: load -> parse -> report, checkpointed in the run directory."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from agents.nodes import load_node, parse_node, report_node
from agents.state import RunState

NODES = ("load", "parse", "report")
CHECKPOINT_DB = "checkpoint.sqlite"


def build_graph():
    g = StateGraph(RunState)
    g.add_node("load", load_node)
    g.add_node("parse", parse_node)
    g.add_node("report", report_node)
    g.add_edge(START, "load")
    g.add_edge("load", "parse")
    g.add_edge("parse", "report")
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
