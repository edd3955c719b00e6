"""The consistency engine: records in, findings out. Pure: no torch, sockets, files or I/O."""

from .core import DEFAULT_HANG_TIMEOUT, Engine
from .model import Finding, Obs
from .state import EngineStats, RankState

__all__ = ["DEFAULT_HANG_TIMEOUT", "Engine", "EngineStats", "Finding", "Obs", "RankState"]
