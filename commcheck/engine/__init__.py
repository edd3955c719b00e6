"""The consistency engine: records in, findings out. Pure: no torch, sockets, files or I/O."""

from .findings import DETAILS, Finding, Kind, Report, Summary
from .matcher import Engine, EngineStats
from .model import Obs

__all__ = ["DETAILS", "Engine", "EngineStats", "Finding", "Kind", "Obs", "Report", "Summary"]
