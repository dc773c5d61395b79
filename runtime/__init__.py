"""Run-time support for generated pipeline packages: everything a package needs, nothing from the compiler.

>>> from ftcompile.runtime import load_package
>>> package = load_package("out/gpt2-tiny")           # checks SHA256SUMS, reads the manifest
>>> stage = package.build_stage(0, device="cpu")      # an nn.Module holding its weights
"""

from .manifest import Manifest, ManifestError, ParamSpec, StageSpec, ValueSpec
from .package import Package, PackageError, load_package

__all__ = ["Manifest", "ManifestError", "Package", "PackageError", "ParamSpec", "StageSpec", "ValueSpec",
           "load_package"]
