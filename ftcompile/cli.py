"""The ``ftcompile`` command line: ``models``, ``trace``, ``profile``, ``demo``; ``compile``,
``simulate`` and ``diff`` live in :mod:`ftcompile.cli_compile`.

Every command prints a human summary, or with ``--json`` exactly one JSON
document on stdout (anything else a model prints goes to stderr). Expected
failures (unknown model, bad option, corrupt file, untraceable model...) end with
one line ``ftcompile: error: ...`` on stderr and exit status 2; ``--debug``
adds the traceback. Heavy imports (torch, transformers) happen inside the
commands so that ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, fields
from typing import Any, Callable, Iterator, Sequence

from . import __version__

PROG = "ftcompile"
DEFAULT_CACHE_DIR = ".ftcompile-cache"
DEFAULT_HARDWARE = "rtx2080ti"
DTYPES = ("float32", "float16", "bfloat16")
METHODS = ("analytic", "measured")
#: Phases reported while tracing, in order (``functionalize`` only runs for graphs with in-place ops).
TRACE_PHASES = ("build", "export", "functionalize", "convert")


class UsageError(ValueError):
    """A bad combination of command-line options."""


# --------------------------------------------------------------------------- parser

class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``ftcompile: error: ...``) and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32, width=min(100, _terminal_width()))


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 100


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


def _add_common(p: argparse.ArgumentParser, *, top: bool) -> None:
    # On subcommands the defaults are SUPPRESS so that `ftcompile --quiet trace` and
    # `ftcompile trace --quiet` both work without the subcommand resetting the flag.
    default = False if top else argparse.SUPPRESS
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no progress bars and no notes on stderr (errors are still printed)")
    p.add_argument("--debug", action="store_true", default=default,
                   help="print the full traceback of an error, and library warnings")


def _add_model_options(p: argparse.ArgumentParser, *, device: bool = True) -> None:
    g = p.add_argument_group(
        "model options",
        "Override the zoo entry's defaults (`ftcompile models` lists them).\n"
        "A length the model does not take is an error.")
    g.add_argument("--batch-size", type=_positive_int, metavar="N",
                   help="examples per batch of the example inputs")
    g.add_argument("--seq-len", type=_positive_int, metavar="N",
                   help="sequence length (gpt2-*, bert-*, skipnet)")
    g.add_argument("--encoder-len", type=_positive_int, metavar="N",
                   help="encoder (source) length (t5-*, encdec)")
    g.add_argument("--decoder-len", type=_positive_int, metavar="N",
                   help="decoder (target) length (t5-*, encdec)")
    g.add_argument("--dtype", choices=DTYPES, help="parameter and input dtype (default: float32; a user model keeps the dtypes its function built)")
    if device:
        g.add_argument("--device", metavar="{auto,cpu,meta}",
                       help="where to build the model: 'meta' holds no weights (fast, any size); "
                            "'auto' (default) uses meta for models of 500M parameters or more, "
                            "cpu otherwise")
    # Absolute: the graph records it, and verify, run's re-planning and export rebuild from it
    # wherever they are started.
    g.add_argument("--pretrained", metavar="DIR", type=os.path.abspath,
                   help="a local HuggingFace checkpoint directory (config.json + *.safetensors) "
                        "whose config and weights replace the zoo's random ones")
    g.add_argument("--seed", type=int, metavar="N", help="seed of the random weights and inputs (default: 0)")
    g.add_argument("--attention", choices=("sdpa", "eager"),
                   help="HuggingFace models: torch's fused scaled_dot_product_attention (sdpa, the default where "
                        "the architecture has it) or the explicit softmax(q k^T) v (eager), which keeps the "
                        "s x s attention matrix")


_MODEL_OPTION_FIELDS = ("batch_size", "seq_len", "encoder_len", "decoder_len", "dtype", "device",
                        "pretrained", "seed", "attention")


def _given_model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The model options given on the command line (unset ones are left to the zoo)."""
    return {f: getattr(args, f) for f in _MODEL_OPTION_FIELDS
            if getattr(args, f, None) is not None}


def _model_options(args: argparse.Namespace, **override: Any):
    from .models import ModelOptions

    return ModelOptions(**{**_given_model_options(args), **override})


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, formatter_class=_Formatter,
        description=(
            "ftcompile: an automatic pipeline-parallel compiler for PyTorch (after FTPipe).\n\n"
            "It turns a model into an operator graph (trace), prices every node of that graph\n"
            "(profile), lets partitioners compete for the best pipeline plan on P GPUs (compile),\n"
            "simulates it (simulate) and compares plans (diff).\n\n"
            "Start with:\n"
            "  ftcompile demo                      # the whole path on a tiny GPT-2, seconds on a CPU\n"
            "  ftcompile models                    # which models are built in\n"
            "  ftcompile trace gpt2-tiny -o g.json # the operator graph of one\n"
            "  ftcompile profile g.json            # its per-node costs\n"
            "  ftcompile compile t5-tiny --gpus 3 -o out/t5  # the best plan for 3 GPUs\n"),
        epilog="Run `ftcompile COMMAND --help` for the options of each command.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_common(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    # ---- models
    p = sub.add_parser(
        "models", help="list the model zoo", formatter_class=_Formatter,
        description=(
            "List the built-in models: name, family, parameter count, default options and a\n"
            "description. Any of these names can be given to `trace`, `profile` and `demo`, as\n"
            "can a user model written as 'path/to/file.py:function' (the function returns\n"
            "(model, args) or (model, args, kwargs) and the model's first output is the loss)."))
    _add_common(p, top=False)
    p.add_argument("--json", action="store_true", help="print a JSON list of entries instead of a table")
    p.set_defaults(func=cmd_models)

    # ---- trace
    p = sub.add_parser(
        "trace", help="trace a model into an operator graph (OpGraph)", formatter_class=_Formatter,
        description=(
            "Build MODEL with its example inputs and trace one training forward pass into an\n"
            "OpGraph: a DAG whose nodes are ATen operators (or whole module calls with\n"
            "--basic-blocks) and whose edges carry named activations with shapes and sizes.\n"
            "Models of 500M parameters or more are built on the meta device, so even t5-11b\n"
            "traces in seconds without allocating its weights."),
        epilog=(
            "examples:\n"
            "  ftcompile trace gpt2-tiny\n"
            "  ftcompile trace t5-3b --batch-size 4 --encoder-len 512 --decoder-len 4 -o t5-3b.json\n"
            "  ftcompile trace gpt2-small --basic-blocks GPT2Block --json\n"
            "  ftcompile trace my_model.py:build -o graph.json"))
    _add_common(p, top=False)
    p.add_argument("model", metavar="MODEL",
                   help="a zoo name (see `ftcompile models`) or a user model 'path/to/file.py:function'")
    _add_model_options(p)
    p.add_argument("--basic-blocks", metavar="CLASSES",
                   help="comma-separated module class names whose calls become single nodes "
                        "(layer granularity), e.g. T5Block or GPT2Block; 'auto' takes the zoo's "
                        "suggestion; default: operator granularity")
    p.add_argument("-o", "--output", metavar="FILE", help="write the graph as JSON to FILE (atomically)")
    p.add_argument("--json", action="store_true", help="print one JSON object of graph figures instead of a summary")
    p.set_defaults(func=cmd_trace)

    # ---- profile
    p = sub.add_parser(
        "profile", help="price every node of a graph (analytic or measured)", formatter_class=_Formatter,
        description=(
            "Compute the cost of every node of a graph for one micro-batch: forward and backward\n"
            "time, FLOPs, activation memory kept for backward, parameter/gradient/optimizer\n"
            "memory, and the bytes each node sends to each consumer.\n\n"
            "  analytic  counts the FLOPs and bytes of every kernel on the meta device and prices\n"
            "            them on --hardware with a roofline; needs no weights, any model size.\n"
            "  measured  runs every node for real on --device, forward and backward, with host\n"
            "            swapping (one node's tensors on the device at a time); builds the model\n"
            "            with real weights on the CPU.\n\n"
            "TARGET is a model (then it is traced first) or a graph file from `ftcompile trace -o`.\n"
            "For a measured profile of a graph file the model is rebuilt from the name and options\n"
            "recorded in the graph. Profiles are cached in --cache-dir under a key made of the graph\n"
            "hash, method, hardware, dtype, batch size and optimizer, and reused when asked again."),
        epilog=(
            "examples:\n"
            "  ftcompile profile gpt2-tiny --hardware cpu\n"
            "  ftcompile trace t5-3b -o t5-3b.json && ftcompile profile t5-3b.json --hardware v100-32gb\n"
            "  ftcompile profile gpt2-tiny --method measured --repeats 10 -o gpt2-tiny.profile.json"))
    _add_common(p, top=False)
    p.add_argument("target", metavar="TARGET",
                   help="a zoo name, a user model 'file.py:function', or an OpGraph JSON file")
    _add_model_options(p, device=False)
    p.add_argument("--basic-blocks", metavar="CLASSES",
                   help="when TARGET is a model: trace at layer granularity (see `ftcompile trace --help`)")
    p.add_argument("--method", choices=METHODS, default="analytic", help="how to get costs (default: analytic)")
    p.add_argument("--hardware", metavar="NAME|FILE",
                   help="analytic only: a preset (rtx2080ti, v100-32gb, a100-80gb, h100-80gb, cpu) or a "
                        f"hardware spec JSON file (default: {DEFAULT_HARDWARE})")
    p.add_argument("--optimizer", choices=("sgd", "momentum", "adam", "adafactor"), default="adam",
                   help="optimizer whose state memory is counted (default: adam)")
    p.add_argument("--device", dest="profile_device", metavar="{cpu,cuda}",
                   help="measured only: the device to time nodes on, cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--repeats", type=_positive_int, default=5, metavar="N",
                   help="measured only: timed runs per node; the median is kept (default: 5)")
    p.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N",
                   help="measured only: untimed runs per node first (default: 1)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the profile as JSON to FILE (atomically)")
    p.add_argument("--cache-dir", metavar="DIR", default=DEFAULT_CACHE_DIR,
                   help=f"where profiles are cached (default: {DEFAULT_CACHE_DIR})")
    p.add_argument("--no-cache", action="store_true", help="neither read nor write the profile cache")
    p.add_argument("--json", action="store_true", help="print one JSON object of totals instead of a summary")
    p.set_defaults(func=cmd_profile)

    # ---- demo
    p = sub.add_parser(
        "demo", help="trace, profile and compile a small model end to end", formatter_class=_Formatter,
        description=(
            "A guided tour on a small zoo model (default gpt2-tiny), on the CPU:\n"
            "  1. build the model with random weights,\n"
            "  2. trace it at operator granularity, and at layer granularity with the zoo's\n"
            "     suggested basic blocks (to compare node counts),\n"
            "  3. an analytic profile priced on the 'cpu' hardware preset,\n"
            "  4. a measured profile timing every node on this CPU,\n"
            "  5. compile: all partitioners compete for a 2-worker plan; the best is kept.\n"
            "The graphs and profiles are written to --out-dir for inspection."))
    _add_common(p, top=False)
    p.add_argument("--model", default="gpt2-tiny", metavar="MODEL",
                   help="the model to show (default: gpt2-tiny); keep it small, it is run on the CPU")
    _add_model_options(p, device=False)
    p.add_argument("--repeats", type=_positive_int, default=3, metavar="N",
                   help="timed runs per node of the measured profile (default: 3)")
    p.add_argument("--warmup", type=_non_negative_int, default=1, metavar="N",
                   help="untimed runs per node first (default: 1)")
    p.add_argument("--out-dir", metavar="DIR", default=os.path.join("out", "demo"),
                   help="where to write graph and profile files (default: out/demo); '' writes none")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.set_defaults(func=cmd_demo)

    from . import cli_compile, cli_package

    cli_compile.add_parsers(sub)
    cli_package.add_parsers(sub)
    return parser


# --------------------------------------------------------------------------- output helpers

def human_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_count(n: float) -> str:
    n = float(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def human_ms(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    if ms >= 1:
        return f"{ms:.2f} ms"
    return f"{ms * 1000:.1f} us"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Plain-text columns; ``right`` lists the columns to right-align (numbers)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for k, r in enumerate(cells):
        parts = [(c.rjust(w) if i in right else c.ljust(w)) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _kv(pairs: Sequence[tuple[str, Any]], indent: str = "  ") -> str:
    width = max(len(k) for k, _ in pairs)
    return "\n".join(f"{indent}{k.ljust(width)}  {v}" for k, v in pairs)


def _emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


class _Ui:
    """Where notes and progress go: stderr, silenced by --quiet, bars only on a terminal."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.quiet = bool(getattr(args, "quiet", False))
        self.bars = not self.quiet and sys.stderr.isatty()

    def note(self, message: str) -> None:
        if not self.quiet:
            print(f"{PROG}: {message}", file=sys.stderr)

    @contextlib.contextmanager
    def phases(self, label: str, phases: Sequence[str]) -> Iterator[Callable[[str], None]]:
        """A bar over named phases; yields ``note(phase)`` to call as each phase starts."""
        if not self.bars:
            yield lambda _phase: None
            return
        from tqdm import tqdm

        bar = tqdm(total=len(phases), desc=label, unit="phase", file=sys.stderr, leave=False,
                   bar_format="{desc} {bar} {n_fmt}/{total_fmt} [{elapsed}]", ncols=80)

        def note(phase: str) -> None:
            if phase in phases:
                bar.n = phases.index(phase)
            bar.set_description(f"{label}: {phase:<13}")

        try:
            yield note
        finally:
            bar.n = bar.total
            bar.close()

    @contextlib.contextmanager
    def steps(self, label: str, unit: str = "node") -> Iterator[Callable[[int, int], None]]:
        """A bar driven by ``progress(i, n)`` callbacks."""
        if not self.bars:
            yield lambda _i, _n: None
            return
        from tqdm import tqdm

        state: dict[str, Any] = {}

        def progress(i: int, n: int) -> None:
            bar = state.get("bar")
            if bar is None:
                bar = state["bar"] = tqdm(total=n, desc=label, unit=unit, file=sys.stderr, leave=False)
            bar.update(i - bar.n)

        try:
            yield progress
        finally:
            if "bar" in state:
                state["bar"].close()


@contextlib.contextmanager
def _stdout_for(args: argparse.Namespace) -> Iterator[None]:
    """With --json, anything printed while working (a chatty model) goes to stderr."""
    if getattr(args, "json", False):
        with contextlib.redirect_stdout(sys.stderr):
            yield
    else:
        yield


# --------------------------------------------------------------------------- shared steps

def _parse_blocks(spec: str | None, suggested: Sequence[str]) -> list[str]:
    if spec is None:
        return []
    if spec.strip() == "auto":
        if not suggested:
            raise UsageError("--basic-blocks auto: this model suggests no basic blocks; name module classes instead")
        return list(suggested)
    blocks = [b.strip() for b in spec.split(",") if b.strip()]
    if not blocks:
        raise UsageError("--basic-blocks needs at least one module class name, e.g. GPT2Block")
    return blocks


def _build(name: str, options):
    from .models import build_model

    return build_model(name, options)


def _trace_built(built, blocks: Sequence[str], note: Callable[[str], None], *, ui: "_Ui",
                 args: argparse.Namespace):
    """Trace a built model; torch's tracing logs and warnings only with ``--debug``.

    Block classes of a ``--basic-blocks`` list that this model never calls are
    noted (one list may serve several models: T5Block,GPT2Block).
    """
    debug = bool(getattr(args, "debug", False))
    from .trace import trace

    source = {"model": built.name, "options": asdict(built.options)}
    graph = trace(built.model, built.args, built.kwargs, basic_blocks=tuple(blocks), source=source,
                  progress=note, verbose=debug)
    graph.validate()
    absent = graph.source.get("absent_basic_blocks")
    if absent:
        ui.note(f"--basic-blocks: {', '.join(absent)} not called by {built.name}; "
                f"kept {', '.join(graph.basic_blocks)} whole")
    return graph


def _check_cache_dir(args: argparse.Namespace) -> None:
    """Refuse a --cache-dir that is a file before any work is done."""
    if getattr(args, "no_cache", False) or not getattr(args, "cache_dir", None):
        return
    from .profile import check_cache_dir

    check_cache_dir(args.cache_dir)


def _save(obj, path: str, what: str) -> None:
    """``obj.save(path)``, with a message that says what could not be written where."""
    try:
        obj.save(path)
    except OSError as exc:
        raise OSError(f"cannot write the {what} to {path}: {exc.strerror or exc}") from exc


def _graph_summary(graph, seconds: dict[str, float]) -> dict:
    out = graph.summary()
    out["basic_blocks"] = list(graph.basic_blocks)
    out["tracer"] = graph.source.get("tracer")
    out["options"] = graph.source.get("options")
    out["seconds"] = {k: round(v, 3) for k, v in seconds.items()}
    if "timings_s" in graph.source:
        out["trace_phases_s"] = graph.source["timings_s"]
    return out


def _print_graph_summary(s: dict) -> None:
    gran = s["granularity"] + (f" ({', '.join(s['basic_blocks'])})" if s["basic_blocks"] else "")
    print(f"traced {s['model']} at {gran} granularity with {s['tracer']} in {s['seconds'].get('trace', 0):.2f} s")
    print(_kv([
        ("nodes", f"{s['nodes']:,} ({s['op_nodes']:,} compute, the rest inputs and the output)"),
        ("edges", f"{s['edges']:,}"),
        ("parameters", f"{s['parameters']:,} ({human_bytes(s['parameter_bytes'])})"
                       + (f", {s['tied_parameters']} tied" if s["tied_parameters"] else "")),
        ("buffers", f"{s['buffers']}"),
        ("activations", f"{human_bytes(s['activation_bytes'])} computed per forward pass"),
        ("inputs", ", ".join(s["inputs"]) or "-"),
        ("loss", s["loss"] or "none found (no scalar floating-point output)"),
        ("graph hash", s["hash"]),
    ]))


def _profile_key_for(graph, method: str, hardware_name: str, optimizer: str) -> str:
    from .profile import graph_dtype, profile_key

    return profile_key(graph.content_hash(), hardware_name, graph_dtype(graph),
                       graph.source.get("options", {}).get("batch_size"), optimizer, method)


def _parse_device(text: str):
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu, cuda or cuda:N; got {text!r}")
    return device


def _measured_hardware_name(device) -> str:
    from .profile import measured_hardware_name

    return measured_hardware_name(device)


def _check_weights(graph, params: dict) -> None:
    """Refuse weights that do not fit the graph (a model rebuilt with other options)."""
    from .profile import ProfileError

    for name, info in graph.params.items():
        t = params.get(name)
        if t is None:
            continue
        shape, dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")
        if shape != tuple(info.meta.shape) or dtype != info.meta.dtype:
            raise ProfileError(
                f"the model rebuilt from the graph's source does not match the graph: {name} is "
                f"{dtype}{list(shape)} but the graph has {info.meta.dtype}{list(info.meta.shape)}; "
                "re-run `ftcompile trace` or profile the model by name")


def _rebuild_for_graph(graph, ui: _Ui):
    """The model a graph file was traced from, rebuilt on the CPU with real weights."""
    from .models import ModelOptions
    from .profile import ProfileError

    name = graph.source.get("model")
    recorded = graph.source.get("options") or {}
    if not name:
        raise ProfileError("a measured profile needs the model's weights, but this graph file does not "
                           "record which model it was traced from; profile the model by name instead")
    known = {f.name for f in fields(ModelOptions)}
    options = ModelOptions(**{**{k: v for k, v in recorded.items() if k in known}, "device": "cpu"})
    ui.note(f"rebuilding {name} on the CPU for its weights")
    return _build(name, options)


def _run_profile(graph, *, method: str, hw=None, device=None, optimizer: str, repeats: int = 5,
                 warmup: int = 1, built=None, progress: Callable[[int, int], None] | None = None):
    from .profile import analytic_profile, graph_input_values, host_params, measured_profile

    if method == "analytic":
        return analytic_profile(graph, hw, optimizer=optimizer, progress=progress)
    params = host_params(graph, built.model)
    _check_weights(graph, params)
    args, kwargs = built.make_inputs("cpu")
    inputs = graph_input_values(graph, args, kwargs)
    return measured_profile(graph, params, inputs, device=device, optimizer=optimizer, warmup=warmup,
                            repeats=repeats, progress=progress)


def _print_profile_summary(s: dict, model: str | None, nodes: int, seconds: float | None = None) -> None:
    took = f" in {seconds:.2f} s" if seconds is not None else ""
    batch = f", batch {s['batch_size']}" if s.get("batch_size") is not None else ""
    print(f"{s['method']} profile of {model or 'graph'} on {s['hardware']} ({s['dtype']}{batch}, "
          f"{s['optimizer']}): {nodes:,} nodes{took}")
    flops = ""
    if s["flops_forward"]:
        flops = f"  ({human_count(s['flops_forward'])}FLOP fwd, {human_count(s['flops_backward'])}FLOP bwd)"
    print(_kv([
        ("forward", human_ms(s["forward_ms"])),
        ("backward", human_ms(s["backward_ms"]) + flops),
        ("activations", f"{human_bytes(s['activation_bytes'])} kept for backward"),
        ("weights", f"{human_bytes(s['param_bytes'])}, gradients {human_bytes(s['grad_bytes'])}, "
                    f"{s['optimizer']} state {human_bytes(s['optimizer_bytes'])}"),
    ]))
    if s["heaviest"]:
        print("heaviest nodes (forward + backward):")
        rows = [(h["node"], h["name"], h["op"], human_ms(h["forward_ms"]), human_ms(h["backward_ms"]))
                for h in s["heaviest"]]
        print("\n".join("  " + line for line in
                        format_table(("node", "name", "op", "forward", "backward"), rows, right=(0, 3, 4))
                        .splitlines()))


# --------------------------------------------------------------------------- commands

def cmd_models(args: argparse.Namespace) -> int:
    from .models import list_models

    entries = list_models()
    if args.json:
        _emit_json([{"name": e.name, "family": e.family, "parameters": e.approx_parameters,
                     "description": e.description,
                     # a zoo model's dtype left unset is float32 (models.base.ModelOptions)
                     "default_options": {"dtype": "float32", **{k: v for k, v in asdict(e.default_options).items()
                                                                 if v is not None}}}
                    for e in entries])
        return 0

    def defaults(o) -> str:
        parts = [f"batch {o.batch_size}"] if o.batch_size else []
        for f, label in (("seq_len", "seq"), ("encoder_len", "enc"), ("decoder_len", "dec")):
            if getattr(o, f):
                parts.append(f"{label} {getattr(o, f)}")
        return ", ".join(parts)

    rows = [(e.name, e.family, human_count(e.approx_parameters), defaults(e.default_options), e.description)
            for e in entries]
    print(format_table(("name", "family", "params", "defaults", "description"), rows, right=(2,)))
    print("\nModels of 500M parameters or more are built on the meta device unless --device says otherwise.")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    ui = _Ui(args)
    options = _model_options(args)
    t0 = time.perf_counter()
    with _stdout_for(args), ui.phases(f"trace {args.model}", TRACE_PHASES) as note:
        note("build")
        built = _build(args.model, options)
        blocks = _parse_blocks(args.basic_blocks, built.basic_blocks)
        t1 = time.perf_counter()
        graph = _trace_built(built, blocks, note, ui=ui, args=args)
        t2 = time.perf_counter()
        if args.output:
            _save(graph, args.output, "graph")
    summary = _graph_summary(graph, {"build": t1 - t0, "trace": t2 - t1, "total": time.perf_counter() - t0})
    summary["output"] = args.output
    if args.json:
        _emit_json(summary)
        return 0
    _print_graph_summary(summary)
    if args.output:
        print(f"wrote {args.output}; next: ftcompile profile {args.output}")
    elif not blocks and built.basic_blocks:
        print(f"(layer granularity: --basic-blocks {','.join(built.basic_blocks)}; save with -o FILE)")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from .hardware import load_hardware
    from .ir import OpGraph
    from .profile import cached, store

    ui = _Ui(args)
    is_graph = args.target.endswith(".json") or os.path.isfile(args.target)
    given = _given_model_options(args)
    if is_graph and (given or args.basic_blocks):
        flags = ["--" + k.replace("_", "-") for k in given] + (["--basic-blocks"] if args.basic_blocks else [])
        raise UsageError(f"{', '.join(flags)}: model options only apply when TARGET is a model; the graph "
                         f"file {args.target} was traced with fixed options (re-trace it to change them)")
    _check_cache_dir(args)
    measured = args.method == "measured"
    hw = device = None
    if measured:
        if args.hardware:
            ui.note("--hardware only prices analytic profiles; a measured profile times this machine")
        device = _parse_device(args.profile_device or "cpu")
        hardware_name = _measured_hardware_name(device)
    else:
        if args.profile_device:
            ui.note("--device only applies to --method measured; an analytic profile runs on meta")
        hw = load_hardware(args.hardware or DEFAULT_HARDWARE)
        hardware_name = hw.name

    t0 = time.perf_counter()
    built = None
    with _stdout_for(args):
        if is_graph:
            graph = OpGraph.load(args.target)
            model_name = graph.source.get("model")
        else:
            # A measured profile needs real weights: build on the CPU (the zoo's "auto"
            # would put a large model on meta).
            options = _model_options(args, **({"device": "cpu"} if measured else {}))
            with ui.phases(f"trace {args.target}", TRACE_PHASES) as note:
                note("build")
                built = _build(args.target, options)
                graph = _trace_built(built, _parse_blocks(args.basic_blocks, built.basic_blocks), note, ui=ui,
                                     args=args)
            model_name = built.name
        t1 = time.perf_counter()

        key = _profile_key_for(graph, args.method, hardware_name, args.optimizer)
        profile = None
        if not args.no_cache:
            profile = cached(args.cache_dir, key)
            if profile is not None and not _cache_fits(profile, graph, hw, args):
                profile = None
        reused = profile is not None
        cache_file = os.path.join(args.cache_dir, key + ".json") if not args.no_cache else None
        if reused:
            ui.note(f"reused cached profile {cache_file}")
        else:
            if measured and built is None:
                built = _rebuild_for_graph(graph, ui)
            with ui.steps(f"{args.method} profile", "node") as progress:
                profile = _run_profile(graph, method=args.method, hw=hw, device=device,
                                       optimizer=args.optimizer, repeats=args.repeats, warmup=args.warmup,
                                       built=built, progress=progress)
            if not args.no_cache:
                cache_file = store(args.cache_dir, profile)
        t2 = time.perf_counter()
        if args.output:
            _save(profile, args.output, "profile")

    op_nodes = sum(1 for _ in graph.op_nodes())
    summary = profile.summary(graph)
    summary.update({"model": model_name, "graph_hash": graph.content_hash(), "profiled_nodes": op_nodes,
                    "cached": reused, "cache_file": cache_file, "output": args.output,
                    "seconds": {"graph": round(t1 - t0, 3), "profile": round(t2 - t1, 3)}})
    if args.json:
        _emit_json(summary)
        return 0
    _print_profile_summary(summary, model_name, op_nodes, None if reused else t2 - t1)
    if cache_file:
        print(f"{'reused' if reused else 'cached as'} {cache_file}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


def _cache_fits(profile, graph, hw, args: argparse.Namespace) -> bool:
    """Whether a cached profile answers this request (the key does not hold everything)."""
    if profile.graph_hash != graph.content_hash():
        return False
    if hw is not None and json.loads(json.dumps(hw.to_json())) != profile.hardware:
        return False  # a spec file reusing a preset's name with other figures
    if args.method == "measured":
        if profile.info.get("repeats") != args.repeats or profile.info.get("warmup") != args.warmup:
            return False
        if profile.hardware.get("device") != str(_parse_device(args.profile_device or "cpu")):
            return False
    return True


def cmd_demo(args: argparse.Namespace) -> int:
    from .hardware import load_hardware

    ui = _Ui(args)
    report: dict[str, Any] = {"model": args.model}
    say = (lambda *a, **k: None) if args.json else print
    out_dir = args.out_dir or None

    def path(name: str) -> str | None:
        return os.path.join(out_dir, name) if out_dir else None

    with _stdout_for(args):
        t = time.perf_counter()
        say(f"ftcompile demo: {args.model}, on the CPU\n")
        say("[1/6] build the model with random weights on the CPU")
        built = _build(args.model, _model_options(args, device="cpu"))
        o = built.options
        report["build"] = {"parameters": built.num_parameters, "options": asdict(o),
                           "seconds": round(time.perf_counter() - t, 3)}
        dims = ", ".join(f"{f.replace('_', ' ')} {getattr(o, f)}" for f in ("batch_size", "seq_len", "encoder_len",
                                                                             "decoder_len") if getattr(o, f))
        say(f"      {built.num_parameters:,} parameters; {dims}; dtype {o.dtype or 'as the function built it'}\n")

        say("[2/6] trace at operator granularity (every ATen operator is a node)")
        t = time.perf_counter()
        with ui.phases("trace", TRACE_PHASES) as note:
            graph = _trace_built(built, (), note, ui=ui, args=args)
        s = _graph_summary(graph, {"trace": time.perf_counter() - t})
        if path("graph.json"):
            _save(graph, path("graph.json"), "graph")
        report["trace_op"] = s
        say(f"      {s['nodes']:,} nodes, {s['edges']:,} edges, {human_bytes(s['activation_bytes'])} of "
            f"activations per forward; loss value {s['loss']}  ({s['seconds']['trace']:.2f} s)\n")

        blocks = list(built.basic_blocks)
        layer = None
        if blocks:
            say(f"[3/6] trace at layer granularity (--basic-blocks {','.join(blocks)}: one node per block call)")
            t = time.perf_counter()
            layer = _trace_built(built, blocks, lambda _phase: None, ui=ui, args=args)
            ls = _graph_summary(layer, {"trace": time.perf_counter() - t})
            if path("graph-layer.json"):
                _save(layer, path("graph-layer.json"), "graph")
            report["trace_layer"] = ls
            say(f"      {ls['nodes']:,} nodes, {ls['edges']:,} edges  ({ls['seconds']['trace']:.2f} s)\n")
        else:
            say("[3/6] layer granularity: skipped, this model suggests no basic blocks\n")

        say("[4/6] analytic profile: FLOPs and bytes of every kernel, priced on the 'cpu' hardware preset")
        hw = load_hardware("cpu")
        t = time.perf_counter()
        with ui.steps("analytic profile") as progress:
            analytic = _run_profile(graph, method="analytic", hw=hw, optimizer="adam", progress=progress)
        if path("profile-analytic.json"):
            _save(analytic, path("profile-analytic.json"), "profile")
        a = analytic.summary(graph)
        a["seconds"] = round(time.perf_counter() - t, 3)
        report["profile_analytic"] = a
        if not args.json:
            _print_profile_summary(a, built.name, s["op_nodes"], a["seconds"])
        say()

        say(f"[5/6] measured profile: every node run forward and backward on this CPU "
            f"({args.warmup} warm-up + {args.repeats} timed runs, median)")
        t = time.perf_counter()
        with ui.steps("measured profile") as progress:
            measured = _run_profile(graph, method="measured", device="cpu", optimizer="adam",
                                    repeats=args.repeats, warmup=args.warmup, built=built, progress=progress)
        if path("profile-measured.json"):
            _save(measured, path("profile-measured.json"), "profile")
        m = measured.summary(graph)
        m["seconds"] = round(time.perf_counter() - t, 3)
        report["profile_measured"] = m
        if not args.json:
            _print_profile_summary(m, built.name, s["op_nodes"], m["seconds"])
        say()

        say("[6/6] compile: every partitioner proposes a plan for the 2-worker CPU cluster '2xcpu' "
            "(analytic costs,\n      1F1B schedule, 4 micro-batches); each plan is simulated and the fastest wins")
        from .cluster import PRESETS
        from .compile import compile_plan, plan_document, report_text, write_report
        from .plan import Problem

        t = time.perf_counter()
        problem = Problem(graph, analytic, PRESETS["2xcpu"], schedule="1f1b", micro_batches=4)
        result = compile_plan(problem, "auto")
        doc = plan_document(result, model=graph.source)
        if out_dir:
            write_report(os.path.join(out_dir, "plan"), doc, result)
        if out_dir and result.chosen is not None:
            from .codegen import compile_package

            # The chosen plan as a package: `ftcompile verify` and `ftcompile run` take it from here.
            compile_package(built=built, graph=graph, doc=doc, out_dir=os.path.join(out_dir, "plan"))
        report["compile"] = {"chosen": result.chosen, "lower_bound_ms": result.lower_bound_ms,
                             "strategies": doc["strategies"], "seconds": round(time.perf_counter() - t, 3)}
        if not args.json:
            print("\n".join("      " + line for line in report_text(doc).splitlines()[3:]))
        say()

    report["granularity"] = {"op_nodes": s["nodes"], "layer_nodes": layer and len(layer.nodes),
                             "basic_blocks": blocks}
    report["files"] = [p for p in (path("graph.json"), layer is not None and path("graph-layer.json"),
                                   path("profile-analytic.json"), path("profile-measured.json"),
                                   path(os.path.join("plan", "plan.json"))) if p]
    if args.json:
        _emit_json(report)
        return 0
    print("summary")
    rows = [("operator", s["nodes"], s["edges"])]
    if layer is not None:
        rows.append((f"layer ({','.join(blocks)})", len(layer.nodes), len(layer.edges)))
    print("\n".join("  " + line for line in format_table(("granularity", "nodes", "edges"), rows, right=(1, 2))
                    .splitlines()))
    if layer is not None:
        print(f"  layer granularity has {s['nodes'] / len(layer.nodes):.1f}x fewer nodes for the partitioner")
    fa, fm = a["forward_ms"] + a["backward_ms"], m["forward_ms"] + m["backward_ms"]
    print(f"  forward+backward: analytic {human_ms(fa)} vs measured {human_ms(fm)} "
          f"(the 'cpu' preset is a generic CPU; per-operator overheads dominate tiny models)")
    if report["files"]:
        print(f"  files: {', '.join(report['files'])}")
    plan_dir = os.path.join(out_dir, "plan") if out_dir else "OUT"
    print(f"\nnext: ftcompile verify {plan_dir}; ftcompile run {plan_dir} --nproc 2 --data text;\n"
          f"      ftcompile compile t5-tiny --gpus 3 -o out/t5-tiny; ftcompile diff {plan_dir} out/t5-tiny")
    return 0


# --------------------------------------------------------------------------- entry point

def _expected_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean 'the user asked for something that cannot be done'.

    ZooError, GraphError, ProfileError and HardwareError are ValueErrors; TraceError
    is a RuntimeError; file problems are OSErrors.
    """
    errors: tuple[type[BaseException], ...] = (ValueError, OSError)
    try:
        from .trace import TraceError
    except Exception:  # noqa: BLE001 - a broken import is reported as the error itself
        return errors
    return errors + (TraceError,)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    return text or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 expected error, 1 internal error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if not getattr(args, "command", None):
        parser.print_help(sys.stderr)
        return 2
    debug = bool(getattr(args, "debug", False))
    if not debug:
        # transformers warns about config details (loss_type=None...) that mean nothing here.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        # torch.export's pytree helpers warn about their own deprecations on every trace.
        import warnings

        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `ftcompile models | head`: the reader left; say nothing more.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as exc:  # noqa: BLE001 - the single place errors become messages
        if debug:
            traceback.print_exc()
        if isinstance(exc, _expected_errors()):
            # A bare ValueError may be a bad value or a bug: leave a way to find out which.
            bare = type(exc) is ValueError and not debug
            print(f"{PROG}: error: {_one_line(exc)}" + (" (--debug shows where)" if bare else ""),
                  file=sys.stderr)
            return 2
        hint = "" if debug else "; re-run with --debug for the traceback"
        print(f"{PROG}: internal error: {type(exc).__name__}: {_one_line(exc)} (this is a bug{hint})",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
