"""A Ray actor hosting one :class:`rollout.engine.RolloutEngine`, built from an :class:`EngineSpec`.

The pool creates ``num_engines`` of these (named, detached, restarted by Ray if
their process dies). ``generate`` streams each finished group of a batch into
the learner's trajectory channel and returns once every prompt was delivered or
given up on (a prompt whose generation failed is reported as a
``ControlMessage(action="error")``; one the channel did not take in time comes
back as *undelivered*). If the vLLM engine core dies inside the live actor,
nothing is reported failed: ``generate`` hands the pending prompts back for
re-queueing, installs raise :class:`~rollout.liveness.EngineDead`, and ``start``
starts a fresh vLLM engine in the same process (a new *incarnation*). The pool
keeps each call's reference as the batch's completion signal. Faults:
docs/reliability.md.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from protocol import ControlMessage, PromptRequest, WeightBucket, WeightManifest, decode, encode
from protocol.pool_replies import EvaluationReply, FailedPrompt, UndeliveredPrompt
from rollout.config import GenerationConfig
from rollout.liveness import EngineDead
from services.models.files import ModelFiles
from services.pool.engine_replies import BatchReport, ChatCounters, EngineHealth, EngineStarted, EngineStats
from services.pool.loop_lag import LoopLag
from services.refit.result import GroupInstall

if TYPE_CHECKING:
    from rollout.episodes.env_registry import EnvironmentSpec
    from services.pool.agent_driver import AgentDriver, AgentSpec, PoolAccess
    from services.recipe.config import Recipe

log = logging.getLogger("inflight.engine")


@dataclass(frozen=True)
class RewardEnvSpec:
    """The named reward environment an engine scores with (``env.<data.env_name>``), as plain values."""

    name: str
    functions: tuple[tuple[str, float], ...]
    """(reward function name, weight) for each of ``reward_functions``."""
    num_workers: int
    timeout_s: float

    @classmethod
    def from_recipe(cls, recipe: Recipe) -> RewardEnvSpec | None:
        """``env.<data.env_name>`` when ``data.env_name`` is set, else None (the single ``env.reward_fn``)."""
        name = recipe.data.env_name
        if name is None:
            return None
        section = recipe.env.named.get(name)
        if section is not None and (section.agent or section.episodic and section.environment != "tool_calls"):
            return None  # the environment (or agent) gives the reward itself; no reward workers to start
        named = recipe.env.named
        if name not in named:
            raise ValueError(f"data.env_name ({name!r}): no section env.{name} (have {sorted(named)})")
        e = named[name]
        return cls(name, tuple((f.name, f.weight) for f in e.reward_functions), e.num_workers, e.timeout_s)

    def build(self):
        """A :class:`rollout.rewards.reward_env.RewardEnv` with its own worker processes."""
        from rollout.rewards.reward_env import reward_env_from_config

        return reward_env_from_config(self.name, self.functions, self.num_workers, self.timeout_s)


def environment_spec(recipe: Recipe, served_url: str | None = None) -> EnvironmentSpec | None:
    """The environment that plays episodes for ``data.env_name`` (``env.<name>.environment`` or ``url``), or
    None (single turn). ``served_url``: where the pool deployed the section's ``serve: true`` environment."""
    from rollout.episodes.env_registry import EnvironmentSpec

    name = recipe.data.env_name
    if name is None or not (e := recipe.env.named[name]).episodic:
        return None
    if e.serve and served_url is None:
        raise ValueError(f"env.{name}.serve: the pool has not deployed the environment (no URL yet)")
    url = served_url if e.serve else e.url
    return EnvironmentSpec(name, None if url is not None else e.environment, dict(e.environment_kwargs), url,
                           tuple(e.tools), e.max_tool_calls, e.step_timeout_s, e.max_concurrent_calls, e.max_retries,
                           e.retry_backoff_s, e.truncated_reward)


@dataclass(frozen=True)
class EngineSpec:
    """What one engine actor is built from."""

    engine_id: str
    model_path: str | ModelFiles
    """A model directory, or :class:`~services.models.files.ModelFiles` (shipped if this node lacks it)."""
    generation: GenerationConfig
    max_model_len: int
    reward_fn: str
    reward_timeout_s: float
    recompute_kv: bool
    """Recompute the KV cache of running requests after an in-flight install."""
    in_flight: bool
    """Install pushes while requests run (pause, install, resume) instead of between batches."""
    channel_timeout_s: float
    """Longest a send waits for room in the learner's channel."""
    reward_env: RewardEnvSpec | None = None
    """The named reward environment (several weighted functions in worker processes); None: ``reward_fn``."""
    environment: EnvironmentSpec | None = None
    """The environment that plays multi-turn episodes (its final answers scored by ``reward_env``); None:
    one sampled answer per prompt."""
    max_rollout_turns: int = 1
    """``grpo.max_rollout_turns``."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """``policy.tokenizer.chat_template_kwargs``: environment turns are rendered with them."""
    model_name: str = ""
    """``policy.model_name``: the model ``/v1/chat/completions`` serves, by the name ``/v1/models`` gives."""
    agent: AgentSpec | None = None
    """The agent that plays each sample through the pool's OpenAI endpoint (``env.<name>.agent``); None: the
    engine samples (and ``environment`` plays) the episodes itself."""

    @classmethod
    def from_recipe(cls, recipe: Recipe, engine_id: str, model_path: str | ModelFiles,
                    served_env_url: str | None = None, access: PoolAccess | None = None) -> EngineSpec:
        from services.pool.agent_driver import AgentSpec

        a = recipe.grpo.async_grpo
        return cls(engine_id, model_path, recipe.policy.generation, recipe.policy.max_total_sequence_length,
                   recipe.env.reward_fn, recipe.env.reward_timeout_s, a.recompute_kv_cache_after_weight_updates,
                   a.in_flight_weight_updates, recipe.rollout_pool.channel_send_timeout_s,
                   RewardEnvSpec.from_recipe(recipe), environment_spec(recipe, served_env_url),
                   recipe.grpo.max_rollout_turns, dict(recipe.policy.tokenizer.chat_template_kwargs),
                   recipe.policy.model_name, AgentSpec.from_recipe(recipe, access))


def _engine_with_environment(spec: EngineSpec, new_engine, get_reward_fn):
    """A fresh engine with its reward (``env.<name>``'s workers, or ``env.reward_fn``) and, for multi-turn
    sections, the environment that plays its episodes."""
    reward_fn = spec.reward_env.build() if spec.reward_env is not None else get_reward_fn(spec.reward_fn)
    if spec.environment is None:
        return new_engine(reward_fn=reward_fn)
    from rollout.episodes.env_registry import build_environment

    timeout_s = spec.reward_env.timeout_s if spec.reward_env is not None else spec.reward_timeout_s
    return new_engine(reward_fn=reward_fn, environment=build_environment(spec.environment, reward_fn, timeout_s),
                      max_rollout_turns=spec.max_rollout_turns, truncated_reward=spec.environment.truncated_reward)


class EngineActor:
    def __init__(self, spec: EngineSpec):
        from rollout.engine import RolloutEngine
        from rollout.rewards.registry import get_reward_fn
        from services.models.files import ensure_local

        self.engine_id = spec.engine_id
        model_path = ensure_local(spec.model_path)  # a ModelFiles: shipped here if this node lacks the directory
        new_engine = functools.partial(
            RolloutEngine, model_path, spec.generation, spec.max_model_len, engine_id=spec.engine_id,
            recompute_kv_cache_after_weight_updates=spec.recompute_kv, in_flight_weight_updates=spec.in_flight,
            reward_timeout_s=spec.reward_timeout_s, chat_template_kwargs=spec.chat_template_kwargs)
        # each vLLM incarnation gets its own reward environment (its workers stop with that engine's shutdown)
        self._new_engine = lambda: _engine_with_environment(spec, new_engine, get_reward_fn)
        self.engine = self._new_engine()
        self.channel_timeout_s = spec.channel_timeout_s
        self.spec = spec
        self._chat: tuple[Any, Any] | None = None  # (the RolloutEngine, its ChatServer)
        self._agents: AgentDriver | None = None  # built at the first batch of an agent section
        self._tasks: set[asyncio.Task] = set()
        self._started = False
        self._starts = 0
        self._start_lock = asyncio.Lock()
        self._send_failures = 0
        self._loop_lag = LoopLag()  # how late this actor's event loop runs (reported with each install)
        self.pid = os.getpid()

    @property
    def incarnation(self) -> str:
        """``<pid>.<vLLM starts>``: changes when the process or its vLLM engine restarts (the pool's weight
        group is made of incarnations: a vLLM restarted in the same process is not in it)."""
        return f"{self.pid}.{self._starts}"

    async def start(self) -> EngineStarted:
        """Start the vLLM engine. If the one started before has died, shut it down first (its /dev/shm
        segments are freed) and start a fresh one: it serves the model on disk (``version`` 0, no push)."""
        self._loop_lag.start()
        async with self._start_lock:
            if self._started and (reason := self.engine.dead_reason()):
                log.warning("engine %s: %s; restarting vLLM in this process", self.engine_id, reason)
                dead, self.engine, self._started = self.engine, self._new_engine(), False
                try:
                    await asyncio.wait_for(dead.shutdown(), 120)
                except Exception:  # a dead engine's shutdown must not stop the restart
                    log.exception("engine %s: shutting the dead vLLM engine down failed", self.engine_id)
            if not self._started:
                await self.engine.start()
                self._started, self._starts = True, self._starts + 1
        return EngineStarted(self.engine_id, self.engine.version, self.pid, self.incarnation)

    async def health(self) -> EngineHealth:
        """``ok`` only while vLLM itself can serve (its engine core alive), with the reason otherwise;
        ``synced``: a push was installed since this vLLM engine started."""
        error = self.engine.dead_reason() if self._started else "vLLM engine not started"
        return EngineHealth(self.engine_id, ok=not error, error=error, version=self.engine.version,
                            synced=self.engine.counters().installs.refits > 0, running_batches=len(self._tasks),
                            pid=self.pid, incarnation=self.incarnation)

    async def generate(self, prompt_bytes: list[bytes], group_size: int, channel) -> BatchReport:
        """Generate one group per prompt, streaming each into ``channel``; returns once every prompt has been
        delivered (as a group or an error report) or given up on (:class:`BatchReport`: the prompts whose
        message the channel did not take in time are ``undelivered``). If the vLLM engine core dies meanwhile,
        the prompts not yet delivered are neither reported nor failed: ``engine_dead`` gives the reason and
        ``requeue`` their indices in ``prompt_bytes``, for the pool."""
        requests = [cast(PromptRequest, decode(b, expect=PromptRequest)) for b in prompt_bytes]
        task = asyncio.get_running_loop().create_task(self._run(requests, group_size, channel))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        undelivered, pending, dead = await task
        return BatchReport(len(requests), undelivered, dead,
                           [i for i, r in enumerate(requests) if dead and r.prompt_id in pending])

    async def _run(self, requests: list[PromptRequest], group_size: int,
                   channel) -> tuple[list[UndeliveredPrompt], dict[str, PromptRequest], str]:
        """(undelivered, pending, engine_dead): see :meth:`generate`."""
        pending = {r.prompt_id: r for r in requests}
        undelivered: list[UndeliveredPrompt] = []
        try:
            async for group in self._groups(requests, group_size):
                pending.pop(group.prompt_id, None)
                failure = await self._send(channel, encode(group))
                if failure:
                    undelivered.append(UndeliveredPrompt(group.prompt_id, group.scheduled_step, failure))
        except EngineDead as exc:  # nothing reported: the pool re-queues the pending prompts
            log.warning("engine %s: %s; %d prompts of the batch go back to the pool", self.engine_id, exc,
                        len(pending))
            return undelivered, pending, str(exc)[:300]
        except Exception as exc:  # reported per prompt below
            log.exception("engine %s: generation failed", self.engine_id)
            for pid, req in pending.items():
                msg = ControlMessage("error", {"prompt_id": pid, "scheduled_step": req.scheduled_step,
                                              "engine_id": self.engine_id,
                                              "reason": f"generation failed: {type(exc).__name__}: {exc}"[:500]},
                                     time.time())
                failure = await self._send(channel, encode(msg))
                if failure:
                    undelivered.append(UndeliveredPrompt(pid, req.scheduled_step,
                                                         f"{msg.payload['reason']}; then {failure}"[:500]))
        return undelivered, pending, ""

    def _groups(self, requests: list[PromptRequest], group_size: int):
        """The groups of ``requests`` as they complete: played by the section's agent, or by the engine."""
        agents = self._agent_driver()
        return self.engine.generate(requests, group_size) if agents is None else agents.generate(requests, group_size)

    def _agent_driver(self) -> AgentDriver | None:
        """The driver of the section's agent (made at first use); None without one."""
        if self.spec.agent is not None and self._agents is None:
            from services.pool.agent_driver import AgentDriver

            self._agents = AgentDriver(self.spec.agent, self.engine_id, self._take_session_here,
                                       lambda: self.engine.vocab_size)
        return self._agents

    async def _send(self, channel, data: bytes) -> str:
        """Send one message; '' if it was delivered, else the reason it was not (counted, never raised)."""
        try:
            await channel.send_async(data, self.channel_timeout_s)
            return ""
        except Exception as exc:  # noqa: BLE001 - reported to the pool as undelivered; the engine goes on
            self._send_failures += 1
            log.warning("engine %s: could not deliver a message to channel %s: %s", self.engine_id, channel.name,
                        exc)
            return f"channel send failed: {type(exc).__name__}: {exc}"[:300]

    async def evaluate(self, prompt_bytes: list[bytes], group_size: int, temperature: float) -> EvaluationReply:
        """Validation: ``group_size`` answers per prompt at ``temperature`` (0: greedy), scored like training
        groups and returned to the caller, never sent to a channel (``failed``: prompts whose group could not be
        made)."""
        requests = [cast(PromptRequest, decode(b, expect=PromptRequest)) for b in prompt_bytes]
        agents = self._agent_driver()  # an agent samples at its own temperature
        work = self.engine.evaluate(requests, group_size, temperature) if agents is None else \
            agents.evaluate(requests, group_size)
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        out = EvaluationReply()
        for req, res in zip(requests, await task, strict=True):
            if isinstance(res, BaseException):
                out.failed.append(FailedPrompt(req.prompt_id, f"{type(res).__name__}: {res}"[:300]))
            else:
                out.groups.append(encode(res))
        return out

    async def chat_completion(self, body: bytes, session: str | None = None):
        """One ``/v1/chat/completions`` body answered by vLLM's chat serving on this engine (a Ray streaming
        generator: a :class:`~services.pool.openai_engine.ChatHead`, then the JSON body or the SSE chunks); in a
        rollout ``session``, its tokens are kept for :meth:`take_session`."""
        async for item in self._chat_server().complete(body, session):
            yield item

    async def take_session(self, session: str) -> list:
        """The :class:`~services.pool.token_capture.CapturedCompletion` s this engine served in ``session``."""
        return self._take_session_here(session)

    def _take_session_here(self, session: str) -> list:
        return [] if self._chat is None else self._chat[1].take_session(session)

    def _chat_server(self):
        """The chat server of the running vLLM engine (built at the first request, again after a restart)."""
        from services.pool.openai_engine import ChatServer

        engine = self.engine
        if self._chat is None or self._chat[0] is not engine:
            vllm_cfg = self.spec.generation.vllm_cfg
            self._chat = (engine, ChatServer(engine.async_llm(), engine.model_path,
                                             self.spec.model_name or engine.model_path,
                                             vllm_cfg.http_server_serving_chat_kwargs,
                                             self.spec.chat_template_kwargs, lambda: engine.version))
        return self._chat[1]

    async def install(self, manifest_bytes: bytes, bucket_refs: list, reset: bool = False) -> int:
        """Install an object-store push (verified first; atomic); returns the version now served."""
        manifest = cast(WeightManifest, decode(manifest_bytes, expect=WeightManifest))
        datas = await asyncio.gather(*bucket_refs)
        buckets = [cast(WeightBucket, decode(d, expect=WeightBucket)) for d in datas]
        return await self._unless_dead(self.engine.install(manifest, buckets, reset=reset))

    async def _unless_dead(self, call):
        """Await ``call``; a failure of an engine whose core died is raised as :class:`EngineDead` (the pool
        then marks it down and restarts it instead of rejecting a push)."""
        try:
            return await call
        except EngineDead:
            raise
        except Exception as exc:
            if reason := self.engine.dead_reason():
                raise EngineDead(f"rollout engine {self.engine_id}: {reason}: {type(exc).__name__}") from exc
            raise

    async def weight_group_members(self) -> int:
        return self.engine.weight_group_members

    async def join_weight_group(self, host: str, port: int, rank_base: int, world_size: int,
                                timeout_s: float) -> list[int]:
        return await self._unless_dead(self.engine.join_weight_group(host, port, rank_base, world_size, timeout_s))

    async def install_from_group(self, reset: bool = False) -> GroupInstall:
        """Receive the weight group's next push and install it in flight."""
        started = time.perf_counter()
        version = await self._unless_dead(self.engine.install_from_group(reset=reset))
        return self._installed(version, started)

    async def install_ipc(self, manifest_bytes: bytes, shares: list, reset: bool = False) -> GroupInstall:
        """Map a colocated learner's buckets through their CUDA IPC ``shares`` and install them in flight."""
        started = time.perf_counter()
        manifest = cast(WeightManifest, decode(manifest_bytes, expect=WeightManifest))
        version = await self._unless_dead(self.engine.install_ipc(manifest, shares, reset=reset))
        return self._installed(version, started)

    def _installed(self, version: int, started: float) -> GroupInstall:
        """The answer to an install call that began at ``started``: the engine's install counters, the call's
        time here and how late this actor's loop ran since the previous install."""
        return GroupInstall.of(version, self.engine.counters().installs, time.perf_counter() - started,
                               self._loop_lag.take())

    async def gpu_uuids(self) -> list[str]:
        """The UUID of each vLLM worker's GPU ('' on CPU)."""
        return await self._unless_dead(self.engine.gpu_uuids())

    async def logprobs_of(self, prompt_ids: list[list[int]], response_ids: list[list[int]],
                          image_prompts: list[bytes] | None = None) -> list[list[float]]:
        images = None if image_prompts is None else \
            [cast(PromptRequest, decode(b, expect=PromptRequest)).images for b in image_prompts]
        out = await self.engine.logprobs_of(prompt_ids, response_ids, images)
        return [a.tolist() for a in out]

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def stats(self) -> EngineStats:
        """The rollout engine's counters (the agent driver's environment counters when agents play), the chat
        serving's and the actor's own (:class:`EngineStats`)."""
        counters = self.engine.counters()
        if self._agents is not None:
            counters = replace(counters, env=self._agents.env_counters())
        chat = None if self._chat is None else ChatCounters(self._chat[1].answers_spliced,
                                                            self._chat[1].splice_refused)
        return EngineStats(self.engine_id, self.engine.version, self.pid, self.incarnation,
                           running_batches=len(self._tasks), channel_send_failures=self._send_failures,
                           counters=counters, chat=chat)

    async def shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._agents is not None:
            await self._agents.aclose()
        await self.engine.shutdown()
