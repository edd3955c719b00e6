"""The consistency engine: records in, findings out. Pure: no torch, sockets, files or I/O."""

from .core import DEFAULT_HANG_TIMEOUT, Engine
from .findings import DETAILS, Finding, Kind, Report, Summary
from .model import Obs
from .state import Condition, EngineStats, Liveness, RankState

__all__ = ["DEFAULT_HANG_TIMEOUT", "DETAILS", "Condition", "Engine", "EngineStats", "Finding",
           "Kind", "Liveness", "Obs", "RankState", "Report", "Summary"]
