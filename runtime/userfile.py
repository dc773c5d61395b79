"""Importing a user's Python file: a model or a dataset given as ``FILE.py:FUNCTION``."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType


class UserFileError(ImportError):
    """The file cannot be imported; the message names it and the error it raised."""


def import_user_file(path: Path, prefix: str) -> ModuleType:
    """Import the file at ``path`` (resolved) as a fresh module, and return it.

    The module is named ``{prefix}_{stem}_{digest of the path}``, so that two files
    with the same stem (``a/model.py``, ``b/model.py``) never replace each other in
    ``sys.modules``. It is registered there before it runs, as a normal import does:
    dataclasses and pickling look the module up by name while it runs.
    """
    stem = re.sub(r"\W", "_", path.stem)
    name = f"{prefix}_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserFileError(f"cannot import {str(path)!r} as a Python module; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise UserFileError(f"importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module
