"""ftcompile: automatic pipeline-parallel compiler and runtime for PyTorch."""

__version__ = "0.1.0"
