"""The consistency engine: records in, findings out. Pure: no torch, sockets, files or I/O."""

from .core import DEFAULT_HANG_TIMEOUT, Engine, EngineStats, RankState
from .model import Finding, Obs

__all__ = ["DEFAULT_HANG_TIMEOUT", "Engine", "EngineStats", "Finding", "Obs", "RankState"]
