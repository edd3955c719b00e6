"""GradProbe dumps: layout, CSV bytes and values computed independently here, filters, hooks."""

from __future__ import annotations

import csv
import io
import logging
import math
import os

import numpy as np
import pytest
import torch
import xxhash

from commcheck.gradprobe import GradProbe, ProbeEvent
from commcheck.gradprobe import probe as probe_module
from commcheck.gradprobe.buffers import SlotPool

BOM = b"\xef\xbb\xbf"
BIG = (1100, 1000)  # 1.1 M elements: the chunked path with two chunks


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(BIG))
        self.small = torch.nn.Parameter(torch.zeros(3, 4))
        self.vec = torch.nn.Parameter(torch.zeros(5))


def make_grads(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(BIG, generator=gen) * 0.01
    big.view(-1)[:1000] = 0.0
    big.view(-1)[1000:1010] = 0.001  # exactly on a bound: must land in the closed side
    small = torch.tensor([[-1.0, 0.0, 1.0, 2.0], [-2.0, 0.5, -0.5, 0.0], [1e-3, -1e-3, 3.0, -3.0]])
    vec = torch.randn(5, generator=gen)
    return {"big": big, "small": small, "vec": vec}


def run(model: Net, optimizer: torch.optim.Optimizer, steps: int, seed0: int = 0) -> list[dict]:
    history = []
    for i in range(steps):
        grads = make_grads(seed0 + i)
        for name, p in model.named_parameters():
            p.grad = grads[name].clone()
        optimizer.step()
        history.append(grads)
    return history


def csv_lines(path: str) -> list[str]:
    with open(path, "rb") as fh:
        raw = fh.read()
    assert raw.startswith(BOM)
    assert raw.endswith(b"\r\n") and b"\n" not in raw.replace(b"\r\n", b"")
    return raw[len(BOM) :].decode().split("\r\n")[:-1]


def expected_stats(g: torch.Tensor) -> tuple[float, float, float]:
    x = g.numpy().astype(np.float64)
    return float(np.float32(x.max())), float(np.float32(x.min())), float(np.sqrt((x * x).sum()))


def expected_fractions(g: torch.Tensor, bounds: list[float]) -> list[float]:
    x = g.numpy().reshape(-1)
    edges = [-np.inf, *[np.float32(b) for b in bounds], np.inf]
    counts = [int(np.sum((x > lo) & (x <= hi))) for lo, hi in zip(edges, edges[1:], strict=False)]
    counts[-1] += int(np.isnan(x).sum())
    return [c / x.size for c in counts] + [int(np.sum(x == 0)) / x.size]


def check_row(cells: list[str], g: torch.Tensor, name: str) -> None:
    mx, mn, norm = expected_stats(g)
    assert cells[0] == name
    assert cells[-4] == repr(mx) and cells[-3] == repr(mn)
    # float32 accumulation over ~1e6 elements (msprobe's torch.norm has the same error)
    assert math.isclose(float(cells[-2]), norm, rel_tol=1e-4)
    if g.numel() < 1 << 15:
        assert cells[-2] == repr(torch.norm(g).item())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("level", ["L0", "L1", "L2"])
def test_layout_and_csv_contents(tmp_path, level: str) -> None:
    bounds = [-0.001, 0, 0.001]
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(model, level=level, dump_path=str(tmp_path), bounds=bounds)
    history = run(model, opt, 2)
    probe.stop()
    rank = tmp_path / "rank0"
    names = ["big", "small", "vec"]
    expected_files = {"grad_summary_0.csv", "grad_summary_1.csv"}
    if level != "L0":
        expected_files |= {"step0", "step1"}
    assert set(os.listdir(rank)) == expected_files
    header = {
        "L0": "param_name,MD5,max,min,norm,shape",
        "L1": "param_name,max,min,norm,shape",
        "L2": 'param_name,"(-inf, -0.001]","(-0.001, 0]","(0, 0.001]","(0.001, inf)",=0,'
        "max,min,norm,shape",
    }[level]
    for step, grads in enumerate(history):
        lines = csv_lines(str(rank / f"grad_summary_{step}.csv"))
        assert lines[0] == header
        assert [line.split(",")[0] for line in lines[1:]] == names
        assert lines[1].endswith(',"[1100, 1000]"') and lines[3].endswith(",[5]")
        for line, name in zip(lines[1:], names, strict=True):
            cells = next(csv.reader([line]))
            g = grads[name]
            check_row(cells, g, name)
            if level == "L0":
                assert cells[1] == xxhash.xxh3_64_hexdigest(g.numpy().tobytes())
            if level == "L2":
                got = [float(c) for c in cells[1:6]]
                assert got == expected_fractions(g, bounds)
            if level != "L0":
                path = rank / f"step{step}" / f"{name}.npy"
                direction = np.load(path)
                assert direction.dtype == np.bool_ and direction.shape == tuple(g.shape)
                np.testing.assert_array_equal(direction, g.numpy() > 0)
                reference = io.BytesIO()
                np.save(reference, g.numpy() > 0)
                assert path.read_bytes() == reference.getvalue()


@pytest.mark.timeout(20)
def test_bucket_fractions_are_right_closed(tmp_path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(model, level="L2", dump_path=str(tmp_path), param_list=["small"])
    run(model, opt, 1)
    probe.stop()
    lines = csv_lines(str(tmp_path / "rank0" / "grad_summary_0.csv"))
    assert lines[0].startswith('param_name,"(-inf, -1]","(-1, 0]","(0, 1]","(1, inf)",=0,')
    cells = lines[1].split(",")
    # small = [-1, 0, 1, 2, -2, .5, -.5, 0, 1e-3, -1e-3, 3, -3]
    assert [float(c) for c in cells[1:6]] == [3 / 12, 4 / 12, 3 / 12, 2 / 12, 2 / 12]


@pytest.mark.timeout(20)
def test_nan_goes_to_last_interval_on_both_paths(tmp_path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(model, level="L2", dump_path=str(tmp_path))
    grads = make_grads(0)
    grads["big"].view(-1)[5] = float("nan")
    grads["vec"][0] = float("nan")
    for name, p in model.named_parameters():
        p.grad = grads[name]
    opt.step()
    probe.stop()
    lines = csv_lines(str(tmp_path / "rank0" / "grad_summary_0.csv"))
    for line, name in zip(lines[1:], ["big", "small", "vec"], strict=True):
        cells = next(csv.reader([line]))
        assert [float(c) for c in cells[1:6]] == expected_fractions(grads[name], [-1, 0, 1])
        if name != "small":
            assert cells[6] == "nan" and cells[7] == "nan"


@pytest.mark.timeout(20)
def test_step_and_param_filters(tmp_path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(
        model, level="L1", dump_path=str(tmp_path), step=[1, "3-4"], param_list=["vec", "small"]
    )
    run(model, opt, 6)
    probe.stop()
    rank = tmp_path / "rank0"
    assert sorted(os.listdir(rank)) == sorted(
        [f"grad_summary_{s}.csv" for s in (1, 3, 4)] + [f"step{s}" for s in (1, 3, 4)]
    )
    lines = csv_lines(str(rank / "grad_summary_3.csv"))
    assert [line.split(",")[0] for line in lines[1:]] == ["small", "vec"]
    assert sorted(os.listdir(rank / "step3")) == ["small.npy", "vec.npy"]
    assert probe.step == 5


@pytest.mark.timeout(20)
def test_rank_filter(tmp_path, monkeypatch) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(model, level="L1", dump_path=str(tmp_path / "a"), rank=[1, "3-4"])
    run(model, opt, 1)
    probe.stop()
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr(probe_module, "current_rank", lambda: 3)
    probe = GradProbe(model, level="L1", dump_path=str(tmp_path / "b"), rank=[1, "3-4"])
    run(model, opt, 1)
    probe.stop()
    assert os.listdir(tmp_path / "b") == ["rank3"]
    assert (tmp_path / "b" / "rank3" / "grad_summary_0.csv").exists()


@pytest.mark.timeout(20)
def test_main_grad_wins_and_other_optimizers_do_not_count(tmp_path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    unrelated = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.0)
    probe = GradProbe(model, level="L1", dump_path=str(tmp_path), param_list=["vec"])
    model.vec.grad = torch.ones(5)
    model.vec.main_grad = torch.full((5,), -2.0)
    unrelated.step()
    opt.step()
    unrelated.step()
    probe.stop()
    assert probe.step == 0
    cells = csv_lines(str(tmp_path / "rank0" / "grad_summary_0.csv"))[1].split(",")
    assert cells[1:3] == ["-2.0", "-2.0"]
    assert not np.load(tmp_path / "rank0" / "step0" / "vec.npy").any()


@pytest.mark.timeout(20)
def test_packed_direction_beside_npy(tmp_path) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(model, dump_path=str(tmp_path), packed_direction=True)
    grads = run(model, opt, 1)[0]
    probe.stop()
    step = tmp_path / "rank0" / "step0"
    for name, g in grads.items():
        bits = np.load(step / f"{name}.bits")
        unpacked = np.unpackbits(bits, count=g.numel()).astype(bool).reshape(g.shape)
        np.testing.assert_array_equal(unpacked, g.numpy() > 0)
        assert bits.nbytes == (g.numel() + 7) // 8


@pytest.mark.timeout(20)
def test_sink_sees_grads_then_params_and_errors_never_reach_training(tmp_path, caplog) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    events: list[ProbeEvent] = []

    def sink(event: ProbeEvent) -> None:
        events.append(event)
        if event.phase == "param":
            raise RuntimeError("sink exploded")

    probe = GradProbe(model, dump_path=str(tmp_path), sink=sink, param_list=["vec"])
    with caplog.at_level(logging.ERROR, logger="commcheck.gradprobe"):
        run(model, opt, 3)
    probe.stop()
    assert [(e.phase, e.step) for e in events] == [
        (phase, step) for step in range(3) for phase in ("grad", "param")
    ]
    assert events[0].names == ("vec",) and events[1].tensors[0] is not None
    assert probe.counters.sink_errors == 3
    assert sum("sink failed" in r.message for r in caplog.records) == 1


@pytest.mark.timeout(20)
def test_internal_hook_failure_is_counted_not_raised(tmp_path, monkeypatch, caplog) -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = GradProbe(model, dump_path=str(tmp_path))

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stats exploded")

    monkeypatch.setattr(probe._engine, "compute", boom)
    with caplog.at_level(logging.ERROR, logger="commcheck.gradprobe"):
        run(model, opt, 2)
    probe.stop()
    assert probe.counters.hook_errors == 2
    assert sum("hook failed" in r.message for r in caplog.records) == 1


@pytest.mark.timeout(10)
def test_slot_pool_is_bounded() -> None:
    pool = SlotPool(((4,), (2, 3)), torch.device("cpu"), budget=2 * 8192)
    a, b = pool.acquire(False), pool.acquire(False)
    assert a is not None and b is not None and pool.acquire(False) is None
    pool.release(a)
    assert pool.acquire(False) is a
    assert [t.shape for t in a.tensors] == [torch.Size([4]), torch.Size([2, 3])]


def test_float64_gradients_above_the_small_cutoff_are_dumped(tmp_path):
    import csv

    import torch

    from commcheck.gradprobe import GradProbe

    model = torch.nn.Linear(200, 200).double()  # 40,000 elements: the chunked CPU path
    probe = GradProbe(model, level="L1", dump_path=str(tmp_path), live_check=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 200, dtype=torch.float64)).sum().backward()
    opt.step()
    probe.stop()
    assert probe.counters.hook_errors == 0
    with open(tmp_path / "rank0" / "grad_summary_0.csv", encoding="utf-8-sig") as f:
        rows = {r["param_name"]: r for r in csv.DictReader(f)}
    norm = float(model.weight.grad.norm())
    assert abs(float(rows["weight"]["norm"]) - norm) <= 1e-5 * norm
