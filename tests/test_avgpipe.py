"""AvgPipe: N parallel pipelines with elastic averaging, advance forward propagation, (M, N) tuning.

Real ranks over gloo run a 2-stage gpt2-tiny package. With one pipeline and alpha = 0 AvgPipe
must train exactly as 1F1B (bit for bit, at any advance). With two pipelines each pipeline's
weights must match :func:`elastic_reference`, a plain PyTorch loop over two copies of the
original model (not the engine, not the package's stage modules) that applies the update rule
of :mod:`ftcompile.runtime.avgpipe` by hand, and the checkpointed reference model must be
the average of its two models.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from ftcompile.runtime import load_package
from ftcompile.runtime.engine import TrainConfig
from ftcompile.runtime.schedules import stage_program

from test_runtime import call_of, compiled


# --------------------------------------------------------------------------- the order (Algorithm 1)

def algorithm_1(K: int, M: int, steps: int, advance: int) -> list[str]:
    """AvgPipe's Algorithm 1 on the first of K GPUs, written from the paper: ``K - 1 + advance``
    forwards, then forward-backward pairs, then the backwards still owed, then the update."""
    out = []
    for j in range(steps):
        base, n_adv = j * M, min(K - 1 + advance, M)
        f = b = 0
        for _ in range(n_adv):
            out.append(f"F{base + f}")
            f += 1
        for _ in range(M - n_adv):
            out.append(f"F{base + f}")
            f += 1
            out.append(f"B{base + b}")
            b += 1
        while b < M:
            out.append(f"B{base + b}")
            b += 1
        out.append(f"U{j}")
    return out


def test_first_stage_order_is_algorithm_1_and_spans_1f1b_to_afab():
    for K in (1, 2, 4):
        for M in (1, 4, 8):
            for a in range(M + 2):
                got = [str(t) for t in stage_program("avgpipe", 0, depth=K - 1, micro_batches=M, steps=2,
                                                     advance=a).tasks()]
                assert got == algorithm_1(K, M, 2, a), (K, M, a)
            afab = [str(t) for t in stage_program("gpipe", 0, depth=K - 1, micro_batches=M, steps=2).tasks()]
            one = [str(t) for t in stage_program("1f1b", 0, depth=K - 1, micro_batches=M, steps=2).tasks()]
            assert algorithm_1(K, M, 2, 0) == one and algorithm_1(K, M, 2, M) == afab


# --------------------------------------------------------------------------- the update rule

def test_elastic_rule_keeps_the_reference_the_average():
    from ftcompile.runtime.avgpipe import AvgPipeError, check

    assert check(4, None) == 0.25 and check(1, None) == 1.0
    with pytest.raises(AvgPipeError, match="--elastic-alpha"):
        check(2, 1.5)
    with pytest.raises(AvgPipeError, match="at least 1"):
        check(0, None)


# --------------------------------------------------------------------------- real ranks

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, pkg, cfg, parallel, alpha, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        from ftcompile.runtime.avgpipe import ElasticAveraging
        from ftcompile.runtime.data import load_dataset
        from ftcompile.runtime.engine import RankEngine
        from ftcompile.runtime.layout import RankLayout
        from ftcompile.runtime.transport import Launch, TorchTransport

        transport = TorchTransport(Launch(rank, world, rank, "test"))
        package = load_package(pkg)
        layout = RankLayout(world, parallel, rank)
        # alpha: a number, "default" (1/N) or None (no averaging object: plain replicas or one pipeline)
        averaging = None if alpha is None else ElasticAveraging(parallel, None if alpha == "default" else alpha)
        engine = RankEngine(package, cfg, rank=rank, world_size=world, transport=transport, layout=layout,
                            averaging=averaging)
        data = iter(load_dataset("synthetic", package.manifest, micro_batches=parallel * cfg.micro_batches,
                                 seed=cfg.seed))
        losses = []
        half = cfg.steps // 2
        # two segments, as around a checkpoint: the pending pull crosses the boundary
        engine.run(data, half, on_step=lambda r: losses.append(r["loss"]) if rank == engine.log_rank else None)
        engine.run(data, cfg.steps - half, step_offset=half,
                   on_step=lambda r: losses.append(r["loss"]) if rank == engine.log_rank else None)
        state = engine.state()
        ref = averaging.reference(state) if averaging is not None else state
        engine.finish()

        def np(st):
            return {sid: {n: t.detach().cpu().numpy().copy() for n, t in s["weights"].items()}
                    for sid, s in st.items()}
        transport.close()
        out.put((rank, layout.replica, np(state), np(ref), losses if rank == engine.log_rank else None))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        import traceback
        out.put((rank, None, traceback.format_exc(), None, None))


def run_avgpipe(pkg: Path, cfg: TrainConfig, parallel: int, alpha: float | None, world: int):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, str(pkg), cfg, parallel, alpha, out))
             for r in range(world)]
    for p in procs:
        p.start()
    res = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r[2] for r in res if r[1] is None]
    assert not errors, errors[0]

    def t(ws):
        return {sid: {n: torch.from_numpy(a) for n, a in w.items()} for sid, w in ws.items()}
    return [(rank, rep, t(ws), t(ref), losses) for rank, rep, ws, ref, losses in res]


def elastic_reference(package: Path, cfg: TrainConfig, parallel: int, alpha: float, steps: int):
    """N copies of the original model (rebuilt by name, same initial weights), each trained in one process on
    its own M micro-batches of the step's global batch with its own optimizer, then pulled:
    ``w_i(j) = v_i(j) + alpha (mean_k w_k(j-1) - w_i(j-1))``. Returns the N models' weights and their mean."""
    from ftcompile.codegen import rebuild_model
    from ftcompile.runtime import optim
    from ftcompile.runtime.data import load_dataset, split_micro_batches
    from ftcompile.runtime.ops import keyed_random_mode
    from ftcompile.runtime.engine import micro_batch_seed

    m = load_package(package).manifest
    M = cfg.micro_batches
    models, opts, prev = [], [], []
    for _ in range(parallel):
        model = rebuild_model(m.model | {"model": m.model["name"]}).model
        model.train(cfg.dropout)
        params = [p for p in model.parameters() if p.requires_grad]
        opt, _ = optim.build(params, optim.OptimConfig(cfg.optimizer, cfg.lr, cfg.momentum, cfg.betas, cfg.eps,
                                                       cfg.weight_decay, cfg.lr_schedule, cfg.warmup_steps, steps))
        models.append(model)
        opts.append((params, opt))
    batches = load_dataset("synthetic", m, micro_batches=parallel * M, seed=cfg.seed)
    for j in range(steps):
        mbs = split_micro_batches(next(batches), m, parallel * M)
        for r, (model, (params, opt)) in enumerate(zip(models, opts)):
            for i, mb in enumerate(mbs[r * M:(r + 1) * M]):
                args, kwargs = call_of(m, mb)
                with keyed_random_mode(micro_batch_seed(cfg.seed, j * parallel * M + r * M + i), enabled=cfg.dropout):
                    loss = model(*args, **kwargs)[0]
                (loss / M).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            if prev:       # the pull measured at the previous step's weights
                mean = [sum(ws[i] for ws in prev) / parallel for i in range(len(prev[0]))]
                for ws, (params, _) in zip(prev, opts):
                    for p, w, c in zip(params, ws, mean):
                        p.add_(alpha * (c - w))
            prev = [[p.detach().clone() for p in params] for params, _ in opts]
    names = [n for n, p in models[0].named_parameters() if p.requires_grad]
    weights = [{n: p.detach() for n, p in zip(names, params)} for params, _ in opts]
    mean = {n: sum(w[n] for w in weights) / parallel for n in names}
    return weights, mean


def _close(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-2)


@pytest.fixture(scope="module")
def seq2(tmp_path_factory):
    return compiled(tmp_path_factory.mktemp("avg") / "seq", "gpt2-tiny", "seq", 2)


@pytest.mark.slow
def test_one_pipeline_without_pull_trains_exactly_like_1f1b(seq2):
    base = dict(micro_batches=4, steps=4, optimizer="adam", lr=1e-3, seed=7)
    want = run_avgpipe(seq2, TrainConfig(schedule="1f1b", **base), 1, None, world=2)
    for advance in (0, 2):
        got = run_avgpipe(seq2, TrainConfig(schedule="avgpipe", advance=advance, **base), 1, 0.0, world=2)
        w = {n: t for _, _, ws, _, _ in want for s in ws.values() for n, t in s.items()}
        for rank, _, ws, ref, _ in got:
            for sid, s in ws.items():
                for n, t in s.items():
                    assert torch.equal(t, w[n]), (advance, rank, sid, n)
                    assert torch.equal(ref[sid][n], t)     # one pipeline: the reference is the model
        assert [x[4] for x in got if x[4]] == [x[4] for x in want if x[4]]


@pytest.mark.slow
def test_two_parallel_pipelines_match_a_plain_loop_with_two_models_and_their_average(seq2):
    cfg = TrainConfig(schedule="avgpipe", advance=1, micro_batches=2, steps=4, optimizer="momentum", lr=0.05,
                      seed=5)
    alpha = 0.5
    res = run_avgpipe(seq2, cfg, 2, "default", world=4)        # alpha defaults to 1/N
    models, mean = elastic_reference(seq2, cfg, 2, alpha, cfg.steps)
    apart = 0.0
    for rank, replica, ws, ref, _ in res:
        for sid, s in ws.items():
            for n, t in s.items():
                if n not in mean:
                    continue
                assert _close(t, models[replica][n]) < 2e-5, (rank, sid, n, _close(t, models[replica][n]))
                assert _close(ref[sid][n], mean[n]) < 2e-5, (rank, sid, n)
                apart = max(apart, _close(models[0][n], models[1][n]))
    # the two pipelines really differ (each saw its own batch), and both checkpoints agree bit for bit
    assert apart > 1e-4
    refs = {}
    for _, _, _, ref, _ in res:
        for s in ref.values():
            for n, t in s.items():
                refs.setdefault(n, []).append(t)
    assert all(torch.equal(c[0], x) for c in refs.values() for x in c[1:])
    losses = [x[4] for x in res if x[4] is not None]
    assert len(losses) == 1 and len(losses[0]) == cfg.steps


# --------------------------------------------------------------------------- tuning (compiler side)

@pytest.fixture(scope="module")
def tiny_problem():
    from ftcompile.cluster import load_cluster
    from ftcompile.compile import compile_plan
    from ftcompile.plan import Problem
    from test_codegen import traced

    _, graph, prof = traced("gpt2-tiny")
    problem = Problem(graph, prof, load_cluster("2xcpu").with_overrides(gpus=2), schedule="1f1b", micro_batches=4)
    return problem, compile_plan(problem, "seq", jobs=1).best().plan


def test_one_pipeline_setting_is_the_schedules_own_simulation(tiny_problem):
    from dataclasses import replace

    from ftcompile.avgpipe import setting
    from ftcompile.plan import evaluate
    from ftcompile.simulate import simulate

    problem, plan = tiny_problem
    for sched, advance in (("1f1b", 0), ("gpipe", 4)):
        pb = replace(problem, schedule=sched)
        s = setting(problem, plan, 4, 1, advance)
        assert s.step_ms == pytest.approx(simulate(pb, plan).minibatch_ms)
        assert s.memory_bytes == max(g.memory_bytes for g in evaluate(pb, plan).gpus)
    # N pipelines on the same GPUs: never faster per step than one, never more than N x one GPU's work
    one, two = setting(problem, plan, 4, 1, 0), setting(problem, plan, 4, 2, 0)
    assert one.step_ms <= two.step_ms <= 2 * one.step_ms + 1e-9
    assert two.memory_bytes > one.memory_bytes


def test_tuning_chooses_the_fastest_setting_that_fits(tiny_problem):
    from dataclasses import replace

    from ftcompile.avgpipe import setting, tune

    problem, plan = tiny_problem
    t = tune(problem, plan, micro_batches=(2, 4), parallel=(1, 2, 3))
    assert len(t.settings) == sum(len({0, m} | {2 ** i for i in range(8) if 2 ** i < m}) * 3 for m in (2, 4))
    fit = [s for s in t.settings if s.fits]
    assert t.chosen is not None and t.chosen.throughput == max(s.throughput for s in fit)
    assert all(s.predicted_step_ms > 0 and s.predicted_memory_bytes > 0 for s in t.settings)
    # a memory limit between one and two pipelines' needs: only N = 1 fits
    one = setting(problem, plan, 4, 1, 4).memory_bytes
    two = setting(problem, plan, 4, 2, 0).memory_bytes
    tight = replace(problem, cluster=problem.cluster.with_overrides(gpu_memory=(one + two) // 2))
    t = tune(tight, plan, micro_batches=(4,), parallel=(1, 2))
    assert t.chosen is not None and t.chosen.parallel == 1 and all(not s.fits for s in t.settings if s.parallel == 2)


def test_avgpipe_options_are_refused_where_they_make_no_sense():
    import argparse

    from ftcompile.runtime.avgpipe import AvgPipeError, check_options, resolved

    def ns(**kw):
        base = dict(schedule="avgpipe", parallel_pipelines=None, advance=None, elastic_alpha=None)
        base.update(kw)
        return argparse.Namespace(**base)

    assert resolved(ns(parallel_pipelines="2", advance="3")) == (2, 3, None)
    assert check_options(ns(schedule="1f1b", advance="1")) == ["--advance does nothing under --schedule 1f1b: it is for --schedule avgpipe"]
    with pytest.raises(AvgPipeError, match="belong to --schedule avgpipe"):
        check_options(ns(schedule="1f1b", parallel_pipelines="2"))
    with pytest.raises(AvgPipeError, match="whole number or 'auto'"):
        check_options(ns(parallel_pipelines="two"))
    with pytest.raises(AvgPipeError, match="at least 1"):
        check_options(ns(parallel_pipelines="0"))
    with pytest.raises(AvgPipeError, match="ftcompile run"):
        resolved(ns(parallel_pipelines="auto"))


@pytest.mark.slow
def test_cli_runs_two_parallel_pipelines_on_two_processes_and_resumes_from_the_reference(seq2, tmp_path):
    import json
    import subprocess
    import sys

    from ftcompile.runtime.checkpoint import latest

    exe = [sys.executable, "-m", "ftcompile", "run", str(seq2), "--nproc", "2", "--schedule", "avgpipe",
           "--parallel-pipelines", "2", "--advance", "1", "--optimizer", "momentum", "--lr", "0.05",
           "--data", "text", "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "log"),
           "--progress", "off", "--timeout", "120"]
    r = subprocess.run(exe + ["--steps", "3"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(exe + ["--steps", "5", "--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in (tmp_path / "log" / "train.jsonl").read_text().splitlines()]
    steps = [x for x in recs if "step" in x and "loss" in x]
    assert [x["step"] for x in steps] == list(range(5))
    assert all(x["parallel_pipelines"] == 2 and math.isfinite(x["loss"]) for x in steps)
    assert latest(tmp_path / "ck").step == 5
    bad = subprocess.run(exe + ["--steps", "3", "--nproc", "3", "--overwrite-checkpoints"], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "parallel pipelines" in bad.stderr
