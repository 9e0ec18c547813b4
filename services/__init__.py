"""AIKG services: gateway, generator, worker, and the SDK."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("aikg")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"
