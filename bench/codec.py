"""Codec micro-benchmark: encode / decode throughput of realistic messages.

Messages measured:

* one ``TrajectoryGroup`` as the rollout pool sends it: 16 trajectories x
  4096 response tokens, a 512-token prompt, vocab 151936;
* a ~1 GiB weight push cut into 64 MiB ``WeightBucket`` s (plus its manifest),
  and ``verify_buckets`` (CRC32 of every byte) over the decoded push.

Columns: ``encode`` = :func:`protocol.encode`; ``decode`` = frame + msgpack
parse only (:func:`protocol.codec.unpack_frame`); ``decode+validate`` = the
full :func:`protocol.decode`. GB/s is message bytes / best-of-N wall time.
``zero-copy`` says whether the decoded arrays share memory with the input.

Run: ``.venv/bin/python bench/codec.py [--weights-mib 1024] [--bucket-mib 64]``;
prints a table and writes ``bench/results/codec_cpu.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol import Trajectory, TrajectoryGroup, decode, encode, pack_buckets  # noqa: E402
from protocol.codec import unpack_frame  # noqa: E402
from protocol.weights import verify_buckets  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "codec_cpu.json"


def best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def realistic_group(rng: np.random.Generator, group_size=16, response_tokens=4096, prompt_tokens=512,
                    vocab=151936) -> TrajectoryGroup:
    trajs = [Trajectory(rng.integers(0, vocab, response_tokens), -rng.exponential(1.0, response_tokens),
                        np.full(response_tokens, 41) + (np.arange(response_tokens) > 2000), float(rng.random()),
                        "length") for _ in range(group_size)]
    return TrajectoryGroup("group-0", "prompt-0", rng.integers(0, vocab, prompt_tokens), trajs, group_size,
                           vocab, scheduled_step=42, engine_id="engine-0", created_at=time.time())


def weight_push(rng: np.random.Generator, total_mib: int, bucket_mib: int):
    """Tensors of 16 MiB (a 2048 x 2048 fp32 matrix each) packed into buckets."""
    tensor = 2048 * 2048 * 4
    block = rng.integers(0, 256, tensor, dtype=np.uint8)
    tensors = [(f"model.layers.{i}.mlp.weight", "float32", (2048, 2048), np.roll(block, i))
               for i in range(total_mib * (1 << 20) // tensor)]
    return pack_buckets(tensors, version=3, bucket_bytes=bucket_mib << 20)


def shares_input(msg, wire) -> bool | None:
    """Do the decoded arrays view the input buffer? None for a message without arrays."""
    arrays = [getattr(msg, "data", None), getattr(msg, "prompt_ids", None)]
    arrays = [a for a in arrays if a is not None]
    if not arrays:
        return None
    return all(np.shares_memory(a, np.frombuffer(wire, np.uint8)) for a in arrays)


def measure(name: str, messages: list, repeats: int) -> dict:
    """Throughput over a list of messages (one message, or all buckets of a push)."""
    wires = [encode(m) for m in messages]
    nbytes = sum(len(w) for w in wires)
    t_enc = best_seconds(lambda: [encode(m) for m in messages], repeats)
    t_dec = best_seconds(lambda: [unpack_frame(w) for w in wires], repeats)
    t_val = best_seconds(lambda: [decode(w) for w in wires], repeats)
    return {"message": name, "count": len(messages), "bytes": nbytes,
            "encode_gbps": nbytes / t_enc / 1e9, "decode_gbps": nbytes / t_dec / 1e9,
            "decode_validate_gbps": nbytes / t_val / 1e9,
            "encode_ms": t_enc * 1e3, "decode_ms": t_dec * 1e3, "decode_validate_ms": t_val * 1e3,
            "zero_copy": shares_input(decode(wires[0]), wires[0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights-mib", type=int, default=1024, help="total size of the weight push")
    parser.add_argument("--bucket-mib", type=int, default=64, help="bucket size")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    group = realistic_group(rng)
    manifest, buckets = weight_push(rng, args.weights_mib, args.bucket_mib)

    rows = [measure("TrajectoryGroup 16x4096 (+512 prompt)", [group], args.repeats),
            measure(f"WeightManifest ({len(manifest.tensors)} tensors)", [manifest], args.repeats),
            measure(f"WeightBucket x{len(buckets)} ({args.bucket_mib} MiB each)", buckets, max(args.repeats // 2, 2))]

    decoded_manifest = decode(encode(manifest))
    decoded = [decode(encode(b)) for b in buckets]
    t_verify = best_seconds(lambda: verify_buckets(decoded_manifest, decoded), 2)
    push_bytes = manifest.total_bytes
    reference = np.empty_like(buckets[0].data)
    t_copy = best_seconds(lambda: np.copyto(reference, buckets[0].data), args.repeats)

    print(f"{'message':44} {'bytes':>13} {'encode GB/s':>12} {'decode GB/s':>12} {'dec+val GB/s':>13} zero-copy")
    for r in rows:
        print(f"{r['message']:44} {r['bytes']:>13,} {r['encode_gbps']:>12.3f} {r['decode_gbps']:>12.3f} "
              f"{r['decode_validate_gbps']:>13.3f} {'n/a' if r['zero_copy'] is None else r['zero_copy']}")
    print(f"{'verify_buckets (CRC32) over the push':44} {push_bytes:>13,} {push_bytes / t_verify / 1e9:>12.2f}")
    print(f"{'memcpy of one bucket (reference)':44} {buckets[0].data.nbytes:>13,} "
          f"{buckets[0].data.nbytes / t_copy / 1e9:>12.2f}")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__, "cpus": os.cpu_count()},
        "args": vars(args), "rows": rows,
        "verify_buckets_gbps": push_bytes / t_verify / 1e9,
        "memcpy_gbps": buckets[0].data.nbytes / t_copy / 1e9,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
