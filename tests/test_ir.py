"""OpGraph IR: files (round trip, refusals, atomic writes) and structural validation."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ftcompile.ir import (
    OPGRAPH_VERSION, Edge, GraphError, Instr, Node, OpGraph, ParamInfo, TensorMeta, ValueMeta,
    atomic_write_text, decode_literal, encode_literal,
)


def _t(*shape, dtype="float32") -> ValueMeta:
    return ValueMeta(tensor=TensorMeta(tuple(shape), dtype))


def small_graph() -> OpGraph:
    """input x -> linear (reads w, tied as w2) -> relu -> output; loss = sum."""
    x = _t(4, 8)
    nodes = [
        Node(0, "x", "input", outputs={"x": x}),
        Node(1, "linear", "op", instrs=[Instr("linear", "aten.linear.default", [{"ref": "x"}, {"param": "w"}],
                                               out=_t(4, 8), scope="fc")],
             scope="fc", scope_class="Linear", scopes=[["fc", "torch.nn.Linear"]], params=["w"],
             outputs={"linear": _t(4, 8)}),
        Node(2, "relu", "op", instrs=[Instr("relu", "aten.relu.default", [{"ref": "linear"}], out=_t(4, 8))],
             outputs={"relu": _t(4, 8)}),
        Node(3, "sum", "op", instrs=[Instr("sum", "aten.sum.default", [{"ref": "relu"}],
                                           kwargs={"dtype": {"dtype": "float32"}}, out=_t())],
             outputs={"sum": _t()}, is_loss=True),
        Node(4, "output", "output"),
    ]
    edges = [Edge(0, 1, "x", x), Edge(1, 2, "linear", _t(4, 8)), Edge(2, 3, "relu", _t(4, 8)),
             Edge(3, 4, "sum", _t())]
    params = {"w": ParamInfo("w", "parameter", TensorMeta((8, 8), "float32"), aliases=["w2"], users=[1])}
    return OpGraph(nodes, edges, params, inputs=[{"node": 0, "value": "x", "path": "args[0]"}],
                   outputs=["sum"], loss="sum", source={"model": "small"})


@pytest.fixture
def traced(gpt2_tiny_graph) -> OpGraph:
    """A real traced graph (tied weights, literals of many kinds); from conftest, shared per session."""
    return gpt2_tiny_graph


# --------------------------------------------------------------------------- round trip

def test_small_graph_is_valid():
    g = small_graph()
    g.validate()
    assert g.num_parameters == 64
    assert g.activation_bytes == 2 * 4 * 8 * 4 + 4


@pytest.mark.parametrize("which", ["small", "traced"])
def test_save_load_round_trip(tmp_path, which, request):
    g = small_graph() if which == "small" else request.getfixturevalue("traced")
    p = tmp_path / "g.json"
    g.save(p)
    h = OpGraph.load(p)
    assert h.to_json() == g.to_json()
    assert h.content_hash() == g.content_hash()
    # saving the loaded graph gives the same bytes
    p2 = tmp_path / "g2.json"
    h.save(p2)
    assert p.read_bytes() == p2.read_bytes()
    assert [n.op for n in h.nodes] == [n.op for n in g.nodes]
    assert h.summary()["hash"] == g.summary()["hash"]


def test_content_hash_ignores_source_but_not_structure():
    g = small_graph()
    h = small_graph()
    h.source = {"model": "other", "tracer": "x"}
    assert g.content_hash() == h.content_hash()
    h.params["w"].meta = TensorMeta((8, 9), "float32")
    assert g.content_hash() != h.content_hash()


def test_literals_round_trip():
    for x in [None, 1, 2.5, "s", [1, (2, 3)], torch.float16, torch.device("cpu"), torch.strided,
              torch.contiguous_format, float("-inf"), float("nan"), slice(1, None, 2), {"a": 1}]:
        enc = encode_literal(x)
        json.dumps(enc)
        dec = decode_literal(json.loads(json.dumps(enc)))
        if isinstance(x, float) and x != x:
            assert dec != dec
        elif isinstance(x, (list, tuple)):
            assert dec == [1, [2, 3]]
        else:
            assert dec == x
    assert decode_literal(encode_literal(torch.device("meta")), device="cpu") == torch.device("cpu")
    with pytest.raises(TypeError):
        encode_literal(object())


# --------------------------------------------------------------------------- refusals

def _write_json(path, d) -> None:
    path.write_text(json.dumps(d), encoding="utf-8")


def test_load_refuses_wrong_version(tmp_path):
    d = small_graph().to_json()
    d["version"] = OPGRAPH_VERSION + 1
    _write_json(tmp_path / "g.json", d)
    with pytest.raises(GraphError, match="version") as ei:
        OpGraph.load(tmp_path / "g.json")
    assert "ftcompile trace" in str(ei.value)  # says how to regenerate


def test_load_refuses_wrong_format(tmp_path):
    d = small_graph().to_json()
    d["format"] = "ftcompile.profile"
    _write_json(tmp_path / "g.json", d)
    with pytest.raises(GraphError, match="not an ftcompile OpGraph") as ei:
        OpGraph.load(tmp_path / "g.json")
    assert "ftcompile trace" in str(ei.value)
    _write_json(tmp_path / "list.json", [1, 2, 3])
    with pytest.raises(GraphError, match="not an ftcompile OpGraph"):
        OpGraph.load(tmp_path / "list.json")


def test_load_refuses_corrupt_json(tmp_path):
    p = tmp_path / "g.json"
    p.write_text("{this is not json", encoding="utf-8")
    with pytest.raises(GraphError, match="not valid JSON") as ei:
        OpGraph.load(p)
    assert "re-run `ftcompile trace`" in str(ei.value)
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(GraphError, match="not valid JSON"):
        OpGraph.load(p)


def test_load_refuses_truncated_file(tmp_path, traced):
    p = tmp_path / "g.json"
    traced.save(p)
    data = p.read_bytes()
    for cut in (len(data) // 2, len(data) - 1, 10):
        p.write_bytes(data[:cut])
        with pytest.raises(GraphError, match="re-run `ftcompile trace`"):
            OpGraph.load(p)


def test_load_refuses_missing_fields_and_missing_file(tmp_path):
    d = small_graph().to_json()
    del d["nodes"][1]["id"]
    _write_json(tmp_path / "g.json", d)
    with pytest.raises(GraphError, match="corrupt") as ei:
        OpGraph.load(tmp_path / "g.json")
    assert "ftcompile trace" in str(ei.value)
    d = small_graph().to_json()
    del d["edges"]
    _write_json(tmp_path / "g.json", d)
    with pytest.raises(GraphError, match="corrupt"):
        OpGraph.load(tmp_path / "g.json")
    with pytest.raises(GraphError, match="no such OpGraph file"):
        OpGraph.load(tmp_path / "missing.json")


def _nodes_outputs_list(d):
    d["nodes"][1]["outputs"] = ["linear"]                 # a list where an object belongs


def _instr_unpack_list(d):
    d["nodes"][1]["instrs"][0]["unpack"] = [0]


def _param_shape_number(d):
    d["params"][0]["shape"] = 8


def _edge_meta_string(d):
    d["edges"][0]["meta"] = "tensor"


def _node_is_list(d):
    d["nodes"][2] = [2, "relu", "op"]


def _inputs_number(d):
    d["inputs"] = 7


@pytest.mark.parametrize("spoil", [_nodes_outputs_list, _instr_unpack_list, _param_shape_number, _edge_meta_string,
                                   _node_is_list, _inputs_number])
def test_load_refuses_malformed_content_as_corrupt(tmp_path, spoil):
    """Wrong JSON types deep inside (AttributeError, TypeError...) read as a corrupt file, not a crash."""
    d = small_graph().to_json()
    spoil(d)
    _write_json(tmp_path / "g.json", d)
    with pytest.raises(GraphError, match="corrupt") as ei:
        OpGraph.load(tmp_path / "g.json")
    assert "re-run `ftcompile trace`" in str(ei.value)


def test_load_validates_structure(tmp_path):
    d = small_graph().to_json()
    d["edges"][0]["src"], d["edges"][0]["dst"] = 1, 0
    _write_json(tmp_path / "g.json", d)
    with pytest.raises(GraphError, match="backwards"):
        OpGraph.load(tmp_path / "g.json")


# --------------------------------------------------------------------------- validate

def test_validate_catches_backwards_edge():
    g = small_graph()
    g.edges.append(Edge(2, 1, "relu", _t(4, 8)))
    g._index()
    with pytest.raises(GraphError, match="goes backwards"):
        g.validate()


def test_validate_catches_nodes_out_of_order():
    g = small_graph()
    g.nodes[1], g.nodes[2] = g.nodes[2], g.nodes[1]
    g._index()
    with pytest.raises(GraphError, match="backwards"):
        g.validate()


def test_validate_catches_edge_value_not_produced_by_source():
    g = small_graph()
    g.edges[1] = Edge(1, 2, "x", _t(4, 8))   # node 1 does not make x
    g.edges.append(Edge(1, 2, "linear", _t(4, 8)))
    g._index()
    with pytest.raises(GraphError, match="does not produce"):
        g.validate()


def test_validate_catches_unknown_param():
    g = small_graph()
    g.nodes[1].params.append("nope.weight")
    with pytest.raises(GraphError, match="unknown parameter 'nope.weight'"):
        g.validate()


def test_validate_catches_read_without_edge_and_other_faults():
    g = small_graph()
    del g.edges[1]
    g._index()
    with pytest.raises(GraphError, match="no edge brings it"):
        g.validate()

    g = small_graph()
    g.nodes[2].outputs["linear"] = _t(4, 8)
    g._index()
    with pytest.raises(GraphError, match="produced by nodes 1 and 2"):
        g.validate()

    g = small_graph()
    g.loss = "missing"
    with pytest.raises(GraphError, match="loss value"):
        g.validate()

    g = small_graph()
    g.nodes[2].id = 1
    g._index()
    with pytest.raises(GraphError, match="appears twice"):
        g.validate()

    g = small_graph()
    g.nodes[2].kind = "weird"
    with pytest.raises(GraphError, match="unknown kind"):
        g.validate()

    g = small_graph()
    g.edges.append(Edge(3, 99, "sum", _t()))
    g._index()
    with pytest.raises(GraphError, match="missing node"):
        g.validate()


def test_queries():
    g = small_graph()
    assert g.predecessors(2) == [1] and g.successors(2) == [3]
    assert g.producer("relu") == 2
    assert [n.id for n in g.op_nodes()] == [1, 2, 3]
    assert g.node(1).op == "aten.linear.default" and g.node(0).op == "input"
    nx_g = g.to_networkx()
    assert nx_g.number_of_nodes() == 5 and nx_g.number_of_edges() == 4
    s = g.summary()
    assert s["tied_parameters"] == 1 and s["loss"] == "sum" and s["inputs"] == ["args[0]"]


# --------------------------------------------------------------------------- atomic writes

def _no_temp_files(folder) -> bool:
    return not [f for f in os.listdir(folder) if f.startswith(".tmp-")]


def test_save_leaves_no_temp_files(tmp_path):
    g = small_graph()
    g.save(tmp_path / "g.json")
    g.save(tmp_path / "g.json")  # overwrite
    assert sorted(os.listdir(tmp_path)) == ["g.json"]
    g.save(tmp_path / "sub" / "dir" / "g.json")  # creates folders
    assert os.listdir(tmp_path / "sub" / "dir") == ["g.json"]


def test_failed_serialization_keeps_existing_file(tmp_path):
    p = tmp_path / "g.json"
    g = small_graph()
    g.save(p)
    before = p.read_bytes()
    bad = small_graph()
    bad.nodes[1].instrs[0].args.append({1, 2})   # a set is not JSON
    with pytest.raises(TypeError):
        bad.save(p)
    assert p.read_bytes() == before
    assert _no_temp_files(tmp_path)
    OpGraph.load(p)


def test_failed_write_removes_temp_file_and_keeps_existing(tmp_path):
    p = tmp_path / "f.json"
    atomic_write_text(p, "old")
    with pytest.raises(UnicodeEncodeError):
        atomic_write_text(p, "new \ud800 text")   # a lone surrogate cannot be encoded as UTF-8
    assert p.read_text() == "old"
    assert _no_temp_files(tmp_path)
    with pytest.raises(TypeError):
        atomic_write_text(p, 123)  # type: ignore[arg-type]
    assert p.read_text() == "old"
    assert _no_temp_files(tmp_path)


def test_failed_rename_keeps_existing(tmp_path, monkeypatch):
    p = tmp_path / "f.json"
    atomic_write_text(p, "old")

    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(p, "new")
    monkeypatch.undo()
    assert p.read_text() == "old"
    assert _no_temp_files(tmp_path)
