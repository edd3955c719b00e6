#!/usr/bin/env python3
"""Long fuzzing of ``commcheck.wire.decode``, by hand: atheris (coverage-guided) when it is
importable, else hypothesis rounds with fresh seeds until the time is up.

    python launch/tools/fuzz_wire.py --seconds 3600            # hypothesis, or atheris if present
    python launch/tools/fuzz_wire.py --engine atheris -- -max_len=65536 corpus/

The contract under test (tests/fuzzing.py): decode raises WireError with a short reason,
or returns a batch whose every index points inside its tables. Exit 1 with the smallest
failing input printed when something else happens.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.fuzzing import TEMPLATES, classify, hostile  # noqa: E402


def atheris_available() -> bool:
    try:
        import atheris  # noqa: F401
    except ImportError:
        return False
    return True


def splice(data: bytes) -> bytes:
    """Map raw fuzzer bytes onto a valid template, so mutations start deep in the schema."""
    if len(data) < 3:
        return data
    t = TEMPLATES[data[0] % len(TEMPLATES)]
    at = int.from_bytes(data[1:3], "little") % len(t)
    return t[:at] + data[3:] + t[at + len(data) - 3:]


def run_atheris(argv: list[str]) -> int:
    import atheris

    def one_input(data: bytes) -> None:
        classify(data)
        classify(splice(data))

    atheris.instrument_all()
    atheris.Setup([sys.argv[0], *argv], one_input)
    atheris.Fuzz()
    return 0


def run_hypothesis(seconds: float, per_round: int) -> int:
    from hypothesis import HealthCheck, given, seed, settings

    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline:
        @seed(rounds)
        @settings(max_examples=per_round, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(hostile)
        def check(data: bytes) -> None:
            classify(data)
            classify(splice(data))

        try:
            check()
        except Exception as e:
            print(f"fuzz_wire: contract broken in round {rounds} (seed {rounds}): {e!r}",
                  file=sys.stderr)
            raise
        rounds += 1
        print(f"fuzz_wire: {rounds * per_round} inputs, no failure", flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=["auto", "atheris", "hypothesis"], default="auto")
    p.add_argument("--seconds", type=float, default=600.0, help="hypothesis: time budget")
    p.add_argument("--per-round", type=int, default=2000, help="hypothesis: examples per seed")
    p.add_argument("libfuzzer_args", nargs="*", help="atheris: passed to libFuzzer (after --)")
    args = p.parse_args()
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if atheris_available() else "hypothesis"
    print(f"fuzz_wire: {engine}", flush=True)
    if engine == "atheris":
        return run_atheris(args.libfuzzer_args)
    return run_hypothesis(args.seconds, args.per_round)


if __name__ == "__main__":
    sys.exit(main())
