"""grad_probe config validation: every bad field is one GradProbeConfigError naming it."""

from __future__ import annotations

import json

import pytest
import torch

from commcheck.gradprobe import GradProbe, GradProbeConfigError, PrecisionDebugger
from commcheck.gradprobe.config import load_config, parse_config


def base(**section: object) -> dict:
    cfg = {"task": "grad_probe", "dump_path": "./d", "rank": [], "step": [], "grad_probe": {}}
    cfg["grad_probe"].update(section)
    return cfg


@pytest.mark.timeout(10)
def test_defaults_and_ranges_parse() -> None:
    cfg = parse_config(
        {
            "task": "grad_probe",
            "dump_path": "/x",
            "rank": [0, "4-6"],
            "step": ["2-3", 9],
            "grad_probe": {"grad_level": "L2", "param_list": ["a.weight"], "bounds": [-1, 0.5]},
        }
    )
    assert cfg.level == "L2" and cfg.bounds == (-1, 0.5) and cfg.param_list == ("a.weight",)
    assert [r for r in range(12) if r in cfg.rank] == [0, 4, 5, 6]
    assert [s for s in range(12) if s in cfg.step] == [2, 3, 9]
    everything = parse_config({"dump_path": "/x"})
    assert everything.level == "L1" and everything.bounds == (-1, 0, 1)
    assert 123456 in everything.step and 7 in everything.rank
    assert everything.native_kernel is True
    off = parse_config({"dump_path": "/x", "grad_probe": {"native_kernel": False}})
    assert off.native_kernel is False


BAD = [
    ({"task": "statistics"}, "task", "statistics"),
    ({"dump_path": 3}, "dump_path", 3),
    ({"dump_path": ""}, "dump_path", ""),
    ({"rank": "0"}, "rank", "0"),
    ({"rank": [1.5]}, "rank", 1.5),
    ({"rank": [True]}, "rank", True),
    ({"rank": [-1]}, "rank", -1),
    ({"step": ["6-4"]}, "step", "6-4"),
    ({"step": ["4-"]}, "step", "4-"),
    ({"step": ["a-b"]}, "step", "a-b"),
    ({"step": [2_000_000]}, "step", 2_000_000),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("override", "field", "value"), BAD)
def test_bad_top_level_field(override: dict, field: str, value: object) -> None:
    cfg = base()
    cfg.update(override)
    with pytest.raises(GradProbeConfigError) as info:
        parse_config(cfg)
    assert info.value.field == field and info.value.value == value
    assert field in str(info.value) and repr(value) in str(info.value)


BAD_SECTION = [
    ({"grad_level": "L3"}, "grad_level", "L3"),
    ({"grad_level": 1}, "grad_level", 1),
    ({"param_list": "fc.weight"}, "param_list", "fc.weight"),
    ({"param_list": [""]}, "param_list", ""),
    ({"param_list": [3]}, "param_list", 3),
    ({"bounds": [0, 0]}, "bounds", [0, 0]),
    ({"bounds": [1, 0]}, "bounds", [1, 0]),
    ({"bounds": ["0"]}, "bounds", "0"),
    ({"bounds": [True]}, "bounds", True),
    ({"bounds": [float("nan")]}, "bounds", float("nan")),
    ({"bounds": []}, "bounds", []),
    ({"bounds": 1}, "bounds", 1),
    ({"grad_lvl": "L0"}, "grad_probe.grad_lvl", "grad_lvl"),
    ({"packed_direction": "yes"}, "packed_direction", "yes"),
    ({"max_pending_mib": 0}, "max_pending_mib", 0),
    ({"native_kernel": "off"}, "native_kernel", "off"),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("section", "field", "value"), BAD_SECTION)
def test_bad_grad_probe_field(section: dict, field: str, value: object) -> None:
    with pytest.raises(GradProbeConfigError) as info:
        parse_config(base(**section))
    assert info.value.field == field
    if value == value:  # NaN never equals itself
        assert info.value.value == value
    assert field in str(info.value)


@pytest.mark.timeout(10)
def test_config_file_errors(tmp_path) -> None:
    with pytest.raises(GradProbeConfigError, match="config_path"):
        load_config(tmp_path / "missing.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(GradProbeConfigError, match="unreadable"):
        load_config(broken)
    good = tmp_path / "config.json"
    good.write_text(json.dumps(base(grad_level="L0")))
    assert load_config(good).level == "L0"


@pytest.mark.timeout(10)
def test_unknown_param_names_fail_at_monitor(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(GradProbeConfigError) as info:
        GradProbe(model, dump_path=str(tmp_path), param_list=["weight", "nope.weight"])
    assert info.value.field == "param_list" and info.value.value == "nope.weight"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(base(param_list=["bias", "missing"]) | {"dump_path": str(tmp_path)}))
    debugger = PrecisionDebugger(cfg)
    with pytest.raises(GradProbeConfigError, match="missing"):
        debugger.monitor(model)


@pytest.mark.timeout(10)
def test_keyword_api_validates_too(tmp_path) -> None:
    with pytest.raises(GradProbeConfigError, match="grad_level"):
        GradProbe(dump_path=str(tmp_path), level="L9")
    with pytest.raises(GradProbeConfigError, match="bounds"):
        GradProbe(dump_path=str(tmp_path), bounds=[0, -1])
