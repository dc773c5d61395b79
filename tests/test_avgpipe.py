"""AvgPipe: N parallel pipelines with elastic averaging, advance forward propagation, (M, N) tuning.

Real ranks over gloo run a 2-stage gpt2-tiny package. With one pipeline and alpha = 0 AvgPipe
must train exactly as 1F1B (bit for bit, at any advance). With two pipelines each pipeline's
weights must match :func:`elastic_reference`, a plain PyTorch loop over two copies of the
original model (not the engine, not the package's stage modules) that applies the update rule
of :mod:`ftcompile.runtime.avgpipe` by hand (with momentum SGD and with Adam), and the
checkpointed reference model must be the average of its two models. A run resumed from that
checkpoint must start both models from it: its next steps are the plain loop's started there.
``ftcompile compile --schedule avgpipe`` plans one pipeline over every GPU and tunes N on it.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from ftcompile.runtime import load_package
from ftcompile.runtime.engine import TrainConfig
from ftcompile.runtime.schedules import stage_program

from ranks import RankRun, run_ranks, to_numpy, to_torch
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

def _train(r: RankRun, advances) -> tuple:
    """A rank's part: train (two segments, or one per step at the advances given), then its weights and the
    reference model (the engine's weights where there is no averaging)."""
    engine, cfg, losses = r.engine, r.cfg, []

    def log(rec):
        if r.logs:
            losses.append(rec["loss"])
    if advances is None:
        half = cfg.steps // 2
        # two segments, as around a checkpoint: the pending pull crosses the boundary
        engine.run(r.data, half, on_step=log)
        engine.run(r.data, cfg.steps - half, step_offset=half, on_step=log)
    else:
        # a per-step advance fixed by hand: one segment per step, each with its own order
        for j, k in enumerate(advances):
            engine.cfg.advance = k
            engine.run(r.data, 1, step_offset=j, on_step=log)
            assert all(st.program.advance == k for st in engine.stages.values()), (j, k)
    state = engine.state()
    ref = r.averaging.reference(state) if r.averaging is not None else state
    engine.finish()
    return r.rank, r.layout.replica, to_numpy(state), to_numpy(ref), losses if r.logs else None


def run_avgpipe(pkg: Path, cfg: TrainConfig, parallel: int, alpha: float | None, world: int, advances=None):
    """``parallel`` pipelines on ``world`` real ranks; alpha: a number, "default" (1/N) or None (no averaging object:
    plain replicas or one pipeline). Per rank: (rank, replica, weights, reference weights, losses)."""
    res = run_ranks(_train, pkg, cfg, world=world, replicas=parallel, alpha=alpha, args=(advances,))
    return [(rank, rep, to_torch(ws), to_torch(ref), losses) for rank, rep, ws, ref, losses in res]


def elastic_reference(package: Path, cfg: TrainConfig, parallel: int, alpha: float, steps: int, *, start: int = 0,
                      init: dict | None = None, data: str = "synthetic"):
    """N copies of the original model (rebuilt by name, same initial weights), each trained in one process on
    its own M micro-batches of the step's global batch with its own optimizer, then pulled:
    ``w_i(j) = v_i(j) + alpha (mean_k w_k(j-1) - w_i(j-1))``, for steps ``start`` .. ``start + steps - 1`` of
    ``data`` (the batches before ``start`` skipped, as a resumed run does). ``init``: weights and optimizer state
    by name (``checkpoint.load``) every model starts from, as a resumed run's N models should (no pull at the first
    step: all N start equal). Returns the N models' weights, their mean, each step's loss (the mean over the
    models of each one's mean over its micro-batches, what train.jsonl records) and the mean of their floating
    optimizer state by name (what a checkpoint saves)."""
    from ftcompile.codegen import rebuild_model
    from ftcompile.runtime import optim
    from ftcompile.runtime.data import load_dataset, split_micro_batches
    from ftcompile.runtime.ops import keyed_random_mode
    from ftcompile.runtime.engine import micro_batch_seed

    m = load_package(package).manifest
    M = cfg.micro_batches
    models, opts, prev, losses = [], [], [], []
    for _ in range(parallel):
        model = rebuild_model(m.model | {"model": m.model["name"]}).model
        model.train(cfg.dropout)
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        opt, _ = optim.build(params, optim.OptimConfig(cfg.optimizer, cfg.lr, cfg.momentum, cfg.betas, cfg.eps,
                                                       cfg.weight_decay, cfg.lr_schedule, cfg.warmup_steps, steps))
        if init is not None:
            kept = model.state_dict()          # a tied weight once, by its first name; persistent buffers
            with torch.no_grad():
                for n, t in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in kept)]:
                    t.copy_(init["weights"][n])
            sd = opt.state_dict()
            sd["state"] = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in
                               init["optimizer"][n].items()} for i, (n, _) in enumerate(named)
                           if n in init["optimizer"]}
            opt.load_state_dict(sd)
        models.append(model)
        opts.append((params, opt))
    batches = load_dataset(data, m, micro_batches=parallel * M, seed=cfg.seed)
    for _ in range(start):
        next(batches)
    for j in range(start, start + steps):
        mbs = split_micro_batches(next(batches), m, parallel * M)
        step_loss = 0.0
        for r, (model, (params, opt)) in enumerate(zip(models, opts)):
            for i, mb in enumerate(mbs[r * M:(r + 1) * M]):
                args, kwargs = call_of(m, mb)
                with keyed_random_mode(micro_batch_seed(cfg.seed, j, r * M + i), enabled=cfg.dropout):
                    loss = model(*args, **kwargs)[0]
                (loss / M).backward()
                step_loss += float(loss.detach()) / (M * parallel)
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
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
    states = [{n: opt.state[p] for n, p in zip(names, params) if opt.state.get(p)} for params, opt in opts]
    state = {n: {k: sum(s[n][k] for s in states) / parallel for k, v in states[0][n].items()
                 if isinstance(v, torch.Tensor) and v.is_floating_point()} for n in states[0]}
    return weights, mean, losses, state


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


def _comparable(name: str, t: torch.Tensor, optimizer: str) -> torch.Tensor:
    """``t`` less what no two correct computations need agree on: under Adam, the key third of attention's
    ``c_attn.bias``. Its gradient is zero in exact arithmetic (a bias added to every key shifts a query's
    scores by one constant, which the softmax cancels), so what either side computes is rounding noise (about
    1e-11 on gpt2-tiny), and Adam scales it to a step of about ``lr * g / eps`` (1e-6 here), whose value is
    that of the noise: about 2e-6 apart after 4 steps, as far as between 1F1B with one pipeline and a plain
    loop with one model. Momentum moves it by ``lr * g``, nothing: there it stays compared."""
    if optimizer == "adam" and name.endswith("attn.c_attn.bias"):
        d = t.numel() // 3
        return torch.cat([t[:d], t[2 * d:]])
    return t


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, lr", [("momentum", 0.05), ("adam", 1e-3)])
def test_two_parallel_pipelines_match_a_plain_loop_with_two_models_and_their_average(seq2, optimizer, lr):
    cfg = TrainConfig(schedule="avgpipe", advance=1, micro_batches=2, steps=4, optimizer=optimizer, lr=lr, seed=5)
    alpha = 0.5
    res = run_avgpipe(seq2, cfg, 2, "default", world=4)        # alpha defaults to 1/N
    models, mean, want_losses, _ = elastic_reference(seq2, cfg, 2, alpha, cfg.steps)
    apart = 0.0
    for rank, replica, ws, ref, _ in res:
        for sid, s in ws.items():
            for n, t in s.items():
                if n not in mean:
                    continue
                got, want = _comparable(n, t, optimizer), _comparable(n, models[replica][n], optimizer)
                assert _close(got, want) < 2e-5, (rank, sid, n, _close(got, want))
                got, want = _comparable(n, ref[sid][n], optimizer), _comparable(n, mean[n], optimizer)
                assert _close(got, want) < 2e-5, (rank, sid, n)
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
    assert len(losses) == 1 and losses[0] == pytest.approx(want_losses, rel=1e-5)


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
    # two processes per GPU, each holding what the one-pipeline plan gives that GPU (its reserve too: a
    # CUDA context and allocator each), a copy of its trainable weights (the pending pull) and the
    # all-reduce bucket (the tiny model's weights fit one 32 MiB bucket: another copy)
    gpus = evaluate(problem, plan).gpus
    model = dict(problem.profile.params)

    def trainable(gpu):
        names = {p for st in plan.stages if st.gpu == gpu for n in st.nodes for p in problem.graph.node(n).params}
        assert sum(model[n].bytes for n in names) < 32 * 2**20
        return sum(model[n].bytes for n in names if model[n].grad_bytes)
    assert two.memory_bytes == max(2 * (g.memory_bytes + 2 * trainable(g.gpu)) for g in gpus)
    three = setting(problem, plan, 4, 3, 0)        # and the bucket's float64 sum
    assert three.memory_bytes == max(3 * (g.memory_bytes + 4 * trainable(g.gpu)) for g in gpus)


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


_COMPILE = ["-m", "ftcompile", "compile", "gpt2-tiny", "--cluster", "2xcpu", "--gpus", "2", "--schedule", "avgpipe",
            "--strategy", "seq", "-q"]


@pytest.mark.slow
def test_compile_plans_one_pipeline_over_every_gpu_and_tunes_n_on_it(tmp_path):
    """AvgPipe's N pipelines are the runtime's replicas: ``--replicas`` auto plans one pipeline over both GPUs
    (not data-parallel copies of a smaller one) and tunes N for that plan."""
    import json
    import subprocess
    import sys

    exe = [sys.executable, *_COMPILE]
    r = subprocess.run(exe + ["--parallel-pipelines", "auto", "-o", str(tmp_path / "pkg")], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "pkg" / "plan.json").read_text())
    assert doc["layout"]["replicas"] == 1 and doc["layout"]["pipeline_gpus"] == 2
    assert (doc.get("replicas") or {}).get("replicas", 1) == 1        # no data-parallel layout chosen
    assert {st["gpu"] for st in doc["stages"]} == {0, 1}
    tuning = doc["avgpipe"]
    chosen = tuning["chosen"]
    picked = [st for st in tuning["settings"] if (st["micro_batches"], st["parallel"], st["advance"]) ==
              (chosen["micro_batches"], chosen["parallel_pipelines"], chosen["advance"])]
    assert len(picked) == 1 and picked[0]["fits"]
    assert any(st["parallel"] == 2 for st in tuning["settings"])
    # every setting priced on the plan's two GPUs (the N pipelines share both)
    assert all(len(st["gpu_memory"]) == 2 for st in tuning["settings"])


def test_compile_refuses_replicas_with_avgpipe_before_any_work(tmp_path):
    """``--replicas 2`` with ``--schedule avgpipe`` is refused in one line naming ``--parallel-pipelines``,
    before tracing, writing nothing."""
    import subprocess
    import sys

    bad = subprocess.run([sys.executable, *_COMPILE, "--replicas", "2", "-o", str(tmp_path / "no")],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2, bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "--replicas 2 with --schedule avgpipe" in bad.stderr
    assert "--parallel-pipelines" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "no").exists()


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
    """Two pipelines checkpoint their reference model at step 3; resumed, both must start from it (weights and
    momentum): steps 3 and 4 then train as a plain loop whose two models both start from that checkpoint."""
    import json
    import subprocess
    import sys

    from ftcompile.runtime import checkpoint as ckpt

    M, seed = 2, 3
    exe = [sys.executable, "-m", "ftcompile", "run", str(seq2), "--nproc", "2", "--schedule", "avgpipe",
           "--parallel-pipelines", "2", "--advance", "1", "--optimizer", "momentum", "--lr", "0.05",
           "--micro-batches", str(M), "--seed", str(seed), "--data", "text", "--checkpoint-dir", str(tmp_path / "ck"),
           "--log-dir", str(tmp_path / "log"), "--progress", "off", "--timeout", "120"]

    def everything(ck):
        return ckpt.load(ck, [k for k in ckpt.keys(ck) if not k.startswith(ckpt.OPTIMIZER_PREFIX)])

    r = subprocess.run(exe + ["--steps", "3"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    ck3 = ckpt.latest(tmp_path / "ck")
    assert ck3.step == 3
    at3 = everything(ck3)
    r = subprocess.run(exe + ["--steps", "5", "--resume"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in (tmp_path / "log" / "train.jsonl").read_text().splitlines()]
    steps = [x for x in recs if "step" in x and "loss" in x]
    assert [x["step"] for x in steps] == list(range(5))
    assert all(x["parallel_pipelines"] == 2 and math.isfinite(x["loss"]) for x in steps)
    ck5 = ckpt.latest(tmp_path / "ck")
    assert ck5.step == 5
    at5 = everything(ck5)

    # the same two steps in a plain loop, both models started from the step-3 checkpoint. Step 3's loss is
    # each model's on its own batch at the checkpoint's weights (one pipeline started elsewhere changes it),
    # step 4's and the step-5 reference take the momentum too; both pipelines' states are in the reference.
    cfg = TrainConfig(schedule="avgpipe", micro_batches=M, optimizer="momentum", lr=0.05, seed=seed)
    _, mean, losses, state = elastic_reference(seq2, cfg, 2, 0.5, 2, start=3, init=at3, data="text")
    assert [x["loss"] for x in steps[3:]] == pytest.approx(losses, rel=1e-5)
    assert at5["weights"].keys() >= mean.keys() and len(mean) > 10
    for n, want in mean.items():
        assert _close(at5["weights"][n], want) < 2e-5, (n, _close(at5["weights"][n], want))
        assert not torch.equal(at5["weights"][n], at3["weights"][n]), n
        got = at5["optimizer"][n]["momentum_buffer"]
        assert _close(got, state[n]["momentum_buffer"]) < 2e-5, n
    bad = subprocess.run(exe + ["--steps", "3", "--nproc", "3", "--overwrite-checkpoints"], capture_output=True,
                         text=True, timeout=600)
    assert bad.returncode == 2 and "parallel pipelines" in bad.stderr


# --------------------------------------------------------------------------- Algorithm 1 at run time (--advance adapt)

def _fig(rank, seconds, peak, *, advance=0, live=1000, limit=None, now=1, nxt=2):
    return {"rank": rank, "advance": advance, "seconds": seconds, "peak_bytes": peak, "live_bytes": live,
            "limit_bytes": limit, "memory": "tensors", "in_flight": now, "in_flight_next": nxt}


def test_advance_options_parse_and_bad_values_are_refused():
    import argparse

    from ftcompile.runtime.avgpipe import Adapt, AvgPipeError, adaptive, check_options, parse_advance, resolved

    assert parse_advance("adapt") == Adapt(None, "adapt")
    assert parse_advance("adapt:1.5GiB").limit == 3 * 2 ** 29
    assert parse_advance("adapt:800MB").limit == 800_000_000 and parse_advance("adapt:2e6").limit == 2_000_000
    assert parse_advance("3") == 3 and parse_advance("auto") == "auto" and parse_advance(None) is None
    for bad, why in (("adapt:", "memory limit after the colon"), ("adapt:lots", "cannot read the memory limit"),
                     ("adapt:0", "positive size"), ("adapt:-1GB", "cannot read"), ("adaptive", "whole number"),
                     ("-1", "0 or more"), ("1.5", "adapt\\[:LIMIT\\]")):
        with pytest.raises(AvgPipeError, match=why):
            parse_advance(bad)

    def ns(**kw):
        return argparse.Namespace(**(dict(schedule="avgpipe", parallel_pipelines=None, advance=None,
                                          elastic_alpha=None) | kw))
    assert resolved(ns(advance="adapt:1GB")) == (1, 0, None)        # adapting starts as 1F1B
    assert adaptive(ns(advance="adapt:1GB")).limit == 10 ** 9 and adaptive(ns(advance="2")) is None
    with pytest.raises(AvgPipeError, match="adapts the schedule avgpipe"):
        check_options(ns(schedule="1f1b", advance="adapt"))


def test_tuner_raises_while_faster_and_settles_back_when_not():
    from ftcompile.runtime.avgpipe import Adapt, AdvanceTuner

    t = AdvanceTuner(Adapt(), micro_batches=4)
    seen = []
    for seconds in (9.0, 1.0, 0.8, 0.7, 0.699, 0.1):    # warm-up, K=0, K=1, K=2, K=3 (not faster), settled
        d = t.observe([_fig(0, seconds, 10, advance=t.advance), _fig(1, seconds / 2, 10, advance=t.advance)],
                      len(seen))
        seen.append((d["advance"], d["action"], d["next_advance"]))
    assert seen == [(0, "hold", 0), (0, "raise", 1), (1, "raise", 2), (2, "raise", 3), (3, "settle", 2),
                    (2, "hold", 2)]
    assert not t.adapting and t.advance == 2 and "not faster" in t.reason
    # every raise that stays faster ends at all-forward-all-backward, K = M, never beyond
    t = AdvanceTuner(Adapt(), micro_batches=2)
    for j, seconds in enumerate((5.0, 1.0, 0.5, 0.2)):
        d = t.observe([_fig(0, seconds, 10, advance=t.advance)], j)
    assert d["action"] == "settle" and t.advance == 2 and "= M" in t.reason


def test_tuner_keeps_to_the_memory_limit_and_refuses_ranks_that_disagree():
    from ftcompile.runtime.avgpipe import Adapt, AdvanceTuner, AvgPipeError

    # (peak - live) / in flight = 500 bytes per micro-batch: K = 1 (one more in flight) is predicted at 2500
    t = AdvanceTuner(Adapt(2400), micro_batches=4)
    t.observe([_fig(0, 2.0, 2000, limit=2400)], 0)
    d = t.observe([_fig(0, 1.0, 2000, live=1000, now=2, nxt=3, limit=2400)], 1)
    assert d["next_advance"] == 0 and d["predicted_next_peak_bytes"] == {"0": 2500} and "memory" in d["reason"]
    # room for K = 1; the measured growth of that raise (900 bytes) then predicts K = 2 over the limit
    t = AdvanceTuner(Adapt(3500), micro_batches=4)
    t.observe([_fig(0, 2.0, 2000, limit=3500)], 0)
    assert t.observe([_fig(0, 1.0, 2000, now=2, nxt=3, limit=3500)], 1)["next_advance"] == 1
    d = t.observe([_fig(0, 0.5, 2900, advance=1, now=3, nxt=4, limit=3500)], 2)
    assert d["next_advance"] == 1 and d["predicted_next_peak_bytes"] == {"0": 3800}
    # a measured peak over the limit goes back one and stays there
    t = AdvanceTuner(Adapt(3000), micro_batches=4)
    t.observe([_fig(0, 2.0, 2000, limit=3000)], 0)
    t.observe([_fig(0, 1.0, 2000, live=1900, limit=3000)], 1)
    d = t.observe([_fig(0, 0.5, 3100, advance=1, limit=3000)], 2)
    assert (d["action"], d["next_advance"]) == ("settle", 0) and "peaked at 3100" in d["reason"]
    # one advance per step on every rank, or the run stops
    t = AdvanceTuner(Adapt(), micro_batches=4)
    with pytest.raises(AvgPipeError, match="the ranks ran advances"):
        t.observe([_fig(0, 1.0, 10, advance=0), _fig(1, 1.0, 10, advance=1)], 0)


def _steps(log: Path) -> list[dict]:
    import json

    return [json.loads(x) for x in (log / "train.jsonl").read_text().splitlines() if '"step"' in x]


def _cli(pkg, *extra, timeout=600):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "ftcompile", "run", str(pkg), "--schedule", "avgpipe",
                           "--progress", "off", "--timeout", "120", *extra], capture_output=True, text=True,
                          timeout=timeout)


def test_bad_adapt_values_are_refused_before_any_rank_starts(seq2, tmp_path):
    for extra, why in ((["--advance", "adapt:many"], "cannot read the memory limit"),
                       (["--advance", "adapt:0GB"], "positive size"),
                       (["--advance", "adapt", "--schedule", "1f1b"], "adapts the schedule avgpipe")):
        r = _cli(seq2, "--nproc", "2", "--log-dir", str(tmp_path / "log"), *extra, timeout=120)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "log").exists()
    # compile and simulate price one advance: adapt is refused there with the reason
    import argparse

    from ftcompile.avgpipe import TuneError, problem_advance
    with pytest.raises(TuneError, match="is for `ftcompile run`"):
        problem_advance(argparse.Namespace(schedule="avgpipe", advance="adapt:1GB", parallel_pipelines=None))


@pytest.mark.slow
def test_adapted_run_trains_as_its_advance_sequence_fixed_by_hand_and_every_rank_agrees(seq2, tmp_path):
    steps, M = 6, 4
    r = _cli(seq2, "--nproc", "2", "--parallel-pipelines", "2", "--advance", "adapt", "--micro-batches", str(M),
             "--steps", str(steps), "--optimizer", "momentum", "--lr", "0.05", "--seed", "3",
             "--log-dir", str(tmp_path / "log"))
    assert r.returncode == 0, r.stderr
    recs = _steps(tmp_path / "log")
    ks = [x["advance"] for x in recs]
    assert [x["step"] for x in recs] == list(range(steps))
    # Algorithm 1: starts as 1F1B (a warm-up step, a measured one), then tries one more in advance
    assert ks[:3] == [0, 0, 1] and all(0 <= k <= M for k in ks)
    for x in recs:
        t = x["advance_tuning"] if "advance_tuning" in x else None
        if t is None:             # settled: the rest of the run in one segment at the settled advance
            continue
        # every rank (both parallel pipelines) ran this step's advance, as its own stages' programs say
        assert t["advance_by_rank"] == {"0": x["advance"], "1": x["advance"]}, t
        assert t["step_s"] == max(v["seconds"] for v in x["ranks"].values())
    for a, b in zip(recs, recs[1:]):
        if "advance_tuning" in a:
            assert b["advance"] == a["advance_tuning"]["next_advance"]
            assert b["advance"] - a["advance"] <= 1        # one more per step at most
    # the same advances fixed by hand, one segment per step: the same losses, bit for bit (the order moves
    # forwards earlier; each step still sums its micro-batches' gradients in the same order)
    cfg = TrainConfig(schedule="avgpipe", micro_batches=M, steps=steps, optimizer="momentum", lr=0.05, seed=3)
    res = run_avgpipe(seq2, cfg, 2, "default", world=2, advances=ks)
    losses = [x[4] for x in res if x[4] is not None]
    assert losses == [[x["loss"] for x in recs]]


@pytest.mark.slow
def test_adapt_never_raises_past_a_limit_below_what_one_more_in_advance_needs(seq2, tmp_path):
    common = ["--nproc", "2", "--micro-batches", "4", "--measure-memory"]

    def steady_peak(advance):
        r = _cli(seq2, *common, "--advance", str(advance), "--steps", "3", "--log-dir", str(tmp_path / f"k{advance}"))
        assert r.returncode == 0, r.stderr
        return max(v["memory_bytes"] for x in _steps(tmp_path / f"k{advance}")[1:] for v in x["ranks"].values())

    p0, p1 = steady_peak(0), steady_peak(1)
    assert p1 > p0
    limit = (p0 + p1) // 2
    r = _cli(seq2, *common, "--advance", f"adapt:{limit}", "--steps", "4", "--log-dir", str(tmp_path / "adapt"))
    assert r.returncode == 0, r.stderr
    recs = _steps(tmp_path / "adapt")
    assert [x["advance"] for x in recs] == [0, 0, 0, 0]
    t = recs[1]["advance_tuning"]
    assert t["action"] == "settle" and t["reason"].startswith("memory: advance 1 would peak")
    assert max(t["predicted_next_peak_bytes"].values()) > limit >= max(t["peak_bytes"].values())
    assert all(v["memory_bytes"] <= limit for x in recs[1:] for v in x["ranks"].values())


@pytest.mark.slow
def test_resume_keeps_the_adapted_advance(seq2, tmp_path):
    import json

    from ftcompile.runtime.checkpoint import latest

    common = ["--nproc", "2", "--micro-batches", "2", "--advance", "adapt", "--checkpoint-dir", str(tmp_path / "ck"),
              "--log-dir", str(tmp_path / "log")]
    r = _cli(seq2, *common, "--steps", "5")
    assert r.returncode == 0, r.stderr
    saved = json.loads((latest(tmp_path / "ck").folder / "meta.json").read_text())["avgpipe_advance"]
    decided = [x["advance_tuning"] for x in _steps(tmp_path / "log") if "advance_tuning" in x]
    assert saved["spec"] == "adapt" and saved["advance"] == decided[-1]["next_advance"]
    r = _cli(seq2, *common[:-4], "--checkpoint-dir", str(tmp_path / "ck"), "--log-dir", str(tmp_path / "log"),
             "--steps", "7", "--resume")
    assert r.returncode == 0, r.stderr
    recs = _steps(tmp_path / "log")
    assert [x["step"] for x in recs] == list(range(7))
    assert recs[5]["advance"] == saved["advance"]
    if saved["settled"]:
        assert "keeping the checkpoint's advance" in r.stderr
        assert [x["advance"] for x in recs[5:]] == [saved["advance"]] * 2 and "advance_tuning" not in recs[5]
    else:
        assert recs[5]["advance_tuning"]["reason"].startswith("warm-up")


def test_the_averaging_thread_keeps_no_displacement_once_taken():
    """The runtime holds one weight-sized buffer per stage for the pull, as ftcompile.avgpipe counts:
    once the engine has taken and applied a step's displacement, nothing else keeps it alive (the
    background thread held it while waiting for its next job: a second copy on the GPU, 0.8 GB
    per rank for gpt2-medium on an H200)."""
    import threading
    import weakref

    from ftcompile.runtime.avgpipe import _StageAverager

    arrived = threading.Event()
    # the all-reduce of two members holding equal weights: the sum is twice one's
    avg = _StageAverager(0, 2, 0.5, lambda t: t.mul_(2), arrived.set)
    try:
        snapshot = [torch.randn(64, 64), torch.randn(64)]
        refs = [weakref.ref(t) for t in snapshot]
        avg.submit(0, snapshot, "pull")
        del snapshot
        assert arrived.wait(30)
        disp = avg.take(0)
        assert all(float(d.abs().max()) == 0.0 for d in disp)      # equal members: no displacement
        del disp
        assert [r() for r in refs] == [None, None]
    finally:
        avg.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pull_holds_what_the_tuner_counts(dtype):
    """The averaging's own bytes while it all-reduces a snapshot of three pipelines' weights, counted
    tensor by tensor (runtime.memory): one flat bucket and its float64 sum, which is twice the bucket
    for float32 weights and four times for bfloat16 (ftcompile.avgpipe.pull_bytes)."""
    from ftcompile.runtime.avgpipe import _StageAverager
    from ftcompile.runtime.memory import MemoryMeter

    avg = _StageAverager(0, 3, 1 / 3, lambda t: t.mul_(3), lambda: None)
    try:
        snapshot = [torch.randn(256, 256).to(dtype), torch.randn(256).to(dtype), torch.randn(64, 256).to(dtype)]
        bucket = sum(t.numel() * t.element_size() for t in snapshot)      # under 32 MiB: one bucket
        meter = MemoryMeter()
        meter.track_all(snapshot)
        with meter.tracking():
            avg._pull(snapshot)          # what the averaging thread runs, here on this thread to be metered
        extra = meter.take_peak() - bucket
        assert extra == bucket * (1 + 8 // snapshot[0].element_size()), (extra, bucket)
    finally:
        avg.close()
