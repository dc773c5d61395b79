"""Profiled training graphs in the device-placement JSON format, as ftcompile problems.

Tarnawski et al. ("Efficient algorithms for device placement of DNN graph operators",
NeurIPS 2020) published profiled graphs of BERT, ResNet-50, InceptionV3 and GNMT at layer
and operator granularity in a small JSON format (their repository's README documents it):
``nodes`` with ``id``, ``fpgaLatency`` (time on an accelerator), ``isBackwardNode``,
``colorClass`` (nodes of one class must share a device: a forward node and its backward) and
``size`` (bytes the node takes on the accelerator); ``edges`` with ``sourceId`` and ``destId``.
The files are not part of this repository; download them and pass their paths.

:func:`load_problem` turns one into a :class:`~ftcompile.plan.Problem`:

* one op node per colour class (the forward node and its backward colocated; in operator graphs
  also the weights an op reads; a node without a class is a class of its own), forward and
  backward times the sums of the class's forward and backward nodes', recomputation = the
  forward, its bytes the sum of its forward nodes' ``size``;
* the forward edges between classes as values (their bytes from the edge's ``size`` where
  given; with ``values=False`` four bytes each, so that no buffer of them counts); a graph input
  feeds the sources, and a zero-cost loss reads every sink;
* the node's ``size`` as one micro-batch of its activations, or, with ``weights`` (a share),
  that share of it as a parameter of the node (weights, with its gradient and the ``optimizer``'s
  state on top: ``weights=1`` with plain SGD makes each node take twice its size, all of it
  static, so that memory limits act as a knapsack);
* free links (only balance and memory count, as in ``--suite``), no reserve.

It shares nothing with the partitioners; it only builds their input.
"""

from __future__ import annotations

import json
from dataclasses import replace

import networkx as nx

from ftcompile.cluster import ClusterSpec
from ftcompile.ir import Edge, Node, OpGraph, ParamInfo, TensorMeta, ValueMeta
from ftcompile.plan import Problem
from ftcompile.profile import NodeCost, ParamCost, Profile


class GraphFileError(ValueError):
    """A placement-graph file that cannot be read; the message names the file and what is wrong."""


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise GraphFileError(f"{path}: cannot read a placement graph ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list) or not isinstance(doc.get("edges"), list):
        raise GraphFileError(f"{path}: expected a JSON object with 'nodes' and 'edges' lists (the device-placement "
                             "format of Tarnawski et al.)")
    return doc


#: Optimizer state per byte of weights: plain SGD keeps none, momentum one copy, Adam two.
STATE = {"sgd": 0, "momentum": 1, "adam": 2}


def load_problem(path: str, gpus: int, *, weights: float = 0.0, optimizer: str = "adam", values: bool = True,
                 schedule: str = "async", micro_batches: int = 4) -> Problem:
    """The graph in ``path`` on ``gpus`` GPUs with unlimited memory (see the module docstring)."""
    if not 0.0 <= weights <= 1.0:
        raise ValueError(f"weights is a share of each node's size, 0..1; got {weights}")
    if optimizer not in STATE:
        raise ValueError(f"optimizer must be one of {', '.join(STATE)}; got {optimizer!r}")
    doc = _read(path)
    try:
        nodes: dict[int, dict] = {}
        for n in doc["nodes"]:
            i = int(n["id"])
            if i in nodes:
                raise GraphFileError(f"{path}: node id {i} appears twice")
            nodes[i] = n
        for e in doc["edges"]:
            int(e["sourceId"]), int(e["destId"])
        # A node without a colour class is a class of its own, under a key no class number can
        # take (ids and class numbers overlap: node 16 and class 16 are unrelated).
        cls_of = {i: ("class", int(n["colorClass"])) if n.get("colorClass") is not None else ("node", i)
                  for i, n in nodes.items()}
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, GraphFileError):
            raise
        raise GraphFileError(f"{path}: a node needs an integer 'id' (and an integer 'colorClass' or none) and an "
                             f"edge 'sourceId' and 'destId' ({type(exc).__name__}: {exc})") from None
    members: dict[tuple, dict[str, list]] = {}
    for i, n in nodes.items():
        members.setdefault(cls_of[i], {"fw": [], "bw": []})["bw" if n.get("isBackwardNode") else "fw"].append(n)
    dag = nx.DiGraph()
    dag.add_nodes_from(members)
    value_bytes: dict[int, float] = {}
    for e in doc["edges"]:
        a, b = nodes.get(int(e["sourceId"])), nodes.get(int(e["destId"]))
        if a is None or b is None:
            raise GraphFileError(f"{path}: edge {e['sourceId']} -> {e['destId']} names a node that is not there")
        if a.get("isBackwardNode") or b.get("isBackwardNode"):
            continue                        # the backward graph mirrors the forward one
        ca, cb = cls_of[int(a["id"])], cls_of[int(b["id"])]
        if ca != cb:
            dag.add_edge(ca, cb)
            value_bytes[ca] = max(value_bytes.get(ca, 0.0), float(e.get("size") or 0.0) if values else 0.0)
    if not nx.is_directed_acyclic_graph(dag):
        raise GraphFileError(f"{path}: the forward graph between colour classes has a cycle")
    order = list(nx.lexicographical_topological_sort(dag))
    nid = {c: k + 1 for k, c in enumerate(order)}
    g_nodes = [Node(0, "input", "input", outputs={"x": ValueMeta(TensorMeta((16,), "int64"))})]
    edges: list[Edge] = []
    costs: dict[int, NodeCost] = {}
    params: dict[str, ParamInfo] = {}
    pcost: dict[str, ParamCost] = {}

    def value(k: int) -> str:
        return "x" if k == 0 else f"v{k}"

    for c in order:
        k = nid[c]
        fw, bw = members[c]["fw"], members[c]["bw"]
        # A class's bytes are its forward nodes' (an operator graph's class holds an op and the
        # weights it reads; a backward node repeats its forward node's size); a class of backward
        # nodes alone counts theirs.
        size = sum(float(n.get("size") or 0.0) for n in (fw or bw))
        nbytes = max(4, int(value_bytes.get(c, 4.0)))
        names = []
        wbytes = int(size * weights) // 4 * 4
        if wbytes:
            name = f"w{k}"
            params[name] = ParamInfo(name, "parameter", TensorMeta((wbytes // 4,), "float32"))
            pcost[name] = ParamCost(wbytes, wbytes, STATE[optimizer] * wbytes)   # weights, gradients, state
            names = [name]
        label = f"{c[0]}{c[1]}"
        g_nodes.append(Node(k, label, "op", scope=label, params=names,
                            outputs={value(k): ValueMeta(TensorMeta((nbytes // 4,), "float32"))}))
        preds = sorted(nid[p] for p in dag.predecessors(c)) or [0]
        for p in preds:
            edges.append(Edge(p, k, value(p), g_nodes[p].outputs[value(p)]))
        f = sum(float(n.get("fpgaLatency", 0.0)) for n in fw)
        costs[k] = NodeCost(forward_ms=f, backward_ms=sum(float(n.get("fpgaLatency", 0.0)) for n in bw),
                            recompute_ms=f, activation_bytes=int(size) - wbytes)
    loss = len(order) + 1
    g_nodes.append(Node(loss, "loss", "op", scope="loss", outputs={"loss": ValueMeta(TensorMeta((), "float32"))},
                        is_loss=True))
    for c in order:
        if dag.out_degree(c) == 0:
            edges.append(Edge(nid[c], loss, value(nid[c]), g_nodes[nid[c]].outputs[value(nid[c])]))
    costs[loss] = NodeCost(forward_ms=0.0, backward_ms=0.0, recompute_ms=0.0, activation_bytes=0)
    g_nodes.append(Node(loss + 1, "output", "output"))
    edges.append(Edge(loss, loss + 1, "loss", g_nodes[loss].outputs["loss"]))
    graph = OpGraph(nodes=g_nodes, edges=edges, params=params, loss="loss", source={"file": path})
    prof = Profile(graph_hash=graph.content_hash(), method="measured", hardware={"name": "placement-graph"},
                   dtype="float32", batch_size=1, optimizer=optimizer, nodes=costs, params=pcost)
    cluster = ClusterSpec("placement-graph", 1, gpus, 10**15, 1e30, 1e30, 1e30, hardware="placement-graph")
    return Problem(graph, prof, cluster, schedule=schedule, micro_batches=micro_batches)


def total_over_gpus(problem: Problem) -> float:
    """Weights, gradients, optimizer state and one micro-batch's activations over the GPUs: the
    "total / P" the suite's tight memory limits are stated in."""
    return problem.profile.training_bytes() / problem.num_gpus


def with_share(problem: Problem, share: float | None) -> Problem:
    """``problem`` with ``share`` x total / P bytes per GPU (None: unlimited)."""
    if share is None:
        return problem
    return replace(problem, cluster=replace(problem.cluster, gpu_memory=int(share * total_over_gpus(problem))))
