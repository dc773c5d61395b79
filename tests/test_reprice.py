"""A run trains as its plan was priced, and a run that is not is priced again before it starts.

The package records every run setting its plan's memory and period depend on (schedule,
micro-batches, recomputation, optimizer, weight prediction, clipping, skipping non-finite steps).
`ftcompile run` takes them as its defaults; an option that changes one makes the launcher price
the plan again (ftcompile.reprice) and refuse a GPU run the plan no longer fits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from ftcompile.cli import main
from ftcompile.ir import OpGraph
from ftcompile.plan import load_plan_file
from ftcompile.runtime import load_package

PLANNED = ["--schedule", "1f1b", "--recompute", "--optimizer", "sgd", "--clip-grad-norm", "0.5"]


def _compile(out, *extra):
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "seq", "--jobs", "1",
                 "-q", "-o", str(out), *PLANNED, *extra]) == 0


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """A gpt2-tiny package planned for SGD with a GPU memory just above what its plan needs."""
    root = tmp_path_factory.mktemp("reprice")
    _compile(root / "probe")
    need = max(json.loads((root / "probe" / "plan.json").read_text())["simulation"]["gpu_peak_memory"])
    _compile(root / "pkg", "--gpu-memory", str(need + 4096))
    return root / "pkg"


def _manifest(pkg):
    return load_package(pkg, verify=False).manifest


def _resolved(pkg, *argv):
    from ftcompile.runtime.options import add_train_arguments, resolve

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    args = p.parse_args([str(pkg), *argv])
    return resolve(args, load_package(pkg, verify=False).manifest).args, args


def test_plan_and_package_record_the_run_settings(tight):
    doc = load_plan_file(tight / "plan.json")
    assert (doc["schedule"], doc["recompute"], doc["clip_grad_norm"], doc["on_nonfinite"],
            doc["weight_prediction"]) == ("1f1b", True, 0.5, "stop", False)
    pkg = doc["package"]
    assert (pkg["optimizer"], pkg["recompute"], pkg["clip_grad_norm"], pkg["on_nonfinite"]) == ("sgd", True, 0.5, "stop")


def test_run_defaults_to_the_plans_settings(tight):
    from ftcompile.runtime.options import worker_argv

    args, _ = _resolved(tight)
    assert (args.schedule, args.optimizer, args.recompute, args.clip_grad_norm, args.on_nonfinite) == \
        ("1f1b", "sgd", True, 0.5, "stop")
    args, cli = _resolved(tight, "--optimizer", "adam", "--no-recompute")
    assert (args.optimizer, args.recompute) == ("adam", False)
    # the ranks get --no-recompute too, or they would take the plan's recomputation back
    assert "--no-recompute" in worker_argv(cli)


def test_a_run_as_planned_is_not_priced_again(tight):
    from ftcompile.reprice import of_run, planned, reprice

    args, _ = _resolved(tight)
    assert reprice(tight, planned(_manifest(tight)), of_run(args)) is None


def _state_bytes_by_gpu(pkg) -> dict[int, int]:
    """Adam's two fp32 moments of every parameter a GPU's stages read, counted from the graph."""
    graph = OpGraph.load(pkg / "graph.json")
    plan = load_plan_file(pkg / "plan.json")["plan"]
    out = {}
    for st in plan["stages"]:
        names = {p for n in st["nodes"] for p in graph.node(n).params}
        out.setdefault(st["gpu"], set()).update(names)
    return {g: sum(8 * graph.params[p].numel for p in names if graph.params[p].requires_grad)
            for g, names in out.items()}


def test_another_optimizer_is_priced_with_its_state(tight):
    from ftcompile.reprice import of_run, planned, reprice

    args, _ = _resolved(tight, "--optimizer", "adam")
    r = reprice(tight, planned(_manifest(tight)), of_run(args))
    assert r is not None and [c[0] for c in r.changed] == ["optimizer"]
    planned = json.loads((tight / "plan.json").read_text())["simulation"]["gpu_peak_memory"]
    state = _state_bytes_by_gpu(tight)
    # the static part grows by the moments; the update's temporaries may add more, never less
    for g, extra in state.items():
        assert r.gpu_peak[g] - planned[g] >= extra > 0
    assert not r.fits and "needs" in r.reason


def test_a_gpu_run_the_plan_no_longer_fits_is_refused(tight, capsys):
    from ftcompile import cli_package
    from ftcompile.cli import UsageError, _Ui

    args, cli = _resolved(tight, "--optimizer", "adam")
    args.device = "cuda"
    package = load_package(tight, verify=False)
    ui = _Ui(argparse.Namespace(quiet=False, json=False))
    with pytest.raises(UsageError, match=r"optimizer sgd -> adam.*compile a plan for these.*--gpu-memory"):
        cli_package._check_planned(package, args, ui, cli)
    # GPUs with more memory than the plan's cluster, said so: priced against them, and it fits
    cli.gpu_memory = "2GB"
    cli_package._check_planned(package, args, ui, cli)
    assert "priced again for it" in capsys.readouterr().err
    cli.gpu_memory = None
    args.device = "cpu"         # on the CPU the plan's GPUs are not in use: a warning only
    cli_package._check_planned(package, args, ui, cli)
    assert "warning: the plan does not fit this run's settings (optimizer sgd -> adam)" in capsys.readouterr().err


def test_run_takes_the_plans_settings_in_its_ranks(tight, tmp_path):
    """Two real ranks: what the checkpoint records is what the plan was priced for."""
    r = subprocess.run([sys.executable, "-m", "ftcompile", "run", str(tight), "--nproc", "2", "--steps", "1",
                        "--progress", "off", "--log-dir", str(tmp_path / "log"), "--checkpoint-dir",
                        str(tmp_path / "ck")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "priced again" not in r.stderr
    meta = json.loads(next((tmp_path / "ck").glob("step-*/meta.json")).read_text())
    cfg = meta["config"]
    assert (cfg["optimizer"], cfg["recompute"], cfg["clip_grad_norm"], cfg["schedule"]) == ("sgd", True, 0.5, "1f1b")
    # `--clip-grad-norm none` turns the plan's clipping off, in every rank and in the checkpoint,
    # and a resumed run keeps the checkpoint's setting rather than taking the plan's back
    r = subprocess.run([sys.executable, "-m", "ftcompile", "run", str(tight), "--nproc", "2", "--steps", "1",
                        "--progress", "off", "--log-dir", str(tmp_path / "log2"), "--checkpoint-dir",
                        str(tmp_path / "ck2"), "--clip-grad-norm", "none"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "updates wait for all stages (clipping, --on-nonfinite skip) on -> off" in r.stderr
    meta = json.loads(next((tmp_path / "ck2").glob("step-*/meta.json")).read_text())
    assert meta["config"]["clip_grad_norm"] == 0.0
    args, _ = _resolved(tight, "--resume", "--checkpoint-dir", str(tmp_path / "ck2"), "--steps", "2")
    assert args.clip_grad_norm == 0.0


def test_simulate_prices_clipping(tmp_path, capsys):
    """gpt2-tiny ties its embedding and head: async lags their gradient unless every update waits
    for the global norm; `simulate --clip-grad-norm` must price the wait, and the plan's memory
    without the lag's copies."""
    from ftcompile.compile import problem_from_doc
    from ftcompile.profile import Profile
    from ftcompile.plan import Plan, evaluate

    out = tmp_path / "o"
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "uniform", "-q",
                 "-o", str(out), "--schedule", "async"]) == 0
    capsys.readouterr()
    figures = {}
    for extra in ([], ["--clip-grad-norm", "1"], ["--on-nonfinite", "skip"]):
        assert main(["simulate", str(out), "--json", "-o", str(tmp_path / "t.png"), *extra]) == 0
        figures[tuple(extra)] = json.loads(capsys.readouterr().out)
    lagged, clipped, skipped = figures.values()
    assert clipped["period_ms"] == skipped["period_ms"] > lagged["period_ms"]
    doc = load_plan_file(out / "plan.json")
    graph, prof = OpGraph.load(out / "graph.json"), Profile.load(out / "profile.json")
    plan = Plan.from_json(doc["plan"])
    mem = [g.memory_bytes for g in evaluate(problem_from_doc(doc, graph, prof), plan).gpus]
    flat = [g.memory_bytes for g in evaluate(problem_from_doc(doc, graph, prof, clip_grad_norm=1.0), plan).gpus]
    assert sum(flat) < sum(mem)


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "x"])
def test_compile_refuses_a_bad_clip(value, tmp_path, capsys):
    assert main(["compile", "gpt2-tiny", "-o", str(tmp_path / "o"), "--clip-grad-norm", value]) == 2
    assert "argument --clip-grad-norm: expected a" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_weight_prediction_without_an_optimizer_that_predicts_is_not_priced(tmp_path, capsys):
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "seq", "--jobs", "1",
                 "-o", str(tmp_path / "wp"), *PLANNED, "--weight-prediction"]) == 0    # 1f1b with SGD: none
    assert "--weight-prediction does nothing under --schedule 1f1b with --optimizer sgd" in capsys.readouterr().err
    assert load_plan_file(tmp_path / "wp" / "plan.json")["weight_prediction"] is False


def test_no_tied_lag_is_recorded_taken_and_priced(tmp_path, capsys):
    """A plan compiled with --no-tied-lag (gpt2-tiny ties its embedding and head): recorded, taken
    by the run, and a run turning the lag back on is priced with the lag's memory."""
    from ftcompile.reprice import of_run, planned, reprice

    out = tmp_path / "nl"
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "uniform", "-q",
                 "-o", str(out), "--schedule", "async", "--no-tied-lag"]) == 0
    doc = load_plan_file(out / "plan.json")
    assert doc["tied_lag"] is False and doc["package"]["tied_lag"] is False
    args, _ = _resolved(out)
    assert args.tied_lag is False and reprice(out, planned(_manifest(out)), of_run(args)) is None
    args, _ = _resolved(out, "--tied-lag")
    r = reprice(out, planned(_manifest(out)), of_run(args))
    assert [c[0] for c in r.changed] == ["tied_lag"]
    assert sum(r.gpu_peak) > sum(doc["simulation"]["gpu_peak_memory"])


def test_in_flight_scale_is_recorded_taken_and_priced(tmp_path):
    """--in-flight-scale 2 (async): plan.json and the package record it, the run takes it, its report
    names it, and a run at scale 1 is priced again with that change alone."""
    from ftcompile.reprice import of_run, planned, reprice

    out = tmp_path / "k2"
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "uniform", "-q",
                 "-o", str(out), "--schedule", "async", "--in-flight-scale", "2"]) == 0
    doc = load_plan_file(out / "plan.json")
    assert doc["in_flight_scale"] == 2 and doc["package"]["in_flight_scale"] == 2
    assert doc["strategies"][0]["in_flight_scale"] == 2
    assert "in-flight scale 2" in (out / "report.md").read_text()
    args, _ = _resolved(out)
    assert args.in_flight_scale == 2 and reprice(out, planned(_manifest(out)), of_run(args)) is None
    args, _ = _resolved(out, "--in-flight-scale", "1")
    r = reprice(out, planned(_manifest(out)), of_run(args))
    assert [c[0] for c in r.changed] == ["in_flight_scale"]
    # under a schedule with a flush the scale means nothing, so a run of 1f1b is not priced for it
    args, _ = _resolved(out, "--schedule", "1f1b")
    assert "in_flight_scale" not in [c[0] for c in reprice(out, planned(_manifest(out)), of_run(args)).changed]
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "-q", "-o", str(tmp_path / "bad"), "--in-flight-scale", "0"]) != 0
    assert not (tmp_path / "bad").exists()
    # a package whose recorded scale is not a whole number of at least 1 is refused by name
    from ftcompile.runtime.manifest import Manifest, ManifestError

    for bad in (0, 1.5, False):
        pkg = dict(doc["package"], in_flight_scale=bad)
        with pytest.raises(ManifestError, match="in-flight scale"):
            Manifest.from_json(pkg)


def _uniform_need(out, *extra) -> int:
    """The most memory a GPU needs (evaluate's figure, which decides fitting) in gpt2-tiny's uniform
    split on 2 GPUs under async: the split does not depend on the memory, only whether it fits."""
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "uniform", "-q",
                 "-o", str(out), "--schedule", "async", *extra]) == 0
    return max(g["memory_bytes"] for g in load_plan_file(out / "plan.json")["gpus"])


@pytest.fixture(scope="module")
def between(tmp_path_factory):
    """A GPU memory between what gpt2-tiny's uniform split needs without the tied-weight lag and with it."""
    root = tmp_path_factory.mktemp("lagfit")
    lagged, unlagged = _uniform_need(root / "l"), _uniform_need(root / "n", "--no-tied-lag")
    assert unlagged < lagged          # the lag keeps two steps of both holders' parts of the tied tensor
    return (lagged + unlagged) // 2


def test_compile_plans_without_the_lag_when_only_that_fits(between, tmp_path, capsys):
    """No plan fits with the tied-weight lag, one fits without: compile returns that one, says so,
    and records it, so the run trains without the lag."""
    out = tmp_path / "fb"
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "uniform", "--json",
                 "-o", str(out), "--schedule", "async", "--gpu-memory", str(between)]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert any("no plan fits with the tied-weight lag" in w for w in summary["warnings"])
    assert "planning again without it (--no-tied-lag)" in captured.err
    doc = load_plan_file(out / "plan.json")
    assert doc["tied_lag"] is False and doc["package"]["tied_lag"] is False
    assert all(g["memory_bytes"] <= between for g in doc["gpus"])
    assert "tied-weight lag off" in (out / "report.md").read_text()
    args, _ = _resolved(out)
    assert args.tied_lag is False


@pytest.mark.slow
def test_compile_asked_for_the_lag_suggests_turning_it_off(between, tmp_path, capsys):
    """With --tied-lag given, compile does not turn it off; its error names --no-tied-lag. (Slow:
    the error's minimum requirements bisect the memory with Seq-pipe.)"""
    out = tmp_path / "lag"
    assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", "2", "--replicas", "1", "--strategy", "uniform", "-o", str(out),
                 "--schedule", "async", "--gpu-memory", str(between), "--tied-lag"]) == 2
    err = capsys.readouterr().err
    assert "no strategy found a plan that fits" in err and "Or --no-tied-lag" in err
    assert "planning again" not in err


# --------------------------------------------------------------------------- the ranks a run has


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """gpt2-tiny's uniform split (the same whatever the memory or replicas) planned for one pipeline
    of 2 GPUs and for 2 replicas of it on 4 GPUs of one machine."""
    root = tmp_path_factory.mktemp("layouts")
    for name, gpus, replicas in (("r1", "2", "1"), ("r2", "4", "2")):
        assert main(["compile", "gpt2-tiny", "--bound-time", "0", "--gpus", gpus, "--replicas", replicas, "--strategy", "uniform", "-q",
                     "-o", str(root / name), "--schedule", "1f1b"]) == 0
    one, two = (load_plan_file(root / n / "plan.json") for n in ("r1", "r2"))
    assert one["plan"]["stages"] == two["plan"]["stages"] and two["layout"]["replicas"] == 2
    return root / "r1", root / "r2"


def test_a_run_with_other_replicas_is_priced_as_compile_prices_them(layouts):
    """Running a one-pipeline plan on 2 replicas is priced as compile prices the same split planned
    for 2 replicas (each stage's all-reduce and its bucket), and the other way round."""
    from ftcompile.reprice import of_run, planned, reprice

    r1, r2 = layouts
    for pkg, other, replicas in ((r1, r2, 2), (r2, r1, 1)):
        args, _ = _resolved(pkg)
        r = reprice(pkg, planned(_manifest(pkg)), of_run(args, replicas=replicas, rank_order="pipeline-major",
                                                          pipeline_ranks=2))
        assert [c[:3] for c in r.changed] == [("replicas", 3 - replicas, replicas)]
        sim = load_plan_file(other / "plan.json")["simulation"]
        assert r.gpu_peak == sim["gpu_peak_memory"]
        assert r.period_ms == pytest.approx(sim["period_ms"], rel=1e-9)
    # the all-reduce's bucket is memory a replicated GPU holds that a lone pipeline's does not
    assert all(a < b for a, b in zip(load_plan_file(r1 / "plan.json")["simulation"]["gpu_peak_memory"],
                                     load_plan_file(r2 / "plan.json")["simulation"]["gpu_peak_memory"]))


def test_fewer_ranks_than_planned_gpus_are_priced_on_one_device(tight):
    """One rank running both planned GPUs' stages holds both GPUs' weights, gradients and optimizer
    state on one device, beside one hardware reserve."""
    from ftcompile.reprice import of_run, planned, reprice

    args, _ = _resolved(tight)
    m = _manifest(tight)
    r = reprice(tight, planned(m), of_run(args, pipeline_ranks=1))
    assert [c[:3] for c in r.changed] == [("pipeline_ranks", 2, 1)]
    assert len(r.gpu_peak) == 1
    from ftcompile.hardware import load_hardware

    graph = OpGraph.load(tight / "graph.json")
    doc = load_plan_file(tight / "plan.json")
    reserve = load_hardware(doc["cluster"]["hardware"]).memory_reserve_bytes
    weights_and_grads = sum((8 if p.requires_grad else 4) * p.numel for p in graph.params.values())
    assert r.gpu_peak[0] >= weights_and_grads + reserve
    assert r.gpu_peak[0] > max(doc["simulation"]["gpu_peak_memory"])
    assert not r.fits and "GPU 0" in r.reason


def test_a_gpu_run_on_ranks_the_plan_does_not_fit_is_refused(layouts, capsys):
    """The launcher's check with the job's ranks, on GPUs with just the memory the one-pipeline plan
    needs: 2 replicas (the all-reduce's bucket) or one rank (both GPUs' stages on one device) are
    refused on cuda and warned about on the CPU; the plan's own ranks pass without a word."""
    from ftcompile import cli_package
    from ftcompile.cli import UsageError, _Ui

    r1, r2 = layouts
    need = max(g["memory_bytes"] for g in load_plan_file(r1 / "plan.json")["gpus"])
    assert max(g["memory_bytes"] for g in load_plan_file(r2 / "plan.json")["gpus"]) > need
    args, cli = _resolved(r1)
    cli.gpu_memory = str(need)
    package = load_package(r1, verify=False)
    ui = _Ui(argparse.Namespace(quiet=False, json=False))
    args.device = "cuda"
    cli_package._check_planned(package, args, ui, cli, ranks=(2, 1, "pipeline-major"))
    assert capsys.readouterr().err == ""
    for ranks, what in (((4, 2, "pipeline-major"), "replicas 1 -> 2"), ((1, 1, "pipeline-major"),
                                                                         "ranks per pipeline 2 -> 1")):
        with pytest.raises(UsageError, match=rf"does not fit this run's settings \({what}\).*--replicas"):
            cli_package._check_planned(package, args, ui, cli, ranks=ranks)
    args.device = "cpu"
    cli_package._check_planned(package, args, ui, cli, ranks=(4, 2, "replica-major"))
    assert "warning: the plan does not fit this run's settings (replicas 1 -> 2)" in capsys.readouterr().err
