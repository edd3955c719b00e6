"""The consistency engine: records in, findings out. Pure: no torch, sockets, files or I/O."""

from .matcher import Engine, EngineStats
from .model import Finding, Obs

__all__ = ["Engine", "EngineStats", "Finding", "Obs"]
