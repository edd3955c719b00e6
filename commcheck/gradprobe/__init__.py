"""msprobe-compatible gradient probe: per-step gradient statistics, dumps and run comparison.

Names are loaded on first use so that the CLI's ``grad compare`` does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "GradComparator": "compare",
    "RankComparison": "compare",
    "GradProbeConfig": "config",
    "build_config": "config",
    "load_config": "config",
    "parse_config": "config",
    "DumpFormatError": "errors",
    "DumpNotFoundError": "errors",
    "GradProbeConfigError": "errors",
    "GradProbeError": "errors",
    "NoCommonDataError": "errors",
    "GradProbe": "probe",
    "PrecisionDebugger": "probe",
    "ProbeEvent": "events",
    "Sink": "events",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
