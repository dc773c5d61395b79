"""The ``ftcompile`` command line, run in-process through ``main([...])`` on tiny models."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftcompile.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    """``ftcompile ARGV`` in this process: (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str):
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out), err  # exactly one JSON document on stdout, or this fails


def assert_clean_error(rc: int, out: str, err: str, *needles: str) -> str:
    """Exit status 2, one line 'ftcompile: error: ...' on stderr, no traceback."""
    assert rc == 2, (rc, out, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("ftcompile: error: "), err
    assert "Traceback" not in err + out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# --------------------------------------------------------------------------- help and models

def test_help_for_every_command(capsys):
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for command in ("models", "trace", "profile", "demo"):
        assert command in out
        rc, sub_out, _ = run(capsys, command, "--help")
        assert rc == 0 and f"ftcompile {command}" in sub_out


def test_no_command_prints_help(capsys):
    rc, _, err = run(capsys)
    assert rc == 2 and "COMMAND" in err


def test_models_json(capsys):
    models, _ = run_json(capsys, "models")
    names = [m["name"] for m in models]
    for name in ("gpt2-tiny", "gpt2-xl", "bert-large", "t5-3b", "t5-11b", "vit-base", "mlp", "skipnet", "encdec"):
        assert name in names
    tiny = models[names.index("gpt2-tiny")]
    assert tiny["family"] == "gpt2" and tiny["parameters"] > 0 and tiny["description"]
    assert tiny["default_options"]["seq_len"] > 0


def test_models_table(capsys):
    rc, out, _ = run(capsys, "models")
    assert rc == 0 and "t5-11b" in out and "family" in out


# --------------------------------------------------------------------------- trace

def test_trace_json(capsys, tmp_path):
    graph_file = tmp_path / "g.json"
    summary, _ = run_json(capsys, "trace", "gpt2-tiny", "-o", graph_file)
    for key in ("nodes", "edges", "parameters", "parameter_bytes", "activation_bytes", "seconds"):
        assert key in summary
    assert summary["nodes"] > 100 and summary["edges"] > 100
    assert summary["parameters"] > 100_000 and summary["parameter_bytes"] == 4 * summary["parameters"]
    assert summary["model"] == "gpt2-tiny" and summary["granularity"] == "op"
    from ftcompile.ir import OpGraph

    graph = OpGraph.load(graph_file)
    assert len(graph.nodes) == summary["nodes"]
    assert graph.source["model"] == "gpt2-tiny" and graph.source["options"]["batch_size"] == 2


def test_trace_human_summary(capsys):
    rc, out, _ = run(capsys, "trace", "mlp", "--batch-size", "3")
    assert rc == 0 and "nodes" in out and "parameters" in out


def test_basic_blocks_give_fewer_nodes(capsys, gpt2_tiny_graph):
    layer, _ = run_json(capsys, "trace", "gpt2-tiny", "--basic-blocks", "GPT2Block")
    assert layer["granularity"] == "layer" and layer["basic_blocks"] == ["GPT2Block"]
    assert layer["nodes"] < len(gpt2_tiny_graph.nodes)
    auto, _ = run_json(capsys, "trace", "gpt2-tiny", "--basic-blocks", "auto")
    assert auto["nodes"] == layer["nodes"]


# --------------------------------------------------------------------------- profile

def test_profile_graph_file_analytic(capsys, tmp_path, gpt2_tiny_graph_file, gpt2_tiny_graph):
    out_file = tmp_path / "p.json"
    prof, _ = run_json(capsys, "profile", gpt2_tiny_graph_file, "--hardware", "cpu",
                       "--cache-dir", tmp_path / "cache", "-o", out_file)
    assert prof["method"] == "analytic" and prof["hardware"] == "cpu"
    assert prof["forward_ms"] > 0 and prof["backward_ms"] > 0 and prof["flops_forward"] > 0
    assert prof["profiled_nodes"] == sum(1 for _ in gpt2_tiny_graph.op_nodes())
    assert prof["heaviest"] and prof["cached"] is False
    from ftcompile.profile import Profile

    Profile.load(out_file).check_graph(gpt2_tiny_graph)


def test_profile_cache_is_reused(capsys, tmp_path, gpt2_tiny_graph_file):
    cache = tmp_path / "cache"
    first, err1 = run_json(capsys, "profile", gpt2_tiny_graph_file, "--cache-dir", cache)
    assert first["cached"] is False and "reused" not in err1
    assert Path(first["cache_file"]).is_file() and Path(first["cache_file"]).parent == cache
    second, err2 = run_json(capsys, "profile", gpt2_tiny_graph_file, "--cache-dir", cache)
    assert second["cached"] is True and "reused cached profile" in err2
    assert second["forward_ms"] == first["forward_ms"]
    # another optimizer is another profile; --no-cache neither reads nor writes
    third, _ = run_json(capsys, "profile", gpt2_tiny_graph_file, "--cache-dir", cache, "--optimizer", "sgd")
    assert third["cached"] is False and third["optimizer_bytes"] == 0
    fourth, err4 = run_json(capsys, "profile", gpt2_tiny_graph_file, "--cache-dir", cache, "--no-cache")
    assert fourth["cached"] is False and fourth["cache_file"] is None and "reused" not in err4


def test_profile_hardware_spec_file(capsys, tmp_path, gpt2_tiny_graph_file):
    from ftcompile.hardware import PRESETS

    spec = PRESETS["rtx2080ti"].to_json()
    spec_file = tmp_path / "hw.json"
    spec_file.write_text(json.dumps(spec))
    cache = tmp_path / "cache"
    base, _ = run_json(capsys, "profile", gpt2_tiny_graph_file, "--hardware", spec_file, "--cache-dir", cache)
    # Same name, other figures: the cached profile must not be reused.
    spec["peak_flops"] = {k: v / 10 for k, v in spec["peak_flops"].items()}
    spec["memory_bandwidth"] /= 10
    spec_file.write_text(json.dumps(spec))
    slow, _ = run_json(capsys, "profile", gpt2_tiny_graph_file, "--hardware", spec_file, "--cache-dir", cache)
    assert slow["cached"] is False and slow["forward_ms"] > base["forward_ms"]


def test_profile_measured_model(capsys, tmp_path):
    prof, _ = run_json(capsys, "profile", "gpt2-tiny", "--method", "measured", "--repeats", "1",
                       "--warmup", "0", "--cache-dir", tmp_path)
    assert prof["method"] == "measured" and prof["hardware"].startswith("cpu")
    assert prof["forward_ms"] > 0 and prof["backward_ms"] > 0
    again, err = run_json(capsys, "profile", "gpt2-tiny", "--method", "measured", "--repeats", "1",
                          "--warmup", "0", "--cache-dir", tmp_path)
    assert again["cached"] is True and "reused cached profile" in err


def test_profile_measured_graph_file_rebuilds_model(capsys, tmp_path, gpt2_tiny_graph_file):
    prof, err = run_json(capsys, "profile", gpt2_tiny_graph_file, "--method", "measured", "--repeats", "1",
                         "--warmup", "0", "--no-cache")
    assert prof["method"] == "measured" and prof["model"] == "gpt2-tiny" and prof["forward_ms"] > 0
    assert "rebuilding gpt2-tiny" in err


# --------------------------------------------------------------------------- errors

def test_error_unknown_model(capsys):
    line = assert_clean_error(*run(capsys, "trace", "no-such-model"), "no-such-model")
    for name in ("gpt2-tiny", "bert-large", "t5-11b"):  # the message lists the zoo
        assert name in line


def test_error_unknown_hardware(capsys, gpt2_tiny_graph_file):
    assert_clean_error(*run(capsys, "profile", gpt2_tiny_graph_file, "--hardware", "tpu-v9", "--no-cache"),
                       "tpu-v9", "rtx2080ti")


def test_error_corrupt_graph_file(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "ftcompile.opgraph", "nodes": [')
    assert_clean_error(*run(capsys, "profile", bad, "--no-cache"), "bad.json")
    from ftcompile.ir import OPGRAPH_VERSION

    bad.write_text('{"format": "ftcompile.opgraph", "version": %d, "nodes": [{"id": 0}]}' % OPGRAPH_VERSION)
    assert_clean_error(*run(capsys, "profile", bad, "--no-cache"), "corrupt")


def test_error_wrong_version_graph_file(capsys, tmp_path, gpt2_tiny_graph_file):
    data = json.loads(Path(gpt2_tiny_graph_file).read_text())
    data["version"] = 999
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    assert_clean_error(*run(capsys, "profile", old, "--no-cache"), "version", "999")


def test_error_missing_graph_file(capsys, tmp_path):
    assert_clean_error(*run(capsys, "profile", tmp_path / "nope.json"), "nope.json")


def test_error_bad_basic_block(capsys):
    assert_clean_error(*run(capsys, "trace", "gpt2-tiny", "--basic-blocks", "NoSuchBlock"),
                       "NoSuchBlock", "GPT2Block")


@pytest.mark.parametrize("value", ["-1", "0", "two"])
def test_error_bad_batch_size(capsys, value):
    assert_clean_error(*run(capsys, "trace", "gpt2-tiny", "--batch-size", value), "--batch-size", "positive")


def test_error_bad_profile_device(capsys, gpt2_tiny_graph_file):
    assert_clean_error(*run(capsys, "profile", gpt2_tiny_graph_file, "--method", "measured", "--device", "gpu",
                            "--no-cache"), "--device", "'gpu'")


def test_profile_device_is_not_a_model_option(capsys, tmp_path, gpt2_tiny_graph_file):
    # profile's --device picks where to time nodes; with a graph file it must not count as
    # a model option (which a graph file refuses).
    prof, err = run_json(capsys, "profile", gpt2_tiny_graph_file, "--device", "cpu", "--cache-dir", tmp_path)
    assert prof["method"] == "analytic" and "only applies to --method measured" in err


def test_error_option_the_model_does_not_take(capsys):
    assert_clean_error(*run(capsys, "trace", "mlp", "--seq-len", "8"), "seq_len")


def test_error_model_options_with_graph_file(capsys, gpt2_tiny_graph_file):
    assert_clean_error(*run(capsys, "profile", gpt2_tiny_graph_file, "--batch-size", "4"), "--batch-size")


def test_error_unwritable_output(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert_clean_error(*run(capsys, "trace", "mlp", "-o", blocker / "g.json"), "cannot write")


def test_debug_shows_traceback(capsys):
    rc, _, err = run(capsys, "--debug", "trace", "no-such-model")
    assert rc == 2 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("ftcompile: error:")


# --------------------------------------------------------------------------- demo and the console script

@pytest.mark.slow
def test_demo(capsys, tmp_path):
    report, _ = run_json(capsys, "demo", "--repeats", "1", "--warmup", "0", "--out-dir", tmp_path)
    g = report["granularity"]
    assert g["basic_blocks"] == ["GPT2Block"] and g["layer_nodes"] < g["op_nodes"]
    assert report["profile_analytic"]["forward_ms"] > 0 and report["profile_measured"]["forward_ms"] > 0
    assert sorted(os.listdir(tmp_path)) == ["graph-layer.json", "graph.json", "plan", "profile-analytic.json",
                                            "profile-measured.json"]
    c = report["compile"]
    assert c["chosen"] in [r["name"] for r in c["strategies"] if r["feasible"]]
    assert {"plan.json", "report.md", "gpus.png", "timeline.png"} <= set(os.listdir(tmp_path / "plan"))


def _console_script() -> str | None:
    here = Path(sys.executable).parent / "ftcompile"
    return str(here) if here.exists() else shutil.which("ftcompile")


def test_console_script(tmp_path):
    exe = _console_script()
    if exe is None:
        pytest.skip("the ftcompile console script is not installed (pip install -e .)")
    proc = subprocess.run([exe, "models", "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "gpt2-tiny" in [m["name"] for m in json.loads(proc.stdout)]
    proc = subprocess.run([exe, "trace", "no-such-model"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("ftcompile: error: unknown model") and "Traceback" not in proc.stderr


def test_python_dash_m(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ftcompile", "--version"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("ftcompile ")


# --------------------------------------------------------------------------- the README keeps up

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.skipif(not README.exists(), reason="no README.md next to tests/")
def test_readme_documents_every_command_option_and_model():
    import argparse

    from ftcompile.cli import build_parser
    from ftcompile.models import list_models

    text = README.read_text(encoding="utf-8")
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        assert f"ftcompile {name}" in text, name
        for action in sub._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help":
                    assert opt in text, f"README does not mention {opt} of `ftcompile {name}`"
    for entry in list_models():
        assert f"| {entry.name} |" in text, f"README's zoo table lacks {entry.name}"
