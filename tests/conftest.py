"""Shared fixtures: a traced gpt2-tiny graph, made once per test session (per xdist worker)."""

from __future__ import annotations

from dataclasses import asdict

import pytest


@pytest.fixture(scope="session")
def gpt2_tiny_graph():
    """The OpGraph of gpt2-tiny (zoo defaults: batch 2, seq_len 32) at operator granularity."""
    from ftcompile.models import ModelOptions, build_model
    from ftcompile.trace import trace

    built = build_model("gpt2-tiny", ModelOptions())
    return trace(built.model, built.args, built.kwargs,
                 source={"model": built.name, "options": asdict(built.options)})


@pytest.fixture(scope="session")
def gpt2_tiny_graph_file(gpt2_tiny_graph, tmp_path_factory):
    """``gpt2_tiny_graph`` saved as a JSON file (treat as read-only; copy it to modify)."""
    path = tmp_path_factory.mktemp("graphs") / "gpt2-tiny.json"
    gpt2_tiny_graph.save(path)
    return path
