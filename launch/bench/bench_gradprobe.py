"""Step-time overhead of the gradient probe at L0/L1/L2 against no probe, in one process.

Model: 4 x (Linear(3584, 3584) + ReLU), 51.4 M parameters, batch 32, SGD, CPU. The four modes
run interleaved in blocks of consecutive steps (block order shuffled every round) so that drift
and noise on a shared box hit all modes alike. Each mode steps its own SGD instance over the same
parameters (plain SGD keeps no state, so this is the same training), and each probe hooks only
its own optimizer. The first step of every block is discarded; after a block the probe is
flushed outside the timed region, so timed steps carry the background writes of their
predecessors (steady state) but a block's last writes never leak into another mode.

    python launch/bench/bench_gradprobe.py --rounds 6 --block 5
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch

from commcheck.gradprobe import GradProbe

WIDTH = 3584
LAYERS = 4
TARGETS = {"L0": 1.10, "L1": 1.20, "L2": 1.30}
MSPROBE = {"L0": 2.8, "L1": 2.4, "L2": 12.1}


@dataclass
class Mode:
    name: str
    level: str
    optimizer: torch.optim.Optimizer
    probe: GradProbe | None
    times: list[float] = field(default_factory=list)


def build_model(width: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds")
    parser.add_argument("--block", type=int, default=5, help="consecutive steps per mode/round")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=WIDTH, help="Linear size (smoke tests)")
    parser.add_argument("--dump-dir", default=None, help="where dumps go (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the dumps")
    parser.add_argument("--levels", default="L0,L1,L2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--control", action="store_true",
        help="a second mode without probe: its ratio is the run's noise floor",
    )
    parser.add_argument(
        "--torch-kernels", action="store_true",
        help="also run each level without the native CPU kernel (modes named L0/t, ...)",
    )
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model = build_model(args.width)
    n_params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)
    root = args.dump_dir or tempfile.mkdtemp(prefix="bench_gradprobe_")

    def sgd() -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-4)

    modes = [Mode("off", "", sgd(), None)]
    if args.control:
        modes.append(Mode("off'", "", sgd(), None))
    for level in args.levels.split(","):
        for native in (True, False) if args.torch_kernels else (True,):
            name = level if native else f"{level}/t"
            opt = sgd()
            probe = GradProbe(
                model, level=level, dump_path=f"{root}/{name.replace('/', '-')}", optimizer=opt,
                native_kernel=native,
            )
            modes.append(Mode(name, level, opt, probe))

    for mode in modes:
        for _ in range(3):
            train_step(model, mode.optimizer, x)
        if mode.probe is not None:
            mode.probe.flush()

    rng = random.Random(args.seed)
    for _ in range(args.rounds):
        order = modes[:]
        rng.shuffle(order)
        for mode in order:
            for i in range(args.block):
                elapsed = train_step(model, mode.optimizer, x)
                if i:
                    mode.times.append(elapsed)
            if mode.probe is not None:
                mode.probe.flush()

    for mode in modes:
        if mode.probe is not None:
            mode.probe.stop()
    report(modes, n_params, args)
    if not args.keep and args.dump_dir is None:
        shutil.rmtree(root, ignore_errors=True)


def report(modes: list[Mode], n_params: int, args: argparse.Namespace) -> None:
    base = statistics.median(modes[0].times)
    width = args.width
    print(
        f"model {LAYERS} x Linear({width}, {width}) + ReLU: {n_params / 1e6:.1f} M params, "
        f"batch {args.batch}, SGD, CPU, {torch.get_num_threads()} threads; "
        f"{args.rounds} rounds x {args.block - 1} timed steps per mode"
    )
    print(f"{'mode':<5} {'median ms':>10} {'ratio':>7} {'target':>7} {'msprobe':>8}  result  drops")
    for mode in modes:
        med = statistics.median(mode.times)
        if mode.probe is None:
            print(f"{mode.name:<5} {med * 1e3:>10.1f} {med / base:>7.3f}")
            continue
        ratio = med / base
        target = TARGETS.get(mode.level, float("nan"))
        verdict = "ok" if ratio <= target else "MISS"
        wc = mode.probe.writer_counters
        drops = mode.probe.counters.directions_dropped + (wc.steps_dropped if wc else 0)
        print(
            f"{mode.name:<5} {med * 1e3:>10.1f} {ratio:>7.3f} {target:>7.2f} "
            f"{MSPROBE.get(mode.level, float('nan')):>7.1f}x  {verdict:<6}  {drops}"
        )


if __name__ == "__main__":
    main()
