"""The package version, in one place: pyproject.toml reads it (``dynamic = ["version"]``), and so do
``omnicupy.__version__``, the CLI and the kernel cache key."""
__version__ = "0.2.0"
