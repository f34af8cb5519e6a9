"""Trajectory-channel benchmark: Ray transports for encoded TrajectoryGroups.

What crosses the channel in production: one msgpack-encoded
``protocol.TrajectoryGroup`` per prompt (16 trajectories; here 512 or 4096
response tokens and a 256-token prompt), sent by a rollout-engine actor and
received by the learner job, which is a Ray driver. This script reproduces
exactly that: a ``Sender`` actor (async, like the engine actor) sends
pre-encoded groups and the driver receives them.

Transports compared in one run:

* ``channel``       -- ``services.job.channel.TrajectoryChannel`` as shipped: a
  ``ray.util.queue.Queue`` actor holding object refs (``ray.put`` by the
  sender, the ref wrapped in a one-element list);
* ``queue_value``   -- the same Queue, the bytes passed by value (they travel
  through the queue actor);
* ``stream_gen``    -- a Ray streaming generator: the sender's
  ``@ray.method(num_returns="streaming")`` async generator yields the bytes,
  the driver iterates the ``ObjectRefGenerator`` (backpressure through
  ``_generator_backpressure_num_objects`` = the queue's maxsize);
* ``exp_channel``   -- ``ray.experimental.channel.Channel``: one shared-memory
  slot, the writer blocks until the reader has read (experimental API).

Per transport and size: unloaded one-way latency (the sender paces with a gap
so the driver is idle; latency = driver's clock when it holds the bytes minus
the sender's clock just before it sends; same host, same clock), throughput
(back to back, first send to last receive) in MB/s and groups/s, and for the
Queue transports the time to create a channel (actor up and answering) and
close it. Every received message is checked for its length; the last one of
each run is decoded with ``protocol.decode``.

Run: ``.venv/bin/python bench/channel.py``  (~1-2 min on 2 CPU cores); prints
a table and writes ``bench/results/channel_cpu.json``.
"""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from protocol import Trajectory, TrajectoryGroup, decode, encode  # noqa: E402
from services.job.channel import TrajectoryChannel  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "channel_cpu.json"
MIB = 1 << 20
GROUP_SIZE = 16
PROMPT_TOKENS = 256
VOCAB = 151936
RESPONSE_TOKENS = (512, 4096)
DISTINCT_PAYLOADS = 4       # groups cycled by the sender (distinct bytes, no caching effects)
LATENCY_MESSAGES = 30
LATENCY_GAP_S = 0.05        # long enough that the driver is idle when a message is sent
THROUGHPUT_MESSAGES = {512: 200, 4096: 80}
MAXSIZE = 8                 # queue bound / generator backpressure window
CREATE_CLOSE_REPEATS = 5
WAIT_S = 120.0              # bound on every wait in this script


def realistic_group(rng: np.random.Generator, response_tokens: int, index: int) -> TrajectoryGroup:
    trajs = [Trajectory(rng.integers(0, VOCAB, response_tokens), -rng.exponential(1.0, response_tokens),
                        np.full(response_tokens, 7) + (np.arange(response_tokens) > response_tokens // 2),
                        float(rng.random()), "length") for _ in range(GROUP_SIZE)]
    return TrajectoryGroup(f"group-{index}", f"prompt-{index}", rng.integers(0, VOCAB, PROMPT_TOKENS), trajs,
                           GROUP_SIZE, VOCAB, scheduled_step=3, engine_id="engine-0", created_at=time.time())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def define_actors(ray):
    @ray.remote(num_cpus=0)
    class Sender:
        """Stands in for the engine actor: async, sends pre-encoded groups, records send times."""

        def __init__(self, payloads: list[bytes]):
            self.payloads = payloads
            self.sent_at: list[float] = []

        def sent_times(self) -> list[float]:
            return self.sent_at

        async def to_channel(self, channel: TrajectoryChannel, n: int, gap_s: float) -> None:
            self.sent_at = []
            for i in range(n):
                self.sent_at.append(time.time())
                await channel.send_async(self.payloads[i % len(self.payloads)], WAIT_S)
                await asyncio.sleep(gap_s)

        async def to_queue_by_value(self, queue, n: int, gap_s: float) -> None:
            self.sent_at = []
            for i in range(n):
                self.sent_at.append(time.time())
                await queue.put_async(self.payloads[i % len(self.payloads)], timeout=WAIT_S)
                await asyncio.sleep(gap_s)

        @ray.method(num_returns="streaming")
        async def stream(self, n: int, gap_s: float):
            self.sent_at = []
            for i in range(n):
                self.sent_at.append(time.time())
                yield self.payloads[i % len(self.payloads)]
                await asyncio.sleep(gap_s)

        def make_exp_channel(self, reader, node_id: str, nbytes: int):
            from ray.experimental.channel import Channel

            return Channel(ray.get_runtime_context().current_actor, [(reader, node_id)], typ=nbytes)

        def to_exp_channel(self, channel, n: int, gap_s: float) -> None:
            channel.ensure_registered_as_writer()
            self.sent_at = []
            for i in range(n):
                self.sent_at.append(time.time())
                channel.write(self.payloads[i % len(self.payloads)], timeout=WAIT_S)
                time.sleep(gap_s)

    @ray.remote(num_cpus=0)
    class Placeholder:
        """The reader handle an experimental Channel requires; the driver does the reading."""

        def ready(self) -> bool:
            return True

    return Sender, Placeholder


def run_transfer(ray, start, receive, sender, n: int, gap_s: float, expected_len: int) -> dict:
    """Start the sender, receive ``n`` messages in the driver, return latencies and total time."""
    done = start(n, gap_s)
    received_at, last = [], b""
    for _ in range(n):
        last = receive()
        received_at.append(time.time())
        if len(last) != expected_len:
            raise AssertionError(f"received {len(last)} bytes, expected {expected_len}")
    if done is not None:
        ray.get(done, timeout=WAIT_S)
    decode(last, expect=TrajectoryGroup)
    sent_at = ray.get(sender.sent_times.remote(), timeout=WAIT_S)
    return {"latency_s": [r - s for r, s in zip(received_at, sent_at)], "total_s": received_at[-1] - sent_at[0]}


def measure(ray, name: str, open_transport, nbytes: int, tokens: int, sender) -> dict:
    """Latency then throughput for one transport; ``open_transport()`` -> (start, receive, close)."""
    start, receive, close = open_transport()
    try:
        lat = run_transfer(ray, start, receive, sender, LATENCY_MESSAGES, LATENCY_GAP_S, nbytes)["latency_s"]
    finally:
        close()
    n = THROUGHPUT_MESSAGES[tokens]
    start, receive, close = open_transport()
    try:
        total = run_transfer(ray, start, receive, sender, n, 0.0, nbytes)["total_s"]
    finally:
        close()
    ms = [x * 1e3 for x in lat]
    return {"transport": name, "response_tokens": tokens, "message_bytes": nbytes,
            "latency_ms_p50": statistics.median(ms), "latency_ms_p90": percentile(ms, 0.9),
            "latency_ms_max": max(ms), "throughput_MBps": n * nbytes / total / 1e6,
            "groups_per_s": n / total, "messages": {"latency": LATENCY_MESSAGES, "throughput": n}}


def transports(ray, sender, placeholder, nbytes: int) -> dict:
    """name -> factory of (start(n, gap) -> ref|None, receive() -> bytes, close())."""
    from ray.util.queue import Queue

    def channel():
        ch = TrajectoryChannel.create("bench", MAXSIZE)
        return (lambda n, gap: sender.to_channel.remote(ch, n, gap), lambda: ch.recv(WAIT_S), ch.close)

    def queue_value():
        q = Queue(maxsize=MAXSIZE, actor_options={"num_cpus": 0})
        return (lambda n, gap: sender.to_queue_by_value.remote(q, n, gap), lambda: q.get(timeout=WAIT_S),
                lambda: q.shutdown(force=True))

    def stream_gen():
        state = {}

        def start(n, gap):
            state["gen"] = sender.stream.options(_generator_backpressure_num_objects=MAXSIZE).remote(n, gap)
            return None

        def receive():
            return ray.get(next(state["gen"]), timeout=WAIT_S)

        return start, receive, lambda: None

    def exp_channel():
        node = ray.get_runtime_context().get_node_id()
        ch = ray.get(sender.make_exp_channel.remote(placeholder, node, nbytes + MIB), timeout=WAIT_S)
        ch.ensure_registered_as_reader()
        return (lambda n, gap: sender.to_exp_channel.remote(ch, n, gap), lambda: ch.read(timeout=WAIT_S),
                ch.close)

    return {"channel": channel, "queue_value": queue_value, "stream_gen": stream_gen, "exp_channel": exp_channel}


def create_close_ms(ray) -> dict:
    """Create a channel, wait until its queue actor answers, close it; median and max over repeats."""
    times = []
    for i in range(CREATE_CLOSE_REPEATS):
        t0 = time.perf_counter()
        ch = TrajectoryChannel.create(f"bench-create-{i}", MAXSIZE)
        ch.size()
        ch.close()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "max_ms": max(times), "repeats": CREATE_CLOSE_REPEATS}


def main() -> None:
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    rng = np.random.default_rng(0)
    payloads = {t: [encode(realistic_group(rng, t, i)) for i in range(DISTINCT_PAYLOADS)] for t in RESPONSE_TOKENS}
    t0 = time.perf_counter()
    ray.init(address="local", _temp_dir=tempfile.mkdtemp(prefix="inflight-bench-ray-"), include_dashboard=False,
             object_store_memory=512 * MIB, namespace="inflight", log_to_driver=True)
    print(f"ray.init {time.perf_counter() - t0:.1f} s", flush=True)
    Sender, Placeholder = define_actors(ray)
    placeholder = Placeholder.remote()
    rows, failures = [], {}
    try:
        create_close = create_close_ms(ray)
        print(f"channel create+close: median {create_close['median_ms']:.0f} ms, max {create_close['max_ms']:.0f} ms",
              flush=True)
        for tokens in RESPONSE_TOKENS:
            nbytes = len(payloads[tokens][0])
            sender = Sender.remote(payloads[tokens])
            ray.get([sender.sent_times.remote(), placeholder.ready.remote()], timeout=WAIT_S)
            for name, factory in transports(ray, sender, placeholder, nbytes).items():
                try:
                    row = measure(ray, name, factory, nbytes, tokens, sender)
                except Exception as exc:  # noqa: BLE001 - an experimental transport may fail; record it
                    failures[f"{name}/{tokens}"] = f"{type(exc).__name__}: {exc}"[:300]
                    print(f"  {name:12s} {tokens:5d} tok FAILED {failures[f'{name}/{tokens}']}", flush=True)
                    continue
                rows.append(row)
                print(f"  {name:12s} {tokens:5d} tok {nbytes / MIB:6.2f} MiB  p50 {row['latency_ms_p50']:6.2f} ms  "
                      f"p90 {row['latency_ms_p90']:6.2f} ms  {row['throughput_MBps']:7.1f} MB/s  "
                      f"{row['groups_per_s']:7.1f} groups/s", flush=True)
            ray.kill(sender)
    finally:
        ray.kill(placeholder)
        ray.shutdown()
    print_table(rows, create_close)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "ray": ray.__version__, "load_average_1_5_15": os.getloadavg()},
        "setup": {"group_size": GROUP_SIZE, "prompt_tokens": PROMPT_TOKENS, "maxsize": MAXSIZE,
                  "latency_gap_s": LATENCY_GAP_S},
        "create_close_ms": create_close, "results": rows, "failures": failures}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


def print_table(rows: list[dict], create_close: dict) -> None:
    print(f"\n{'transport':12s} {'tokens':>6s} {'MiB':>5s} {'p50 ms':>7s} {'p90 ms':>7s} {'MB/s':>7s} {'groups/s':>9s}")
    for r in rows:
        print(f"{r['transport']:12s} {r['response_tokens']:6d} {r['message_bytes'] / MIB:5.2f} "
              f"{r['latency_ms_p50']:7.2f} {r['latency_ms_p90']:7.2f} {r['throughput_MBps']:7.1f} "
              f"{r['groups_per_s']:9.1f}")
    print(f"channel create+close (queue actor up, answering, killed): median {create_close['median_ms']:.0f} ms")


if __name__ == "__main__":
    main()
