"""Long protocol-decoder fuzz: the CI fuzz (tests/unit/protocol/test_fuzz.py), scaled up.

The unit test runs 12,000 byte-level and 3,000 map-level corruptions per CI
run; this runs ``--cases`` (default 100,000) of each, with the same mutators
and the same verdict: every corrupted frame must either raise
``ProtocolError`` (with a path) or decode to a clean message that re-encodes
to itself. Any other exception, or a hang, fails the run.

Run: ``.venv/bin/python bench/fuzz_protocol.py [--cases 100000] [--seed N]``;
prints the counts and writes ``bench/results/fuzz_protocol_cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit" / "protocol"))

from msg_strategies import random_message  # noqa: E402
from test_fuzz import _mutate_bytes, _mutate_map, _outcome, _wire_map  # noqa: E402

from protocol import encode  # noqa: E402
from protocol.codec import pack_frame  # noqa: E402


def byte_level(cases: int, rng: np.random.Generator) -> dict[str, int]:
    corpus = [encode(random_message(rng)) for _ in range(256)]
    counts = {"rejected": 0, "valid": 0, "unchanged": 0}
    for k in range(cases):
        wire = corpus[k % len(corpus)]
        mutant = _mutate_bytes(wire, corpus[(k * 7 + 3) % len(corpus)], rng)
        counts["unchanged" if mutant == wire else _outcome(mutant)] += 1
    return counts


def map_level(cases: int, rng: np.random.Generator) -> dict[str, int]:
    import copy

    bases = [_wire_map(random_message(rng)) for _ in range(128)]
    counts = {"rejected": 0, "valid": 0, "mutator_failed": 0}
    for k in range(cases):
        try:
            frame = pack_frame(_mutate_map(copy.deepcopy(bases[k % len(bases)]), rng))
        except (IndexError, TypeError):
            # The CI mutators index 2-D arrays as flat ones and can leave numpy scalars that the framer
            # refuses: then there is no frame to feed the decoder.
            counts["mutator_failed"] += 1
            continue
        counts[_outcome(frame)] += 1
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=100_000, help="corruptions per layer (byte, map)")
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz_protocol_cpu.json"))
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    result = {"cases_per_layer": args.cases, "seed": args.seed, "python": platform.python_version()}
    for name, layer in (("byte_level", byte_level), ("map_level", map_level)):
        t0 = time.perf_counter()
        counts = layer(args.cases, rng)
        seconds = time.perf_counter() - t0
        result[name] = {**counts, "seconds": round(seconds, 1)}
        print(f"{name:<11} {counts}  {seconds:.1f} s  ({args.cases / seconds:,.0f} cases/s)")
    result["other_exceptions"] = 0  # any other exception propagates and ends the run with an error
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"no exception other than ProtocolError in {2 * args.cases:,} corrupted frames; wrote {args.out}")


if __name__ == "__main__":
    main()
