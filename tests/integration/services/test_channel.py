"""The trajectory channel on a real (private, local) Ray cluster.

A ``Sender`` actor stands in for a rollout engine (async, calls
``send_async`` like ``services.pool.engine_actor``); the test process is the
receiver, as the learner job is. Covered: byte-exact ordered round trip of
real encoded groups, backpressure, bounded waits on empty / full / closed
channels, messages of a dead sender still delivered, and 20 attach/detach cycles
(normal, sender killed mid-stream, channel closed under a blocked sender)
leaving no actor processes and no ``/dev/shm`` entries behind.
"""
from __future__ import annotations

import os
import time

import numpy as np
import psutil
import pytest
import ray

from protocol import Trajectory, TrajectoryGroup, decode, encode
from services.job.channel import ChannelClosed, ChannelTimeout, TrajectoryChannel

GROUP_SIZE = 16
PROMPT_TOKENS = 256
VOCAB = 151936
WAIT_S = 30.0  # bound on waits that are expected to succeed
SLACK_S = 3.0  # allowed lateness of a timeout on this loaded 2-core machine
MULTIPROCESSING_LOCK = "sem.mp-"
"""The /dev/shm prefix of Python multiprocessing's named semaphores (spawn context)."""
ORPHAN_SETTLE_S = 10.0  # longer than Ray takes to act on a dead owner (measured ~8 s: a queue of object refs lost them)


def drain(channel: TrajectoryChannel) -> list[bytes]:
    """Everything queued now, without waiting for more messages."""
    out: list[bytes] = []
    while True:
        try:
            out.append(channel.recv(0.0))
        except ChannelTimeout:
            return out


def encoded_group(index: int, response_tokens: int) -> bytes:
    rng = np.random.default_rng(index)
    trajs = [Trajectory(rng.integers(0, VOCAB, response_tokens), -rng.exponential(1.0, response_tokens),
                        np.full(response_tokens, 2), float(rng.random()), "length") for _ in range(GROUP_SIZE)]
    return encode(TrajectoryGroup(f"group-{index}", f"prompt-{index}", rng.integers(0, VOCAB, PROMPT_TOKENS),
                                  trajs, GROUP_SIZE, VOCAB, scheduled_step=1, engine_id="engine-test"))


@ray.remote(num_cpus=0)
class Sender:
    """Stands in for an engine actor: async, sends through ``send_async``."""

    async def send_all(self, channel: TrajectoryChannel, payloads: list[bytes], timeout_s: float) -> int:
        for data in payloads:
            await channel.send_async(data, timeout_s)
        return len(payloads)

    async def send_forever(self, channel: TrajectoryChannel, data: bytes, timeout_s: float) -> None:
        while True:
            await channel.send_async(data, timeout_s)

    def ready(self) -> int:
        return os.getpid()


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def test_round_trip_bytes_order_and_decode(ray_cluster):
    payloads = [encoded_group(i, 512 if i % 3 else 4096) for i in range(10)]
    channel = TrajectoryChannel.create("roundtrip", maxsize=3)  # smaller than the stream: senders wait for room
    sender = Sender.remote()
    try:
        sent = sender.send_all.remote(channel, payloads, WAIT_S)
        received = [channel.recv(WAIT_S) for _ in payloads]
        assert ray.get(sent, timeout=WAIT_S) == len(payloads)
        assert [len(r) for r in received] == [len(p) for p in payloads]
        assert received == payloads  # byte-identical, in order
        groups = [decode(r, expect=TrajectoryGroup) for r in received]
        assert [g.group_id for g in groups] == [f"group-{i}" for i in range(10)]
        assert groups[0].trajectories[0].response_ids.size == 4096
        assert channel.size() == 0
    finally:
        channel.close()
        ray.kill(sender)


def test_backpressure_send_times_out_naming_the_channel(ray_cluster):
    channel = TrajectoryChannel.create("bp-driver", maxsize=2)
    sender = Sender.remote()
    try:
        data = encoded_group(0, 64)
        channel.send(data, 5.0)
        channel.send(data, 5.0)
        t0 = time.monotonic()
        with pytest.raises(ChannelTimeout, match="'bp-driver'.*no room") as err:
            channel.send(data, 0.5)
        assert 0.5 <= time.monotonic() - t0 < 0.5 + SLACK_S
        assert "full at 2" in str(err.value)
        assert channel.size() == 2
        # the same from an engine-like async actor: the task fails with ChannelTimeout
        with pytest.raises(ChannelTimeout, match="'bp-driver'"):
            ray.get(sender.send_all.remote(channel, [data], 0.5), timeout=WAIT_S)
        assert drain(channel) == [data, data]  # nothing extra got in; drain does not wait
        channel.send(data, 0.5)  # room again
    finally:
        channel.close()
        ray.kill(sender)


def test_recv_on_empty_channel_times_out_within_bound(ray_cluster):
    channel = TrajectoryChannel.create("empty", maxsize=4)
    try:
        channel.size()  # actor up: the bound below measures the wait, not actor start-up
        for timeout_s in (0.0, 0.7):
            t0 = time.monotonic()
            with pytest.raises(ChannelTimeout, match="'empty'.*nothing arrived"):
                channel.recv(timeout_s)
            assert timeout_s <= time.monotonic() - t0 < timeout_s + SLACK_S
        assert drain(channel) == []
    finally:
        channel.close()


def test_closed_channel_raises_channel_closed(ray_cluster):
    channel = TrajectoryChannel.create("closed", maxsize=2)
    sender = Sender.remote()
    data = encoded_group(1, 64)
    try:
        blocked = sender.send_forever.remote(channel, data, 60.0)  # fills the queue, then waits for room
        wait_for(lambda: channel.size() == 2, WAIT_S, "the sender to fill the queue")
        t0 = time.monotonic()
        channel.close()
        with pytest.raises(ChannelClosed, match="'closed' is closed"):
            ray.get(blocked, timeout=WAIT_S)  # the blocked send fails promptly, not after its 60 s bound
        assert time.monotonic() - t0 < 10.0
        for operation in (lambda: channel.recv(1.0), lambda: channel.send(data, 1.0), channel.size):
            with pytest.raises(ChannelClosed, match="'closed' is closed"):
                operation()
        with pytest.raises(ChannelClosed, match="'closed' is closed"):
            ray.get(sender.send_all.remote(channel, [data], 1.0), timeout=WAIT_S)
        channel.close()  # idempotent
    finally:
        ray.kill(sender)


def test_messages_of_a_dead_sender_arrive_intact(ray_cluster):
    """Queued messages live in the queue actor (by value), not with their sender: after the sender is
    killed and Ray has had time to act on its death, every message it had sent is still read, intact."""
    channel = TrajectoryChannel.create("orphans", maxsize=8)
    sender = Sender.remote()
    orphans = [encoded_group(i, 4096) for i in range(3)]
    try:
        assert ray.get(sender.send_all.remote(channel, orphans, WAIT_S), timeout=WAIT_S) == 3
        ray.kill(sender)
        wait_for(lambda: not ray_actor_alive(sender), WAIT_S, "the sender to die")
        time.sleep(ORPHAN_SETTLE_S)
        later = encoded_group(9, 64)
        channel.send(later, WAIT_S)  # owned by the (living) test process
        received = [channel.recv(WAIT_S)]
        while received[-1] != later:
            received.append(channel.recv(WAIT_S))
        assert received[:-1] == orphans, "a dead sender's messages were lost or changed"
    finally:
        channel.close()


def ray_actor_alive(actor) -> bool:
    try:
        ray.get(actor.ready.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
    return True


# --------------------------------------------------------------------------- attach / detach cycles

def actor_processes() -> dict[str, int]:
    """Actor worker processes of *this* cluster (descendants of this process), by class name."""
    counts: dict[str, int] = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if title.startswith("ray::") and not title.startswith("ray::IDLE"):
            name = title[len("ray::"):].split()[0].split(".")[0]
            counts[name] = counts.get(name, 0) + 1
    return counts


def shm_in_use_by_others(ours: set[int]) -> set[str]:
    """/dev/shm entries mapped or open in processes outside this test's process tree."""
    used: set[str] = set()
    for pid in (int(d) for d in os.listdir("/proc") if d.isdigit()):
        if pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as maps:
                used.update(line.rsplit("/dev/shm/", 1)[1].split()[0] for line in maps if "/dev/shm/" in line)
            used.update(os.path.basename(os.readlink(f"/proc/{pid}/fd/{fd}")) for fd in os.listdir(f"/proc/{pid}/fd")
                        if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/"))
        except OSError:  # the process exited meanwhile, or is not ours to read
            continue
    return used


def our_pids() -> set[int]:
    return {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}


def run_cycle(index: int, sender, kind: str, payload: bytes, n: int = 6):
    """One learner attach/detach: create the channel, stream, read, close. Returns the (maybe new) sender."""
    channel = TrajectoryChannel.create(f"cycle-{index}", maxsize=3)
    try:
        if kind == "normal":
            task = sender.send_all.remote(channel, [payload] * n, WAIT_S)
            assert [channel.recv(WAIT_S) for _ in range(n)] == [payload] * n
            assert ray.get(task, timeout=WAIT_S) == n
        elif kind == "sender_killed":
            sender.send_forever.remote(channel, payload, WAIT_S)
            assert [channel.recv(WAIT_S) for _ in range(2)] == [payload] * 2
            ray.kill(sender)  # mid-stream: the queue holds messages it owned
            wait_for(lambda: not ray_actor_alive(sender), WAIT_S, "the killed sender to die")
            assert all(m == payload for m in drain(channel))  # what it had sent is still there
            sender = Sender.remote()  # the pool replaces its engine
        elif kind == "closed_while_blocked":
            task = sender.send_forever.remote(channel, payload, 60.0)
            wait_for(lambda: channel.size() == 3, WAIT_S, "the sender to block on a full queue")
            channel.close()
            with pytest.raises(ChannelClosed, match=f"'cycle-{index}'"):
                ray.get(task, timeout=WAIT_S)
        else:
            raise ValueError(kind)
    finally:
        channel.close()
    return sender


def test_attach_detach_cycles_leak_no_processes_or_shm(ray_cluster):
    kinds = ["normal", "sender_killed", "normal", "closed_while_blocked"] * 5  # 20 cycles
    payload = encoded_group(7, 64)
    sender = Sender.remote()
    ray.get(sender.ready.remote(), timeout=WAIT_S)
    try:
        sender = run_cycle(-1, sender, "normal", payload)  # warm-up: Ray starts its worker pool
        time.sleep(2.0)
        baseline = actor_processes()
        shm_before = set(os.listdir("/dev/shm"))
        assert baseline.get("_QueueActor", 0) == 0, baseline
        foreign_shm: set[str] = set()  # other agents share this /dev/shm; remember what their processes use
        for i, kind in enumerate(kinds):
            sender = run_cycle(i, sender, kind, payload)
            foreign_shm |= shm_in_use_by_others(our_pids())
        ray.get(sender.ready.remote(), timeout=WAIT_S)

        # killed actors' processes exit asynchronously: give Ray a few seconds to settle
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and actor_processes() != baseline:
            time.sleep(0.5)
        assert actor_processes() == baseline, f"actor processes before {baseline}, after {actor_processes()}"

        # ignore entries other agents' processes use(d), transient ones that vanish within seconds, and Python
        # multiprocessing's named locks (sem.mp-*: nothing in the channel's stack creates them; the vLLM processes
        # of another test session on the machine do, and their resource tracker holds them unmapped until it exits)
        deadline = time.monotonic() + 5.0
        while True:
            foreign_shm |= shm_in_use_by_others(our_pids())
            leaked = {e for e in set(os.listdir("/dev/shm")) - shm_before - foreign_shm
                      if not e.startswith(MULTIPROCESSING_LOCK)}
            if not leaked or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not leaked, f"/dev/shm entries left after 20 cycles: {sorted(leaked)}"
    finally:
        ray.kill(sender)
