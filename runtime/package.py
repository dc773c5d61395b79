"""Load a generated package: check it, read its manifest, build stage modules with their weights.

A package is a folder written by ``ftcompile compile``: ``stage_N.py`` modules,
``plan.json`` (whose ``package`` key is the :class:`~ftcompile.runtime.manifest.Manifest`),
``weights/stage_N.safetensors`` (absent for a model traced on ``meta``: weights
then come from init recipes), ``__init__.py`` and ``SHA256SUMS``.

:func:`load_package` refuses a damaged package with a :class:`PackageError`
naming what is wrong: a missing file, a manifest that is corrupt or of another
version, a weight of the wrong shape, a file whose checksum differs from
``SHA256SUMS`` (code and plan at load time; a stage's weights when that stage
is built, so that each process reads and hashes only its own stages' weights).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from .init import apply_recipe
from .manifest import Manifest, ManifestError, StageSpec, call_leaves
from .ops import StageModule

CHECKSUMS = "SHA256SUMS"


class PackageError(ValueError):
    """The folder is not a usable package; the message names the file and what to do."""


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_checksums(root: Path) -> dict[str, str]:
    """File (relative to ``root``) -> SHA-256 from ``root/SHA256SUMS``; PackageError if unreadable."""
    path = root / CHECKSUMS
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PackageError(f"{root} is not an ftcompile package: {CHECKSUMS} is missing. Generate one with "
                           "`ftcompile compile MODEL -o DIR`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PackageError(f"{path} cannot be read ({exc}); regenerate the package with `ftcompile compile`") \
            from None
    sums: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(None, 1)
        if len(parts) != 2 or len(parts[0]) != 64:
            raise PackageError(f"{path}: line {n} is not '<sha256>  <file>'; the file is damaged: regenerate the "
                               "package with `ftcompile compile`")
        sums[parts[1].strip().lstrip("*")] = parts[0].lower()
    return sums


def _check_file(root: Path, rel: str, expected: str) -> None:
    actual = sha256_file(root / rel)
    if actual != expected:
        what = ("the plan was edited after the package was generated" if rel == "plan.json"
                else "it was modified after the package was generated")
        raise PackageError(f"{root / rel}: checksum mismatch ({what}). Regenerate the package with "
                           f"`ftcompile compile`, or, if the change is deliberate, update {CHECKSUMS} "
                           f"(cd {root} && sha256sum {rel} ...)")


@dataclass
class Package:
    """A checked package: its manifest, and stage modules built on demand."""

    path: Path
    manifest: Manifest
    checksums: dict[str, str]
    verify: bool = True
    seed: int = 0
    _classes: dict[int, type] = field(default_factory=dict, repr=False)

    # ----------------------------------------------------------------- stages
    def stage_class(self, stage_id: int) -> type[StageModule]:
        """The generated class of a stage (imported from its file once)."""
        if stage_id in self._classes:
            return self._classes[stage_id]
        spec = self.manifest.stage(stage_id)
        file = self.path / f"{spec.module}.py"
        tag = hashlib.sha1(str(self.path).encode()).hexdigest()[:10]
        mod_name = f"_ftcompile_package_{tag}.{spec.module}"
        loader_spec = importlib.util.spec_from_file_location(mod_name, file)
        if loader_spec is None or loader_spec.loader is None:
            raise PackageError(f"{file}: cannot be imported")
        module = importlib.util.module_from_spec(loader_spec)
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - generated code that fails to import is a damaged package
            raise PackageError(f"{file}: importing it failed ({type(exc).__name__}: {exc}); regenerate the "
                               "package with `ftcompile compile`") from exc
        sys.modules[mod_name] = module
        cls = getattr(module, spec.cls, None)
        if cls is None or not (isinstance(cls, type) and issubclass(cls, StageModule)):
            raise PackageError(f"{file} defines no stage class {spec.cls}; regenerate the package")
        self._classes[stage_id] = cls
        return cls

    def build_stage(self, stage_id: int, device: str | torch.device = "cpu", *,
                    dtype: torch.dtype | None = None, seed: int | None = None) -> StageModule:
        """Stage ``stage_id`` as a module on ``device`` holding its weights.

        Stored weights are read from the stage's safetensors file straight onto
        ``device`` (checked against ``SHA256SUMS`` first when the package is
        verified); a package without stored weights creates them from the init
        recipes, seeded by ``seed`` (default: the package's) and each tensor's name.
        """
        spec = self.manifest.stage(stage_id)
        module = self.stage_class(stage_id)()
        self._check_declared(spec, module)
        device = torch.device(device)
        module = module.to_empty(device=device)
        if spec.weights is not None:
            self._load_weights(spec, module, device)
        else:
            named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
            for name in spec.params:
                p = self.manifest.params[name]
                if p.init is None:
                    raise PackageError(f"{self.path}/plan.json: {name} has neither stored weights nor an init "
                                       "recipe; regenerate the package")
                apply_recipe(named[name].data, p.init, seed=self.seed if seed is None else seed, name=name)
        if dtype is not None:
            module = module.to(dtype=dtype)
        return module

    def _check_declared(self, spec: StageSpec, module: StageModule) -> None:
        declared = {n: t for n, t in [*module.named_parameters(), *module.named_buffers()] if n != "_anchor"}
        expected = set(spec.params)
        if set(declared) != expected:
            extra, missing = sorted(set(declared) - expected), sorted(expected - set(declared))
            raise PackageError(f"{self.path / (spec.module + '.py')} does not declare the tensors plan.json lists "
                               f"for stage {spec.id} (extra: {extra[:5]}, missing: {missing[:5]}); regenerate the package")
        for name, t in declared.items():
            p = self.manifest.params[name]
            if tuple(t.shape) != p.shape:
                raise PackageError(f"stage {spec.id}: {name} is declared with shape {list(t.shape)} but plan.json "
                                   f"says {list(p.shape)}; regenerate the package")

    def _load_weights(self, spec: StageSpec, module: StageModule, device: torch.device) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        rel = spec.weights
        file = self.path / rel
        if self.verify:
            _check_file(self.path, rel, self.checksums[rel])
        try:
            tensors = load_file(str(file), device=str(device))
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise PackageError(f"{file}: cannot be read as safetensors ({exc}); regenerate the package") from None
        own = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        for name in spec.params:
            if name not in tensors:
                raise PackageError(f"{file} lacks {name}; regenerate the package")
            t, p = tensors[name], self.manifest.params[name]
            if tuple(t.shape) != p.shape:
                raise PackageError(f"{file}: {name} has shape {list(t.shape)}, but stage {spec.id} expects "
                                   f"{list(p.shape)}; regenerate the package")
            with torch.no_grad():
                own[name].copy_(t)

    # ----------------------------------------------------------------- inputs
    def inputs_from_call(self, args: tuple = (), kwargs: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
        """Map a call of the original model (``model(*args, **kwargs)``) to the graph's input values."""
        by_path = dict(call_leaves(args, kwargs))
        out = {}
        for inp in self.manifest.inputs:
            if inp.shape is None:
                continue
            if inp.path not in by_path:
                raise PackageError(f"the call lacks {inp.path}, an input of the traced model "
                                   f"({', '.join(i.path for i in self.manifest.inputs if i.shape)})")
            out[inp.value] = by_path[inp.path]
        return out


def load_package(path: str | os.PathLike, *, verify: bool = True, seed: int = 0) -> Package:
    """Open and check the package in folder ``path``.

    ``verify`` checks the code and plan files against ``SHA256SUMS`` now and each
    stage's weights when it is built. ``seed`` seeds weights created from init
    recipes (packages of models traced on ``meta``).
    """
    root = Path(path).resolve()
    if not root.is_dir():
        raise PackageError(f"no package folder at {path}")
    sums = read_checksums(root)
    for rel in sums:
        if not (root / rel).is_file():
            raise PackageError(f"{root / rel} is missing (listed in {CHECKSUMS}); the package is incomplete: "
                               "regenerate it with `ftcompile compile`")
    if "plan.json" not in sums:
        raise PackageError(f"{root / CHECKSUMS} does not list plan.json; regenerate the package")
    try:
        doc = json.loads((root / "plan.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise PackageError(f"{root / 'plan.json'} cannot be read as JSON ({exc}); regenerate the package") \
            from None
    try:
        manifest = Manifest.from_json(doc.get("package") if isinstance(doc, dict) else None,
                                      where=str(root / "plan.json"))
    except ManifestError as exc:
        raise PackageError(str(exc)) from None
    for s in manifest.stages:
        for rel in [f"{s.module}.py", *( [s.weights] if s.weights else [])]:
            if rel not in sums:
                raise PackageError(f"{root / CHECKSUMS} does not list {rel}, which stage {s.id} needs; "
                                   "regenerate the package")
        if s.weights:
            _check_weight_shapes(root, s, manifest)
    if verify:
        for rel, digest in sums.items():
            if rel.endswith(".safetensors"):
                continue  # hashed when its stage is built
            _check_file(root, rel, digest)
    return Package(root, manifest, sums, verify=verify, seed=seed)


def _check_weight_shapes(root: Path, spec: StageSpec, manifest: Manifest) -> None:
    """Compare a weights file's header with the manifest (cheap: reads no tensor data)."""
    from safetensors import SafetensorError, safe_open

    file = root / spec.weights
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in keys}
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise PackageError(f"{file}: cannot be read as safetensors ({exc}); regenerate the package") from None
    for name in spec.params:
        if name not in shapes:
            raise PackageError(f"{file} lacks {name}, which stage {spec.id} holds; regenerate the package")
        want = manifest.params[name].shape
        if shapes[name] != want:
            raise PackageError(f"{file}: {name} has shape {list(shapes[name])}, but stage {spec.id} expects "
                               f"{list(want)}; regenerate the package")
