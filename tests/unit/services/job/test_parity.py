"""The parity rule (services/job/parity.py) with a small fake pool and learner: an empty probe fails, the worst
engine decides, a jump over the run's own level fails, every engine (re)installed since its last probe is probed."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from handle_fakes import ServeMethod

from protocol.pool_replies import EngineStatsReply
from services.job.parity import (
    EngineInstall,
    ParityError,
    ParityProbe,
    ProbeBook,
    check_parity,
    fixed_sequences,
    parity_stats,
)

SEQUENCES = [([1, 2, 3], [4, 5]), ([6, 7], [8, 9, 10])]


def learner_logprobs(responses) -> list[list[float]]:
    return [[-0.5 * (j + 1) for j in range(len(r))] for r in responses]


def stats_of(eid: str, s: dict) -> EngineStatsReply:
    """An engine's answer to ``engine_stats`` (its incarnation: its pid, a vLLM that never restarted)."""
    if s["gone"]:
        return EngineStatsReply(eid, error="RayActorError")
    return EngineStatsReply(eid, version=s["version"], pid=s["pid"], incarnation=str(s["pid"]), refits=s["refits"])


class FakePool:
    """Engines with a pid, an install count, a version and an offset added to the learner's log-probs."""

    def __init__(self, n: int = 2, version: int = 3):
        self.version = version
        self.engines = {f"pool-engine-{i}": {"up": True, "pid": 100 + i, "refits": 1, "version": version,
                                             "offset": 0.0, "gone": False} for i in range(n)}
        self.scored: list[str] = []
        self.status = ServeMethod(lambda: SimpleNamespace(version=self.version, engines={  # what a PoolStatus has
            e: SimpleNamespace(up=s["up"], version=s["version"]) for e, s in self.engines.items()}))
        self.engine_stats = ServeMethod(lambda: {e: stats_of(e, s) for e, s in self.engines.items()})
        self.logprobs_of = ServeMethod(self._logprobs_of)

    def _logprobs_of(self, prompts, responses, engine_id):
        self.scored.append(engine_id)
        s = self.engines[engine_id]
        if s["gone"]:
            raise RuntimeError("RayActorError: the actor died")
        if "fail" in s:
            raise RuntimeError(s["fail"])
        return [[x + s["offset"] for x in lp] for lp in learner_logprobs(responses)]

    def install(self, eid: str, offset: float = 0.0) -> None:
        self.engines[eid]["refits"] += 1
        self.engines[eid]["offset"] = offset

    def push(self) -> None:
        for e, s in self.engines.items():
            if s["up"]:
                self.install(e)


class FakeLearner:
    def logprobs(self, prompts, responses, images=None):
        assert len(prompts) == len(responses) and images is None
        return learner_logprobs(responses)


def cfg(sequences: int = 2, max_kl: float = 0.01, ratio: float = 20.0):
    return SimpleNamespace(parity_probe_sequences=sequences, parity_max_gen_kl=max_kl, parity_max_gen_kl_ratio=ratio)


def probe_of(pool: FakePool, sequences=SEQUENCES) -> ParityProbe:
    return ParityProbe(cfg(), pool, FakeLearner(), sequences)


# ------------------------------------------------------------------ empty probes fail loudly

def test_a_probe_without_tokens_fails_instead_of_counting_as_kl_zero():
    with pytest.raises(ParityError, match="no tokens"):
        parity_stats([[], []], [[], []])
    with pytest.raises(ParityError, match="no tokens"):
        parity_stats([], [])
    with pytest.raises(ParityError, match="measured nothing"):
        check_parity({}, 0.01, 2)  # the old rule read a missing gen KL as 0 and passed
    with pytest.raises(ParityError, match="tokens per sequence"):
        parity_stats([[-1.0]], [[-1.0, -2.0]])
    with pytest.raises(ParityError, match="no sequences"):
        probe_of(FakePool(), sequences=[]).probe(3)
    with pytest.raises(ParityError, match="no tokens"):
        probe_of(FakePool(), sequences=[([1, 2], []), ([3], [])]).probe(3)


def test_a_probe_that_reaches_no_engine_fails():
    pool = FakePool()
    for s in pool.engines.values():
        s["up"] = False
    with pytest.raises(ParityError, match="reached no engine .*down"):
        probe_of(pool).probe(3)


def test_disabled_probe_says_so():
    probe = ParityProbe(cfg(sequences=0), FakePool(), FakeLearner(), [])
    assert probe.checked(3, lambda: None) == {"parity_engines_probed": 0}


# ------------------------------------------------------------------ every engine, the worst one decides

def test_every_engine_is_probed_and_the_worst_one_is_the_gen_kl():
    pool = FakePool(3)
    pool.engines["pool-engine-1"]["offset"] = 0.3  # a wrong install on one engine of three
    probe = probe_of(pool)
    stats, generations = probe.measure()
    assert sorted(pool.scored) == sorted(pool.engines)
    assert stats["parity_engines_probed"] == 3 and stats["parity_engines_skipped"] == 0
    assert stats["parity_worst_engine"] == "pool-engine-1"
    by_engine = stats["parity_gen_kl_by_engine"]
    assert by_engine["pool-engine-0"] == by_engine["pool-engine-2"] == 0.0
    assert stats["gen_kl_error"] == by_engine["pool-engine-1"] == pytest.approx(np.exp(0.3) - 1.3)
    assert stats["parity_max_abs_logprob_diff"] == pytest.approx(0.3)
    assert generations == {"pool-engine-0": "100:1", "pool-engine-1": "101:1", "pool-engine-2": "102:1"}
    with pytest.raises(ParityError, match="on engine pool-engine-1: gen KL"):
        probe.probe(3)
    assert probe.book.probed == {}, "a failed probe pays no engine up"


def test_a_failed_probe_pushes_again_once_then_stops():
    pool = FakePool()
    pool.engines["pool-engine-1"]["offset"] = 1.0
    probe, pushes = probe_of(pool), []
    stats = probe.checked(3, lambda: (pushes.append(1), pool.push()))  # the push repairs engine 1
    assert pushes == [1] and stats["gen_kl_error"] == 0.0 and stats["parity_engines_probed"] == 2
    assert probe.history == [0.0] and probe.last is stats

    pool.install("pool-engine-0", offset=1.0)
    pushes.clear()
    with pytest.raises(ParityError, match="pool-engine-0"):
        probe.checked(4, lambda: (pushes.append(1), pool.install("pool-engine-0", offset=1.0)))  # still wrong
    assert pushes == [1]


def test_the_final_parity_error_gives_both_measurements_and_what_to_check():
    """A gap that stays after pushing again is either a wrong install or the model's numerics: the error names
    both, with the gen KL before and after the second push, and the limit to raise once the install is proven."""
    pool = FakePool(1)
    pool.engines["pool-engine-0"]["offset"] = 0.2
    before = float(np.exp(0.2) - 1.2)
    with pytest.raises(ParityError) as raised:
        probe_of(pool).checked(0, lambda: pool.install("pool-engine-0", offset=0.3))
    message, after = str(raised.value), float(np.exp(0.3) - 1.3)
    assert raised.value.gen_kl == pytest.approx(after)
    assert f"gen KL {after:.3g} > logger.parity_max_gen_kl 0.01" in message
    assert f"({before:.3g} before pushing again)" in message
    assert "not serving the learner's weights" in message and "set logger.parity_max_gen_kl above" in message


def test_parity_check_passes_close_logprobs_and_names_a_scrambled_engine():
    learner = [[-1.0, -2.0, -0.5], [-3.0]]
    close = parity_stats([[-1.0001, -2.0, -0.5], [-3.0002]], learner)
    assert close["gen_kl_error"] < 1e-7
    check_parity(close, 0.1, 4)
    scrambled = parity_stats([[-4.0, -0.1, -3.5], [-0.2]], learner)  # e.g. gate/up halves swapped
    with pytest.raises(ParityError, match=r"v4: gen KL .* > logger.parity_max_gen_kl 0.1"):
        check_parity(scrambled, 0.1, 4)
    with pytest.raises(ParityError):
        check_parity({**close, "gen_kl_error": float("nan")}, 0.1, 4)


def test_parity_check_stops_a_jump_over_the_runs_own_level_below_the_absolute_limit():
    # measured on H200, random MoE with FlashInfer CUTLASS: reload_weights 2.6e-6, plain load_weights 3.0e-4
    right, wrong = (dict(gen_kl_error=kl, parity_mean_abs_logprob_diff=0.0, parity_max_abs_logprob_diff=0.0)
                    for kl in (2.6e-6, 3.0e-4))
    check_parity(wrong, 0.01, 7)                                     # under the absolute limit
    check_parity(wrong, 0.01, 7, history=[], max_ratio=20.0)         # no history yet: nothing to compare
    check_parity(right, 0.01, 7, history=[2.5e-6, 2.7e-6], max_ratio=20.0)
    with pytest.raises(ParityError, match=r"v7: gen KL 0.0003 is 115x the median 2.6e-06 .*ratio 20\)"):
        check_parity(wrong, 0.01, 7, history=[2.6e-6], max_ratio=20.0)
    check_parity(wrong, 0.01, 7, history=[2.6e-6], max_ratio=0.0)  # disabled
    # float32 noise far below the floor never makes a jump
    check_parity(dict(right, gen_kl_error=1e-9), 0.01, 7, history=[1e-11, 2e-11], max_ratio=20.0)


# ------------------------------------------------------------------ who owes a probe

def test_each_engine_is_probed_after_each_install_and_in_turn_otherwise():
    pool = FakePool(3)
    probe = probe_of(pool)
    probe.probe(1)
    assert sorted(pool.scored) == sorted(pool.engines)            # after the first push: all of them
    pool.scored.clear()
    probe.probe(1)                                                # nothing installed since: one in turn
    probe.probe(1)
    probe.probe(1)
    assert pool.scored == ["pool-engine-0", "pool-engine-1", "pool-engine-2"]
    pool.scored.clear()
    pool.install("pool-engine-2")                                 # e.g. the watcher reinstalled a restarted engine
    probe.probe(1)
    assert pool.scored == ["pool-engine-2"]
    pool.scored.clear()
    pool.push()                                                   # a push installs on every engine
    probe.probe(2)
    assert sorted(pool.scored) == sorted(pool.engines)


def test_an_engine_down_or_behind_is_skipped_and_still_owes_its_probe():
    pool = FakePool(2)
    probe = probe_of(pool)
    pool.engines["pool-engine-1"]["up"] = False
    stats = probe.probe(3)
    assert pool.scored == ["pool-engine-0"] and stats["parity_engines_skipped"] == 1
    pool.engines["pool-engine-1"].update(up=True, version=2)    # back, but not at the pool's version yet
    pool.scored.clear()
    probe.probe(3)
    assert pool.scored == ["pool-engine-0"]                      # nothing new on engine 0: its turn anyway
    pool.engines["pool-engine-1"].update(version=3, pid=999, refits=1)  # restarted process, reinstalled
    pool.scored.clear()
    probe.probe(3)
    assert pool.scored == ["pool-engine-1"]


def test_an_engine_that_dies_during_the_probe_is_skipped_but_one_that_errs_fails_it():
    pool = FakePool(2)
    probe = probe_of(pool)
    pool.engines["pool-engine-1"]["gone"] = True  # listed up by the pool, but its process is gone
    original, listings = pool.engine_stats.fn, []

    def stats_then_gone():  # the listing still sees it alive; the re-check after the failure does not
        listings.append(original())
        if len(listings) == 1:
            listings[0]["pool-engine-1"] = stats_of("pool-engine-1", {"pid": 101, "refits": 1, "version": 3,
                                                                      "gone": False})
        return listings[-1]

    pool.engine_stats.fn = stats_then_gone
    stats = probe.probe(3)
    assert stats["parity_engines_probed"] == 1 and stats["parity_engines_skipped"] == 1
    assert "pool-engine-1" not in probe.book.probed

    pool = FakePool(2)
    pool.engines["pool-engine-1"]["fail"] = "EngineError: logprobs_of failed"
    with pytest.raises(ParityError, match="engine pool-engine-1 did not answer: .*logprobs_of failed"):
        probe_of(pool).probe(3)


def test_probe_book_round_robin_covers_every_ready_engine():
    book = ProbeBook()
    engines = {f"e{i}": EngineInstall(True, "", "1:1") for i in range(4)}
    book.accept({e: "1:1" for e in engines})
    seen = [book.due(engines)[0] for _ in range(4)]
    assert sorted(e for (e,) in seen) == sorted(engines)


# ------------------------------------------------------------------ the sequences

def test_fixed_sequences_exist_before_any_training_and_fit_the_length():
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    seqs = fixed_sequences(prompts, 4, max_len=6, continuation_tokens=32)
    assert seqs == [([1, 2, 3, 4], [5, 6]), ([5, 6, 7], [8, 9]), ([8, 9], [1, 2, 3, 4]), ([1, 2, 3, 4], [5, 6])]
    assert all(len(p) + len(r) <= 6 and r for p, r in seqs)
    assert fixed_sequences(prompts, 0, 6) == []
    with pytest.raises(ValueError, match="no room"):
        fixed_sequences([[1, 2, 3]], 1, max_len=3)
