"""Checkpoints, logs and options of training runs: what is written, what a resume does, what is refused.

Runs are real (``ftcompile run`` on two ranks over gloo, a gpt2-tiny package compiled for two
GPUs); references are computed independently (the original model trained by a plain PyTorch
loop, or an uninterrupted run compared bit for bit).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftcompile.runtime import checkpoint as ckpt
from ftcompile.runtime import load_package
from ftcompile.runtime import optim
from ftcompile.runtime.lock import FolderBusy, acquire
from ftcompile.runtime.runlog import open_log

from test_faults import LIMIT, Run, log_records, runs, wait_until  # noqa: F401 - runs is a fixture
from test_runtime import TOL, by_hand, call_of, compiled, rel_error, run_cli

PY = sys.executable


@pytest.fixture(scope="module")
def pkgs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"seq": compiled(root / "seq", "gpt2-tiny", "seq", 2),
            "interleaved": by_hand(root / "interleaved", "gpt2-tiny", stages=4, gpus=2)}


def args_for(pkg: Path, tmp: Path, *extra: str, steps: int = 2, nproc: int = 2, optimizer: str = "momentum",
             lr: str | None = "0.05") -> list[str]:
    a = [str(pkg), "--nproc", str(nproc), "--schedule", "1f1b", "--micro-batches", "4", "--seed", "3",
         "--steps", str(steps), "--checkpoint-dir", str(tmp / "ckpt"), "--log-dir", str(tmp / "log"),
         "--progress", "off", "--timeout", "120", "--optimizer", optimizer]
    if lr is not None:
        a += ["--lr", lr]
    return a + list(extra)


def ok(r: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    return r


def refused(r: subprocess.CompletedProcess, *says: str) -> str:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("error:") == 1, r.stderr
    for s in says:
        assert s in r.stderr, (s, r.stderr)
    return r.stderr


def steps_in(log: Path) -> list[int]:
    return [r["step"] for r in log_records(log)]


def plain_training(package: Path, lrs: list[float], *, momentum: float = 0.9, seed: int = 3, M: int = 4):
    """The original model in one process, SGD with momentum, lr ``lrs[j]`` at step ``j`` (the reference)."""
    from ftcompile.codegen import rebuild_model
    from ftcompile.runtime.data import load_dataset, split_micro_batches
    from ftcompile.runtime.engine import micro_batch_seed
    from ftcompile.runtime.ops import keyed_random_mode

    m = load_package(package).manifest
    model = rebuild_model(m.model | {"model": m.model["name"]}).model
    model.train(True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lrs[0], momentum=momentum)
    batches = load_dataset("synthetic", m, micro_batches=M, seed=seed)
    for j, lr in enumerate(lrs):
        for g in opt.param_groups:
            g["lr"] = lr
        for i, mb in enumerate(split_micro_batches(next(batches), m, M)):
            args, kwargs = call_of(m, mb)
            with keyed_random_mode(micro_batch_seed(seed, j, i), enabled=True):
                loss = model(*args, **kwargs)[0]
            (loss / M).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in model.named_parameters()}


def assert_weights(ck_dir: Path, want: dict[str, torch.Tensor]) -> None:
    got = ckpt.load_weights(ckpt.latest(ck_dir))
    for n, t in want.items():
        assert rel_error(got[n], t) < TOL, (n, rel_error(got[n], t))


# --------------------------------------------------------------------------- format

def test_checkpoint_holds_each_tensor_once_by_name_and_records_the_run(pkgs, tmp_path):
    """Tied weights held by stages on both ranks are written once; optimizer state is per parameter name."""
    pkg = pkgs["interleaved"]
    m = load_package(pkg).manifest
    assert len({h for h in m.shared_params()["transformer.wte.weight"]}) == 2
    ok(run_cli(*args_for(pkg, tmp_path, steps=1)))
    last = ckpt.latest(tmp_path / "ckpt")
    from safetensors import safe_open

    seen: dict[str, int] = {}
    for f in last.folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                seen[k] = seen.get(k, 0) + 1
    assert all(n == 1 for n in seen.values()), [k for k, n in seen.items() if n > 1]
    weights = {k for k in seen if not k.startswith("optimizer/")}
    assert weights == set(m.params)
    trainable = {n for n, p in m.params.items() if p.trainable}
    assert {k for k in seen if k.startswith("optimizer/")} == {f"optimizer/{n}/momentum_buffer" for n in trainable}
    meta = last.meta
    assert meta["package"] == m.generator["graph_hash"] and meta["step"] == 1
    assert meta["config"]["optimizer"] == "momentum" and meta["config"]["lr"] == 0.05
    assert meta["run_id"] == log_records(tmp_path / "log" / "train.jsonl")[0]["run"]
    assert json.loads((tmp_path / "ckpt" / "latest").read_text())["run_id"] == meta["run_id"]


def test_a_checkpoint_resumes_into_another_plan_and_another_rank_count(pkgs, tmp_path):
    """Keyed by name, a checkpoint of the 2-stage plan continues in the 4-stage plan of the same model,
    on two ranks and then on one, and ends where plain training of the model ends."""
    ok(run_cli(*args_for(pkgs["seq"], tmp_path, steps=2)))
    ok(run_cli(*args_for(pkgs["interleaved"], tmp_path, "--resume", steps=3)))
    ok(run_cli(*args_for(pkgs["interleaved"], tmp_path, "--resume", steps=4, nproc=1)))
    assert steps_in(tmp_path / "log" / "train.jsonl") == [0, 1, 2, 3]
    assert_weights(tmp_path / "ckpt", plain_training(pkgs["seq"], [0.05] * 4))


def test_named_optimizer_state_continues_training_exactly():
    """In one process: Adam's state by name, loaded into a new Adam over the parameters in another order,
    continues bit for bit; the new optimizer's lr is its own."""
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))

    def steps(opt, params, n, first=0):
        for i in range(first, first + n):
            loss = (params[0] @ params[1]).pow(2).sum() + float(i) * params[1].sum()
            loss.backward()
            opt.step()
            opt.zero_grad()

    whole = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    o = torch.optim.Adam(whole, lr=1e-2)
    steps(o, whole, 5)
    part = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    o1 = torch.optim.Adam(part, lr=1e-2)
    steps(o1, part, 3)
    state = optim.named_state(o1, {"a": part[0], "b": part[1]})
    assert set(state) == {"a", "b"} and set(state["a"]) == {"step", "exp_avg", "exp_avg_sq"}
    fresh = [part[0].detach().clone().requires_grad_(), part[1].detach().clone().requires_grad_()]
    o2 = torch.optim.Adam([fresh[1], fresh[0]], lr=1e-2)
    optim.load_named_state(o2, {"a": fresh[0], "b": fresh[1]}, state, "adam")
    steps(o2, fresh, 2, first=3)
    assert torch.equal(fresh[0], whole[0]) and torch.equal(fresh[1], whole[1])
    o3 = torch.optim.SGD([fresh[0]], lr=0.5, momentum=0.9)
    optim.load_named_state(o3, {"a": fresh[0]}, state, "momentum")      # nothing of Adam's applies
    assert not o3.state and o3.param_groups[0]["lr"] == 0.5
    assert optim.resume_change("adam", "adamw") is None and optim.resume_change("momentum", "sgd") is None
    assert "means nothing to sgd" in optim.resume_change("adam", "sgd")


# --------------------------------------------------------------------------- 1: runs never mix

def test_a_fresh_run_refuses_a_folder_of_another_run(pkgs, tmp_path):
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, lr="0.001")))
    latest_before = (tmp_path / "ckpt" / "latest").read_bytes()
    log_before = (tmp_path / "log" / "train.jsonl").read_bytes()
    r = run_cli(*args_for(pkg, tmp_path, lr="0.002"))
    assert r.returncode == 2, r.stderr
    assert (tmp_path / "ckpt" / "latest").read_bytes() == latest_before
    assert (tmp_path / "log" / "train.jsonl").read_bytes() == log_before
    first = ckpt.latest(tmp_path / "ckpt")
    refused(r, f"holds checkpoints of run {first.run_id} up to step 2", "--resume", "--overwrite-checkpoints")
    ok(run_cli(*args_for(pkg, tmp_path, "--overwrite-checkpoints", lr="0.002")))
    second = ckpt.latest(tmp_path / "ckpt")
    assert second.run_id != first.run_id
    assert {json.loads((d / "meta.json").read_text())["run_id"] for d in (tmp_path / "ckpt").glob("step-*")} == \
        {second.run_id}
    # A step folder of another run named by 'latest' is refused, not mixed in.
    stray = tmp_path / "ckpt" / "step-00000009"
    shutil.copytree(first.folder if first.folder.exists() else second.folder, stray)
    meta = json.loads((stray / "meta.json").read_text())
    meta["run_id"] = first.run_id
    (stray / "meta.json").write_text(json.dumps(meta))
    (tmp_path / "ckpt" / "latest").write_text(json.dumps({"folder": stray.name, "step": 9,
                                                          "run_id": second.run_id}))
    refused(run_cli(*args_for(pkg, tmp_path, "--resume", steps=12)), "mixes two runs")


def test_a_fresh_run_killed_while_overwriting_leaves_none_of_the_old_run(pkgs, tmp_path, runs):
    """The issue's sequence: a new run (lr 0.002) into the folder of an old one (lr 0.001), rank 0 killed
    as it writes its first checkpoint. Nothing of the old run may remain to be resumed."""
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "1", steps=5, lr="0.001")))
    old = ckpt.latest(tmp_path / "ckpt").run_id
    r = Run(args_for(pkg, tmp_path, "--overwrite-checkpoints", "--checkpoint-every", "5", steps=100000,
                     lr="0.002"), tmp_path)
    runs.append(r)

    def writing() -> bool:
        try:
            return any(p.name.startswith(".tmp-step-") for p in os.scandir(tmp_path / "ckpt"))
        except FileNotFoundError:
            return False
    wait_until(writing, "the first checkpoint of the new run", every=0.002)
    os.kill(r.ranks()[0], signal.SIGKILL)
    assert r.wait() == 128 + signal.SIGKILL, r.stderr
    ids = {json.loads((d / "meta.json").read_text())["run_id"] for d in (tmp_path / "ckpt").glob("step-*")
           if (d / "meta.json").exists()}
    assert old not in ids
    last = ckpt.latest(tmp_path / "ckpt")
    assert last is None or last.run_id != old
    resumed = run_cli(*args_for(pkg, tmp_path, "--resume", steps=7, lr="0.002"))
    if last is None:
        refused(resumed, "no checkpoint")
    else:
        ok(resumed)


# --------------------------------------------------------------------------- 3-5: logs and temporaries

def test_a_refused_run_keeps_the_previous_log(pkgs, tmp_path):
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path / "a")))
    log = tmp_path / "a" / "log" / "train.jsonl"
    before = log.read_bytes()
    bad = tmp_path / "damaged"
    shutil.copytree(pkg, bad)
    # stage 0's rank is not the one that writes the log
    w = bad / "weights" / "stage_0.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    r = run_cli(*args_for(bad, tmp_path / "b", "--log-dir", str(log.parent)))
    assert log.read_bytes() == before
    assert not list(log.parent.glob("train.*.jsonl"))
    refused(r, str(w), "checksum mismatch")
    # A new run into the same log folder moves the old log aside: nothing lost, nothing mixed.
    ok(run_cli(*args_for(pkg, tmp_path / "c", "--log-dir", str(log.parent))))
    assert (log.parent / "train.1.jsonl").read_bytes() == before
    assert len({x["run"] for x in log_records(log)}) == 1 and steps_in(log) == [0, 1]


def test_resume_keeps_one_log_record_per_step(pkgs, tmp_path):
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "2", steps=4)))
    log = tmp_path / "log" / "train.jsonl"
    assert steps_in(log) == [0, 1, 2, 3]
    # Go back to step 2 (a crash after step 3, or by hand: the folder name into 'latest').
    (tmp_path / "ckpt" / "latest").write_text("step-00000002\n")
    r = ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "2", "--resume", steps=6)))
    assert steps_in(log) == [0, 1, 2, 3, 4, 5], r.stderr
    assert steps_in(tmp_path / "log" / "train.1.jsonl") == [0, 1, 2, 3]
    assert "dropped" in r.stderr


def test_a_resumed_run_keeps_its_checkpoint_interval_and_log_folder(pkgs, tmp_path):
    """`run --checkpoint-dir C --resume` (the README's line after a crash) goes on checkpointing every N
    steps into the same train.jsonl, as the interrupted run did: a second crash loses at most N steps."""
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "2", steps=4)))
    (tmp_path / "ckpt" / "latest").write_text("step-00000002\n")      # as if it died after step 3
    shutil.rmtree(tmp_path / "ckpt" / "step-00000004")
    resume = [a for a in args_for(pkg, tmp_path, "--resume", steps=8)]
    i = resume.index("--log-dir")
    del resume[i:i + 2]                                                  # neither --log-dir nor --checkpoint-every
    r = ok(run_cli(*resume))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == \
        [f"step-0000000{s}" for s in (2, 4, 6, 8)], r.stderr
    assert steps_in(tmp_path / "log" / "train.jsonl") == list(range(8))
    assert "logging into the resumed run's log folder" in r.stderr
    assert not (pkg / "runs" / "1f1b" / "train.jsonl").exists() or \
        steps_in(pkg / "runs" / "1f1b" / "train.jsonl") != list(range(2, 8))


def test_checkpoint_every_0_turns_the_inherited_interval_off(pkgs, tmp_path):
    """A resumed run given --checkpoint-every 0 checkpoints only at its end, and records that."""
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "1", steps=2)))
    ok(run_cli(*args_for(pkg, tmp_path, "--resume", "--checkpoint-every", "0", steps=5)))
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step-*")) == ["step-00000001", "step-00000002",
                                                                           "step-00000005"]
    meta = json.loads((tmp_path / "ckpt" / "step-00000005" / "meta.json").read_text())
    assert meta["config"]["checkpoint_every"] == 0


def test_keep_checkpoints_deletes_only_older_step_folders_beyond_k(pkgs, tmp_path):
    """--keep-checkpoints 2: after each save, the two newest step folders remain; a resumed run
    keeps the setting; step folders after the resumed step (an abandoned continuation) are left."""
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "1", "--keep-checkpoints", "2", steps=4)))
    root = tmp_path / "ckpt"
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000003", "step-00000004"]
    assert not list(root.glob(".tmp-*"))
    (root / "latest").write_text("step-00000003\n")        # resume from step 3, step 4 left as it was
    ok(run_cli(*args_for(pkg, tmp_path, "--resume", steps=6)))
    # step 4 of this run replaced the old one; 5 and 6 followed, each keeping two
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000005", "step-00000006"]
    meta = json.loads((root / "step-00000006" / "meta.json").read_text())
    assert meta["config"]["keep_checkpoints"] == 2
    assert ckpt.prune(root, 6, 1) == [root / "step-00000005"]
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000006"]


def _steps(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))


def test_keep_checkpoints_leaves_later_steps_alone(tmp_path):
    for n in (1, 2, 3, 7, 9):
        (tmp_path / f"step-{n:08d}").mkdir()
    (tmp_path / "step-notanumber").mkdir()
    gone = ckpt.prune(tmp_path, 3, 2)
    assert [p.name for p in gone] == ["step-00000001"]
    assert _steps(tmp_path) == ["step-00000002", "step-00000003", "step-00000007", "step-00000009",
                                "step-notanumber"]


def test_keep_checkpoints_deletes_in_the_background_only_when_the_caller_joins(tmp_path):
    """A rank leaves through os._exit, which kills threads: prune hands its deletion thread to the
    caller to join (the worker does, before it releases the folder's lock), or deletes at once."""
    for n in (1, 2, 3):
        (tmp_path / f"step-{n:08d}").mkdir()
        (tmp_path / f"step-{n:08d}" / "model.safetensors").write_bytes(b"x" * 1024)
    pending = []
    gone = ckpt.prune(tmp_path, 3, 1, pending=pending)
    assert [p.name for p in gone] == ["step-00000002", "step-00000001"]
    assert len(pending) == 1 and _steps(tmp_path) == ["step-00000003"]
    pending[0].join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
    (tmp_path / "step-00000004").mkdir()
    ckpt.prune(tmp_path, 4, 1)                      # no list: nothing left behind on return
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]


def test_keep_checkpoints_counts_only_the_runs_own_line(tmp_path):
    """A run resumed from step 10 with an abandoned continuation at 20 (the user pointed `latest`
    back): at step 25 with K = 2 it keeps 10 (its own history) and deletes 5; 20, not its line, is
    neither counted nor deleted. Once it has written 20 itself, 20 is its own."""
    for n in (5, 10, 20, 25):
        (tmp_path / f"step-{n:08d}").mkdir()
    assert [p.name for p in ckpt.prune(tmp_path, 25, 2, history=10, written=[])] == ["step-00000005"]
    assert _steps(tmp_path) == ["step-00000010", "step-00000020", "step-00000025"]
    (tmp_path / "step-00000030").mkdir()
    assert [p.name for p in ckpt.prune(tmp_path, 30, 2, history=10, written=[20, 25])] == \
        ["step-00000020", "step-00000010"]
    assert _steps(tmp_path) == ["step-00000025", "step-00000030"]


def test_a_resume_whose_text_corpus_changed_is_warned_about(pkgs, tmp_path):
    """The same `--data text:DIR` with a file added since the checkpoint: the batches differ from an
    uninterrupted run's, and the resumed run says so (the corpus's digest is in meta.json)."""
    import sysconfig

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("textwrap.py", "string.py", "bisect.py"):
        shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / name, corpus / name)
    data = ["--data", f"text:{corpus}", "--checkpoint-every", "1"]
    ok(run_cli(*args_for(pkgs["seq"], tmp_path, *data, steps=1)))
    r = ok(run_cli(*args_for(pkgs["seq"], tmp_path, *data, "--resume", steps=2)))
    assert "changed since the checkpoint" not in r.stderr
    shutil.copy(Path(sysconfig.get_paths()["stdlib"]) / "heapq.py", corpus / "heapq.py")
    r = ok(run_cli(*args_for(pkgs["seq"], tmp_path, *data, "--resume", steps=3)))
    assert f"the data of --data text:{corpus} changed since the checkpoint of step 2" in r.stderr


def test_a_checkpoint_damaged_inside_a_tensor_is_refused(pkgs, tmp_path):
    """Bits flipped in a shard's tensor data (its header intact) are found by the digests in meta.json."""
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, steps=1)))
    last = ckpt.latest(tmp_path / "ckpt")
    shard = max(last.folder.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    data = bytearray(shard.read_bytes())
    for i in range(len(data) - 4096, len(data) - 2048):                 # in the data, well past the header
        data[i] ^= 0x04
    shard.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="is damaged: .* differ from what was written"):
        ckpt.load_weights(ckpt.latest(tmp_path / "ckpt"))
    r = refused_or_failed(run_cli(*args_for(pkg, tmp_path, "--resume", steps=2)))
    assert "is damaged" in r and "resume from an older step folder" in r


def refused_or_failed(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    return r.stderr


def test_without_latest_the_newest_complete_step_folder_is_resumed(pkgs, tmp_path):
    """A run dying between committing a step folder and writing `latest` (or `latest` lost): --resume
    takes the newest step folder whose meta.json reads, and says so."""
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "1", steps=3)))
    root = tmp_path / "ckpt"
    (root / "latest").unlink()
    (root / "step-00000003" / "meta.json").unlink()                     # the newest is incomplete
    found = ckpt.latest(root)
    assert found.step == 2 and "newest complete step folder, step-00000002" in found.note
    r = ok(run_cli(*args_for(pkg, tmp_path, "--checkpoint-every", "1", "--resume", steps=4)))
    assert "newest complete step folder, step-00000002" in r.stderr
    assert steps_in(tmp_path / "log" / "train.jsonl") == [0, 1, 2, 3]


@pytest.mark.parametrize("ids, labels, says", [
    (5000, 5, "input 'input_ids' (args[0]) holds 5000 at position [0, 0] (and 63 more), but it indexes the "
              "embedding transformer.wte.weight of 1000 rows: its values there must be 0..999"),
    (5, 7000, "input 'labels' (kwargs['labels']) holds 7000 at position [0, 1] (and 61 more), but it indexes the "
              "loss's 1000 classes: its values there must be 0..999, or -100 (ignored)")])
def test_token_ids_or_labels_beyond_the_model_are_a_data_error(pkgs, tmp_path, ids, labels, says):
    """A data function yielding token ids past the vocabulary (gpt2-tiny's is 1000), or labels past it:
    an error naming the input, the value and the table, found on the host by the rank before the
    stage runs (on a GPU a device-side assert), exit 2, not an internal error. (The first batch is
    good: the launcher checks that one itself.) The labels' first column is not
    counted: the loss drops it."""
    m = load_package(pkgs["seq"]).manifest
    tail = list(next(gi for gi in m.inputs if gi.shape).shape[1:])         # the sequence length
    (tmp_path / "bad.py").write_text(
        "import torch\n"
        "def batches(micro_batches, **_):\n"
        f"    shape = [micro_batches * {m.micro_batch_size}] + {tail}\n"
        "    yield {'input_ids': torch.full(shape, 5), 'labels': torch.full(shape, 5)}\n"
        "    while True:\n"
        f"        yield {{'input_ids': torch.full(shape, {ids}), 'labels': torch.full(shape, {labels})}}\n")
    r = run_cli(*args_for(pkgs["seq"], tmp_path, "--data", f"{tmp_path / 'bad.py'}:batches", steps=2))
    err = refused(r, says, "step 1, micro-batch 0", "check the data (--data)")
    assert "internal error" not in err


@pytest.mark.parametrize("body, says", [
    ("    return []\n", "yielded no batches; the run needs 1 step(s)"),
    ("    shape = [micro_batches * {b}] + {tail}\n    ids = torch.full(shape, 7)\n    ids[-1, -1] = 1000\n"
     "    yield {{'input_ids': ids, 'labels': ids}}\n",
     "batch 0, micro-batch 3: input 'input_ids' (args[0]) holds 1000 at position [1, 31]")])
def test_a_data_function_is_refused_on_its_first_batch_before_any_rank_starts(pkgs, tmp_path, body, says):
    """An empty dataset, or a first batch with a token id beyond the vocabulary: refused by the
    launcher (no rank started, so no "rank N:" in the error), and no log folder is left behind."""
    m = load_package(pkgs["seq"]).manifest
    tail = list(next(gi for gi in m.inputs if gi.shape).shape[1:])
    (tmp_path / "data.py").write_text("import torch\ndef batches(micro_batches, **_):\n"
                                      + body.format(b=m.micro_batch_size, tail=tail))
    r = run_cli(*args_for(pkgs["seq"], tmp_path, "--data", f"{tmp_path / 'data.py'}:batches", steps=1))
    err = refused(r, says)
    assert "rank " not in err
    assert not (tmp_path / "log").exists() and not (tmp_path / "ckpt").exists()


def test_a_data_function_needing_a_rank_is_only_warned_about_by_the_launcher(pkgs, tmp_path):
    """A generator that reads RANK (unset in the launcher) cannot be drawn there: a warning, and the
    ranks train on it."""
    m = load_package(pkgs["seq"]).manifest
    tail = list(next(gi for gi in m.inputs if gi.shape).shape[1:])
    (tmp_path / "data.py").write_text(
        "import os, torch\ndef batches(micro_batches, **_):\n"
        "    rank = int(os.environ['RANK'])\n"
        f"    shape = [micro_batches * {m.micro_batch_size}] + {tail}\n"
        "    while True:\n        yield {'input_ids': torch.full(shape, 7 + rank), 'labels': torch.full(shape, 7)}\n")
    r = ok(run_cli(*args_for(pkgs["seq"], tmp_path, "--data", f"{tmp_path / 'data.py'}:batches", steps=1)))
    assert "warning: could not draw the first batch" in r.stderr and "KeyError" in r.stderr, r.stderr


def test_temporaries_of_a_dead_run_are_removed_at_the_next_start(pkgs, tmp_path):
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path)))
    ck = tmp_path / "ckpt"
    # what a run killed while writing leaves: a staging folder, temporary files beside their targets
    staging = ck / ".tmp-step-00000004-0123456789ab"
    staging.mkdir()
    (staging / "shard-00001-model-00001-of-00001.safetensors").write_bytes(os.urandom(1 << 20))
    (ck / ".tmp-abcdlatest").write_text("step-")
    (ck / "step-00000002" / ".tmp-xyzmeta.json").write_text("{")
    r = run_cli(*args_for(pkg, tmp_path, "--resume", steps=3))
    assert not [p for p in ck.rglob(".tmp-*")], sorted(ck.rglob(".tmp-*"))
    ok(r)
    assert "removed 3 temporary" in r.stderr and "1.0 MB" in r.stderr, r.stderr


# --------------------------------------------------------------------------- 7-9: resume does what it says

def test_resume_applies_the_learning_rate_of_the_command_line(pkgs, tmp_path):
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, steps=2, lr="0.05")))
    r = ok(run_cli(*args_for(pkg, tmp_path, "--resume", steps=4, lr="0.01")))
    # without --lr, a resumed run keeps the checkpoint's (not the default 1e-3)
    ok(run_cli(*args_for(pkg, tmp_path, "--resume", steps=5, lr=None)))
    lrs = [x["lr"] for x in log_records(tmp_path / "log" / "train.jsonl")]
    assert lrs == pytest.approx([0.05, 0.05, 0.01, 0.01, 0.01])
    assert_weights(tmp_path / "ckpt", plain_training(pkg, [0.05, 0.05, 0.01, 0.01, 0.01]))
    assert "lr 0.05 -> 0.01" in r.stderr


def test_resume_refuses_an_optimizer_the_checkpoint_state_does_not_fit(pkgs, tmp_path):
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, optimizer="adam", lr="1e-3")))
    log = tmp_path / "log" / "train.jsonl"
    before = log.read_bytes()
    refused(run_cli(*args_for(pkg, tmp_path, "--resume", steps=3, optimizer="sgd", lr="0.01")),
            "trained with --optimizer adam", "means nothing to sgd", "--reset-optimizer")
    assert log.read_bytes() == before
    r = ok(run_cli(*args_for(pkg, tmp_path, "--resume", steps=3, optimizer="adamw", lr="1e-3")))
    assert "optimizer adam -> adamw" in r.stderr
    assert ckpt.latest(tmp_path / "ckpt").meta["config"]["optimizer"] == "adamw"
    ok(run_cli(*args_for(pkg, tmp_path, "--resume", "--reset-optimizer", steps=4, optimizer="sgd", lr="0.01")))
    assert steps_in(log) == [0, 1, 2, 3]


def test_resume_to_fewer_steps_than_done_is_refused(pkgs, tmp_path):
    pkg = pkgs["seq"]
    ok(run_cli(*args_for(pkg, tmp_path, steps=4)))
    refused(run_cli(*args_for(pkg, tmp_path, "--resume", steps=2)), "--steps 2 is below the checkpoint's step 4",
            "N > 4")
    r = ok(run_cli(*args_for(pkg, tmp_path, "--resume", steps=4)))
    assert "at step 4 of 4 already" in r.stderr
    assert steps_in(tmp_path / "log" / "train.jsonl") == [0, 1, 2, 3]


# --------------------------------------------------------------------------- 10-12: options

@pytest.mark.parametrize("bad,says", [
    (["--clip-grad-norm=-1"], "--clip-grad-norm must be"), (["--clip-grad-norm", "nan"], "--clip-grad-norm must be"),
    (["--lr", "inf"], "--lr must be"), (["--lr", "nan"], "--lr must be"), (["--lr=-0.1"], "--lr must be"),
    (["--momentum", "nan"], "--momentum must be in [0, 1)"), (["--momentum", "1.5"], "--momentum must be in [0, 1)"),
    (["--weight-decay=-1"], "--weight-decay must be"), (["--warmup-steps=-5"], "--warmup-steps must be 0 or more"),
    (["--nproc", "0"], "--nproc must be at least 1"), (["--nproc", "3"], "3 ranks make no whole number of pipelines"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout must be"), (["--max-restarts=-1"], "--max-restarts"),
    (["--timeout", "inf"], "--timeout must be"), (["--reset-optimizer"], "--reset-optimizer needs --resume"),
])
def test_nonsense_options_are_refused_before_any_rank_starts(pkgs, tmp_path, bad, says):
    a = args_for(pkgs["seq"], tmp_path)
    if "--nproc" in bad:
        i = a.index("--nproc")
        del a[i:i + 2]
    refused(run_cli(*a, *bad), says)
    assert not (tmp_path / "log").exists() and not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("option", ["--log-dir", "--checkpoint-dir"])
def test_a_folder_option_naming_a_file_is_refused_before_any_rank_starts(pkgs, tmp_path, option):
    (tmp_path / "afile").write_text("the user's file\n")
    for path, says in [(tmp_path / "afile", "is a file, not a folder"),
                       (tmp_path / "afile" / "sub", "cannot be created: Not a directory")]:
        a = args_for(pkgs["seq"], tmp_path)
        a[a.index(option) + 1] = str(path)
        refused(run_cli(*a), f"{option} {path} {says}")
    assert (tmp_path / "afile").read_text() == "the user's file\n"


def test_pointless_options_are_warned_about(pkgs, tmp_path):
    r = ok(run_cli(str(pkgs["seq"]), "--nproc", "1", "--steps", "1", "--schedule", "async", "--optimizer", "sgd",
                   "--weight-prediction", "--momentum", "0.5", "--log-dir", str(tmp_path), "--progress", "off"))
    assert "warning: --weight-prediction does nothing with --optimizer sgd" in r.stderr, r.stderr
    assert "warning: --momentum is ignored by --optimizer sgd" in r.stderr, r.stderr


@pytest.mark.parametrize("tolerance", ["-1", "nan", "inf"])
def test_verify_refuses_a_meaningless_tolerance(pkgs, tolerance):
    r = subprocess.run([PY, "-m", "ftcompile", "verify", str(pkgs["seq"]), f"--tolerance={tolerance}"],
                       capture_output=True, text=True, timeout=LIMIT)
    assert r.returncode == 2 and "--tolerance" in r.stderr and "number >= 0" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


NO_LOSS = """
import torch
from transformers import AlbertConfig, AlbertForMaskedLM


def build():
    cfg = AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=48, max_position_embeddings=32)
    cfg._attn_implementation = "eager"
    return AlbertForMaskedLM(cfg), (), {"input_ids": torch.randint(0, 64, (2, 16))}   # no labels: no loss
"""


def test_a_model_without_a_scalar_loss_is_refused_at_compile(tmp_path):
    """13: a masked LM called without labels returns logits first; compiling it would 'train' on nothing."""
    (tmp_path / "noloss.py").write_text(NO_LOSS)
    out = tmp_path / "out"
    r = subprocess.run([PY, "-m", "ftcompile", "compile", f"{tmp_path / 'noloss.py'}:build", "--gpus", "2",
                        "--cluster", "2xcpu", "-o", str(out)], capture_output=True, text=True, timeout=LIMIT)
    refused(r, "returns no scalar training loss", "float32[2, 16, 64]", "the model's first output must be the loss")
    assert not out.exists()


# --------------------------------------------------------------------------- pieces

def test_open_log_rotates_a_fresh_run_and_filters_a_resumed_one(tmp_path):
    log = tmp_path / "train.jsonl"
    log.write_text("".join(json.dumps({"run": "a", "step": i, "loss": 1.0}) + "\n" for i in range(4))
                   + '{"run": "a", "summary": true}\n{"run": "a", "step": 4, "lo')
    f, notes = open_log(tmp_path, run_id="a", resume_step=2)
    f.write({"run": "a", "step": 2})
    f.close()
    assert [json.loads(x).get("step") for x in log.read_text().splitlines()] == [0, 1, None, 2]
    assert (tmp_path / "train.1.jsonl").read_text().endswith('"lo') and notes
    f, notes = open_log(tmp_path, run_id="b")
    f.close()
    assert not log.exists() or log.read_text() == ""
    assert (tmp_path / "train.2.jsonl").exists() and "moved the log" in notes[0]


def test_a_full_disk_leaves_the_log_ending_with_a_whole_record(tmp_path):
    """The log's file reaches the process's file-size limit (EFBIG, as a full disk's ENOSPC) in the middle
    of a record: the record is cut back, so the log ends with the last complete line, and the error says
    there is no room."""
    code = (
        "import json, resource, signal, sys\n"
        "from pathlib import Path\n"
        "from ftcompile.runtime.runlog import open_log, RunLogError\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"log, _ = open_log(Path({str(tmp_path)!r}), run_id='r')\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n"
        "try:\n"
        "    for step in range(1000):\n"
        "        log.write({'run': 'r', 'step': step, 'loss': 1.0 / (step + 1), 'pad': 'x' * 37})\n"
        "except RunLogError as exc:\n"
        "    print(exc); sys.exit(3)\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and "no room to write the training log" in r.stdout, (r.stdout, r.stderr)
    text = (tmp_path / "train.jsonl").read_text()
    assert text.endswith("\n") and len(text) <= 1000
    steps = [json.loads(line)["step"] for line in text.splitlines()]
    assert steps == list(range(len(steps))) and len(steps) >= 5


def test_a_folder_lock_names_its_holder_and_dies_with_it(tmp_path):
    holder = subprocess.Popen([PY, "-c", "import sys, time\nfrom ftcompile.runtime.lock import acquire\n"
                               f"acquire({str(tmp_path)!r}, 'run-x')\nprint('held', flush=True)\ntime.sleep(600)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy, match=f"in use by run run-x \\(pid {holder.pid} on "):
            acquire(tmp_path, "run-y")
        holder.kill()
        holder.wait()
        lock = acquire(tmp_path, "run-y")       # the kernel dropped the dead holder's lock
        lock.release()
    finally:
        holder.kill()
        holder.wait()


_SAVE = """
import os, sys, torch, torch.distributed as dist
from ftcompile.runtime import checkpoint as ckpt
from ftcompile.runtime.control import Control
r = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=r, world_size=2)
c = Control(r, 2, None, None, "t", owns_default_group=False, hosts_store=False)
shared = torch.ones(3) + (1e-6 if r == 1 and sys.argv[2] == "diverged" else 0.0)
stages = {r: {"weights": {"shared.w": shared, f"own{r}.w": torch.full((2,), float(r))},
              "optimizer": {f"own{r}.w": {"step": 3, "exp_avg": torch.ones(2)}}}}
try:
    ckpt.save(sys.argv[1], 1, stages, meta={"run_id": "t"}, control=c)
    print("saved", flush=True)
except ckpt.CheckpointError as e:
    print("refused:", e, flush=True)
"""


@pytest.mark.parametrize("case", ["same", "diverged"])
def test_the_collective_save_writes_a_shared_tensor_once_and_refuses_diverged_copies(tmp_path, case):
    """Two processes over gloo call checkpoint.save directly: the tensor both hold is written once, and
    copies that differ (replicas or tied weights that drifted apart) stop the save on both ranks."""
    from ftcompile.runtime.launch import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = [subprocess.Popen([PY, "-c", _SAVE, str(tmp_path / "ckpt"), case], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=LIMIT)[0] for p in procs]
    if case == "diverged":
        assert all("refused: ranks [0, 1] hold different copies of shared.w" in o for o in outs), outs
        assert ckpt.latest(tmp_path / "ckpt") is None and not ckpt.stale_temporaries(tmp_path / "ckpt")
        return
    assert all(o.strip() == "saved" for o in outs), outs
    ck = ckpt.latest(tmp_path / "ckpt")
    got = ckpt.load(ck, ["shared.w", "own0.w", "own1.w"])
    assert torch.equal(got["weights"]["own1.w"], torch.ones(2)) and torch.equal(got["weights"]["shared.w"],
                                                                                  torch.ones(3))
    assert got["optimizer"]["own1.w"]["step"] == 3 and isinstance(got["optimizer"]["own1.w"]["step"], int)
    from safetensors import safe_open

    holders = 0
    for f in ck.folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            holders += "shared.w" in fh.keys()
    assert holders == 1
