"""The package version (kept apart so that run manifests can name it without importing the API)."""

__version__ = "0.1.0"
