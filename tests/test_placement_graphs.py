"""benchmarks/placement_graphs.py: the device-placement JSON format (Tarnawski et al.) as a Problem.

A small graph written by hand in the format their README documents: a forward node and its
backward share a colour class and become one op node with both times; the backward edges
mirror the forward ones and add nothing; sinks feed a zero-cost loss.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))     # their sibling imports
from placement_graphs import GraphFileError, load_problem, total_over_gpus, with_share  # noqa: E402

from ftcompile.partition.base import run_strategy  # noqa: E402
from ftcompile.plan import evaluate  # noqa: E402

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def _script(name: str):
    """benchmarks/<name>.py loaded as module ``benchmarks_<name>``: not as a top-level ``simulate`` or
    ``partition`` beside ``ftcompile.simulate`` and ``ftcompile.partition``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", os.path.join(BENCHMARKS, f"{name}.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)     # (dataclasses look it up there)
    spec.loader.exec_module(module)
    return module


def _node(i, cls, latency, size, backward=False):
    return {"id": i, "name": f"n{i}", "supportedOnFpga": 1, "cpuLatency": 10 * latency, "fpgaLatency": latency,
            "isBackwardNode": int(backward), "colorClass": cls, "size": size}


@pytest.fixture
def diamond(tmp_path):
    # a -> (b, c) -> d, forward 1, 2, 3, 4 ms, backward twice that; sizes in MB
    fw = [_node(1, 1, 1.0, 1e6), _node(2, 2, 2.0, 2e6), _node(3, 3, 3.0, 3e6), _node(4, 4, 4.0, 4e6)]
    bw = [_node(10 + n["id"], n["colorClass"], 2 * n["fpgaLatency"], n["size"], True) for n in fw]
    edges = [(1, 2), (1, 3), (2, 4), (3, 4)]
    doc = {"maxSizePerFPGA": 1e9, "maxFPGAs": 2, "maxCPUs": 1, "nodes": fw + bw,
           "edges": [{"sourceId": a, "destId": b, "cost": 0.0, "size": 8e5} for a, b in edges]
           + [{"sourceId": 10 + b, "destId": 10 + a, "cost": 0.0, "size": 8e5} for a, b in edges]}
    path = tmp_path / "diamond.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_classes_become_op_nodes_with_forward_and_backward_times(diamond):
    pb = load_problem(diamond, 2)
    ops = list(pb.graph.op_nodes())
    assert len(ops) == 5 and sum(n.is_loss for n in ops) == 1          # four classes and the loss
    times = sorted((pb.profile.nodes[n.id].forward_ms, pb.profile.nodes[n.id].backward_ms) for n in ops)
    assert times == [(0.0, 0.0), (1.0, 2.0), (2.0, 4.0), (3.0, 6.0), (4.0, 8.0)]
    # the diamond's four forward edges, the input, and the sink into the loss
    between = [(e.src, e.dst) for e in pb.graph.edges if pb.graph.node(e.src).kind == "op"
               and pb.graph.node(e.dst).kind == "op"]
    assert len(between) == 5
    assert sum(c.activation_bytes for c in pb.profile.nodes.values()) == 10_000_000
    # whole plans price: a convex split of all the work onto 2 GPUs
    plan = run_strategy("seq", pb, time_limit=2, simulate_top=0)
    assert evaluate(pb, plan).feasible


def test_weights_share_with_sgd_makes_memory_twice_the_size(diamond):
    pb = load_problem(diamond, 2, weights=1.0, optimizer="sgd", values=False)
    assert sum(c.total for c in pb.profile.params.values()) == 2 * 10_000_000
    assert total_over_gpus(pb) == 10_000_000
    assert with_share(pb, 1.2).cluster.gpu_memory == 12_000_000
    assert all(e.bytes <= 4 for e in pb.graph.edges if pb.graph.node(e.src).kind == "op")


def test_bad_files_are_refused_with_what_is_wrong(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(GraphFileError, match="cannot read a placement graph"):
        load_problem(str(bad), 2)
    bad.write_text(json.dumps({"nodes": []}))
    with pytest.raises(GraphFileError, match="'nodes' and 'edges'"):
        load_problem(str(bad), 2)
    bad.write_text(json.dumps({"nodes": [_node(1, 1, 1.0, 1.0)], "edges": [{"sourceId": 1, "destId": 9}]}))
    with pytest.raises(GraphFileError, match="names a node that is not there"):
        load_problem(str(bad), 2)
    bad.write_text(json.dumps({"nodes": [_node(1, 1, 1.0, 1.0), _node(1, 1, 1.0, 1.0)], "edges": []}))
    with pytest.raises(GraphFileError, match="appears twice"):
        load_problem(str(bad), 2)
    bad.write_text(json.dumps({"nodes": [{"name": "x"}], "edges": []}))
    with pytest.raises(GraphFileError, match="integer 'id'"):
        load_problem(str(bad), 2)
    bad.write_text(json.dumps({"nodes": [_node(1, "attn", 1.0, 1.0)], "edges": []}))
    with pytest.raises(GraphFileError, match="integer 'colorClass'"):
        load_problem(str(bad), 2)


def test_operator_graph_classes_hold_several_nodes_and_classless_nodes_stand_alone(tmp_path):
    # An operator graph's class holds an op and the weight it reads; a node without a class is
    # one of its own even where its id equals a class number (here node 3 and class 3).
    w = _node(1, 3, 0.0, 5e6)                    # a weight, class 3
    op = _node(2, 3, 2.0, 1e6)                   # the op reading it, class 3
    solo = _node(3, None, 1.0, 2e6)              # no class; id 3 is also class 3's number
    del solo["colorClass"]
    tail = _node(4, 4, 3.0, 1e6)
    bw = [_node(12, 3, 4.0, 1e6, True), _node(14, 4, 6.0, 1e6, True)]
    edges = [(1, 2), (2, 3), (3, 4)]            # class 3 -> node 3 -> class 4: a cycle if they merged
    doc = {"nodes": [w, op, solo, tail] + bw,
           "edges": [{"sourceId": a, "destId": b, "cost": 0.0, "size": 8e5} for a, b in edges]}
    path = tmp_path / "ops.json"
    path.write_text(json.dumps(doc))
    pb = load_problem(str(path), 2)
    ops = [n for n in pb.graph.op_nodes() if not n.is_loss]
    assert len(ops) == 3
    by_time = sorted((pb.profile.nodes[n.id].forward_ms, pb.profile.nodes[n.id].backward_ms,
                      pb.profile.nodes[n.id].activation_bytes) for n in ops)
    # class 3: both forward nodes' times and sizes (weight 5 MB + op 1 MB), its backward 4 ms
    assert by_time == [(1.0, 0.0, 2_000_000), (2.0, 4.0, 6_000_000), (3.0, 6.0, 1_000_000)]


def test_simulate_benchmark_replays_the_plan_it_saved(diamond, tmp_path, capsys):
    # benchmarks/simulate.py: a plan saved by one run is replayed as the same stages by the next
    # (so that two checkouts time one plan), and its period is what simulate() gives that plan.
    bench = _script("simulate")
    from ftcompile.plan import Plan
    from ftcompile.simulate import simulate

    saved = tmp_path / "plans.json"
    assert bench.main(["--graph-file", diamond, "--gpus", "2", "--memory", "0", "--time-limit", "1",
                       "--save-plans", str(saved)]) == 0
    first = capsys.readouterr().out.splitlines()
    (label, doc), = json.loads(saved.read_text()).items()
    plan = Plan.from_json(doc)
    period = simulate(load_problem(diamond, 2, weights=1, optimizer="sgd", values=False), plan).period_ms
    row = next(line for line in first if line.startswith(label))
    assert f"{period:10.3f}" in row and f"{len(plan.stages):6d}" in row
    assert bench.main(["--graph-file", diamond, "--gpus", "2", "--memory", "0", "--plans", str(saved)]) == 0
    again = next(line for line in capsys.readouterr().out.splitlines() if line.startswith(label))
    assert again.split()[:-2] == row.split()[:-2]       # all but the seconds and us per task
    with pytest.raises(SystemExit):
        bench.main(["--graph-file", diamond, "--plans", str(tmp_path / "missing.json")])
    assert "cannot read it" in capsys.readouterr().err
    # a plan that does not cover this graph's op nodes is refused by name, before any replay
    doc["stages"][0]["nodes"] = doc["stages"][0]["nodes"][1:]
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({label: doc}))
    with pytest.raises(SystemExit):
        bench.main(["--graph-file", diamond, "--gpus", "2", "--memory", "0", "--plans", str(wrong)])
    assert "is not a plan of this graph" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--graph-file", diamond, "--save-plans", str(tmp_path / "no" / "such" / "plans.json")])
    assert "its folder does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("option, value, says", [
    ("--suite-memory", "unlimited,1.2", "expected memory shares of total/P above 0 or 'free'"),
    ("--suite-memory", "free,0", "expected memory shares of total/P above 0 or 'free'"),
    ("--suite-gpus", "3,six", "expected GPU counts of at least 1"),
    ("--suite-gpus", "0", "expected GPU counts of at least 1"),
])
def test_partition_benchmark_refuses_bad_suite_options_by_name(diamond, option, value, says, capsys):
    # benchmarks/partition.py: a bad list is one line naming the option and the value, before any case runs
    bench = _script("partition")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--graph-file", diamond, option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {says}" in err and repr(value) in err and "Traceback" not in err


def test_configlp_benchmark_prints_a_bound_no_plan_beats(diamond, capsys):
    # benchmarks/configlp.py on the diamond (a -> (b, c) -> d) on 2 GPUs: the bound is at most
    # the best plan's objective, which brute force over every assignment gives
    import itertools

    from ftcompile.partition.exact import plan_from_assignment

    bench = _script("configlp")
    pb = load_problem(diamond, 2, weights=1, optimizer="sgd", values=False)
    ids = [n.id for n in pb.graph.op_nodes()]
    best = min(evaluate(pb, plan_from_assignment(pb, [[n] for n in ids], list(gpus), "bf", merge=m)).objective_ms
               for gpus in itertools.product(range(2), repeat=len(ids)) for m in (True, False))
    assert bench.main(["--graph-file", diamond, "--gpus", "2", "--high", f"{best:.6f}"]) == 0
    out = capsys.readouterr().out
    bound = float(out.split("bound ")[1].split(" ms")[0])
    assert 0 < bound <= best + 1e-3 and "x the bound" in out
    with pytest.raises(SystemExit):
        bench.main(["--graph-file", diamond, "--gpus", "0"])
    assert "--gpus must be at least 1" in capsys.readouterr().err
