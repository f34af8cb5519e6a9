"""The recipe's environment sections (``env.<name>.environment`` / ``url`` / ``serve``) and
``grpo.max_rollout_turns``: what loads, what is refused and with which words, and what an engine is built from."""
from __future__ import annotations

import pytest

from rollout.episodes.env_registry import EnvironmentSpec, build_environment, load_environment_class, tool_schemas
from services.pool.engine_actor import EngineSpec, RewardEnvSpec, environment_spec
from services.recipe.config import RecipeError, load_recipe


def test_a_multi_turn_section_becomes_the_engines_environment_spec():
    r = load_recipe(None, ["env.calc.environment=tool_calls", "env.calc.tools=[calculator]",
                           "env.calc.max_tool_calls=3", "env.calc.reward_functions=[{name: math_exact}]",
                           "grpo.max_rollout_turns=4", "env.calc.truncated_reward=null"])
    spec = EngineSpec.from_recipe(r, "e0", "/model")
    assert spec.max_rollout_turns == 4
    assert spec.environment == EnvironmentSpec("calc", "tool_calls", {}, None, ("calculator",), 3, 30.0, 64, 2, 0.5,
                                               None)
    assert spec.reward_env is not None and spec.reward_env.functions == (("math_exact", 1.0),)


def test_an_environment_that_scores_itself_starts_no_reward_workers():
    r = load_recipe(None, ["env.relay.environment=letter_relay", "grpo.max_rollout_turns=3"])
    assert RewardEnvSpec.from_recipe(r) is None
    assert environment_spec(r) is not None


def test_a_single_turn_section_has_no_environment():
    r = load_recipe(None, ["env.math.reward_functions=[{name: math_exact}]"])
    assert environment_spec(r) is None
    assert EngineSpec.from_recipe(r, "e0", "/model").max_rollout_turns == 1


def test_a_served_environment_needs_the_pools_url():
    r = load_recipe(None, ["env.game.environment=my_pkg.game:Game", "env.game.serve=true"])
    with pytest.raises(ValueError, match="has not deployed"):
        environment_spec(r)
    spec = environment_spec(r, "http://127.0.0.1:8000/env/game")
    assert spec is not None and spec.url == "http://127.0.0.1:8000/env/game" and spec.environment is None


HTTP = "policy.generation.vllm_cfg.expose_http_server"


@pytest.mark.parametrize("overrides, words", [
    (["grpo.max_rollout_turns=3"], "grpo.max_rollout_turns (3) > 1 needs an environment"),
    (["grpo.max_rollout_turns=0"], "greater than or equal to 1"),
    (["env.x.environment=tool_calls"], "needs at least one of tools"),
    (["env.x.tools=[calculator]"], "shown in the prompt and run by environment: tool_calls or a server"),
    (["env.x.tools=[search]", "env.x.environment=tool_calls"], "calculator"),
    (["env.x.url=http://h:1", "env.x.environment=tool_calls", "env.x.tools=[calculator]"], "excludes environment"),
    (["env.x.url=ftp://h"], "expected http:// or https://"),
    (["env.x.serve=true"], "serve: true needs environment"),
    (["env.x.serve=true", "env.x.environment=tool_calls", "env.x.tools=[calculator]"], "runs in the engines"),
    (["env.x.step_timeout_s=0", "env.x.url=http://h:1"], "greater than 0"),
    (["env.x.agent=a.py:run", "env.x.environment=letter_relay"], "excludes environment, url and serve"),
    (["env.x.agent=http://h:1", "env.x.url=http://h:2"], "excludes environment, url and serve"),
    (["env.x.agent=a.py:run", "env.x.tools=[calculator]"], "an agent brings its own tools"),
    (["env.x.agent=just_a_name", f"{HTTP}=true"], "expected 'package.module:function'"),
    ([f"{HTTP}=true", "env.x.agent=a.py:run", "env.x.agent_base_url=pool:8000"], "expected http://host:port"),
    (["env.x.agent=a.py:run"], "env.x.agent: the agent calls the pool's OpenAI endpoint; set policy.generation"),
    ([f"{HTTP}=true", "env.x.agent=a.py:run", "env.x.agent_timeout_s=0"], "greater than 0"),
])
def test_bad_environment_sections_are_refused_with_the_key(overrides, words):
    with pytest.raises(RecipeError) as err:
        load_recipe(None, overrides)
    assert words in str(err.value)


def test_an_agent_section_becomes_the_engines_agent_spec():
    from services.pool.agent_driver import AgentSpec, PoolAccess

    r = load_recipe(None, [f"{HTTP}=true", "env.calc.agent=my_pkg.agents:run", "env.calc.agent_timeout_s=90",
                           "env.calc.max_concurrent_calls=5", "grpo.max_rollout_turns=4"])
    access = PoolAccess("http://127.0.0.1:8123/pool/", "secret")
    spec = EngineSpec.from_recipe(r, "e0", "/model", access=access)
    assert spec.agent == AgentSpec("calc", "my_pkg.agents:run", "http://127.0.0.1:8123/pool", "secret",
                                   r.policy.model_name, 90.0, 5, 2, 0.5)
    assert spec.environment is None and spec.reward_env is None  # the agent plays and scores the episodes
    with pytest.raises(ValueError, match="did not say where agents reach it"):
        EngineSpec.from_recipe(r, "e0", "/model")
    r = load_recipe(None, [f"{HTTP}=true", "env.calc.agent=http://agents:9/x", "env.calc.agent_base_url=http://h:1/"])
    agent = EngineSpec.from_recipe(r, "e0", "/model", access=access).agent
    assert agent is not None and agent.is_server and agent.base_url == "http://h:1"
    assert EngineSpec.from_recipe(load_recipe(None, []), "e0", "/model", access=access).agent is None


def test_registry_builds_tool_calls_and_refuses_unknown_classes():
    spec = EnvironmentSpec("calc", "tool_calls", tools=("calculator",), max_tool_calls=2)
    env = build_environment(spec, reward_fn=lambda batch: [1.0] * len(batch), reward_timeout_s=5.0)
    assert env.name == "calc" and env.timeout_s == 30.0
    assert [s["function"]["name"] for s in tool_schemas(["calculator"])] == ["calculator"]
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.mod': ModuleNotFoundError"):
        load_environment_class("no_such_pkg.mod:Env")
    with pytest.raises(ValueError, match="has no class 'Nope'"):
        load_environment_class("rollout.episodes.environment:Nope")
    with pytest.raises(ValueError, match="expected 'tool_calls'"):
        load_environment_class("nothing")
    bad = EnvironmentSpec("g", "rollout.episodes.environment:SingleTurnEnvironment", kwargs={"no_such_kwarg": 1})
    with pytest.raises(ValueError, match=r"env\.g: rollout\.episodes\.environment:SingleTurnEnvironment\(\*\*environment_kw"):
        build_environment(bad, reward_fn=lambda b: [0.0] * len(b), reward_timeout_s=5.0)


def test_a_server_call_deadline_covers_every_attempt_and_back_off():
    spec = EnvironmentSpec("s", url="http://h:1", step_timeout_s=2.0, max_retries=2, retry_backoff_s=0.5)
    assert spec.call_deadline_s > 2.0 * 3 + 0.5 + 1.0
    with pytest.raises(ValueError, match="exactly one of environment and url"):
        EnvironmentSpec("s")


def test_the_complete_example_recipe_of_the_docs_loads_as_written(tmp_path):
    import re
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    text = (root / "docs/environments.md").read_text()
    block = re.search(r"```yaml\n(# recipes/guess.yaml\n.*?)```", text, re.S)
    assert block, "docs/environments.md: no recipes/guess.yaml block"
    shutil.copy(root / "recipes/tiny-cpu.yaml", tmp_path / "tiny-cpu.yaml")
    (tmp_path / "guess.yaml").write_text(block.group(1))
    r = load_recipe(str(tmp_path / "guess.yaml"))
    spec = environment_spec(r)
    assert spec is not None and spec.environment == "/srv/envs/guess.py:GuessNumber" and r.grpo.max_rollout_turns == 3
    served = load_recipe(str(tmp_path / "guess.yaml"), ["env.guess.environment=null",
                                                        "env.guess.url=http://127.0.0.1:8300"])
    assert environment_spec(served) == EnvironmentSpec("guess", url="http://127.0.0.1:8300")


def test_a_served_environment_is_deployed_first_and_the_engines_get_its_url(monkeypatch):
    import services.pool as pool_api
    from services.pool import env_server

    deployed: list[tuple] = []

    def fake_deploy(name, path, kwargs, num_replicas=1, **_):
        deployed.append((name, path, kwargs, num_replicas))
        return f"http://127.0.0.1:8123/env/{name}"

    monkeypatch.setattr(env_server, "deploy_environment", fake_deploy)
    r = load_recipe(None, ["env.game.environment=my_pkg.game:Game", "env.game.serve=true", "env.game.serve_replicas=3",
                           "env.game.environment_kwargs={level: 2}", "rollout_pool.name=p1"])
    served = pool_api._with_served_environment(r)
    assert deployed == [("p1", "my_pkg.game:Game", {"level": 2}, 3)]
    assert r.env.named["game"].serve and r.env.named["game"].url is None  # the user's recipe is left as it was
    spec = environment_spec(served)
    assert spec == EnvironmentSpec("game", url="http://127.0.0.1:8123/env/p1", kwargs={"level": 2})
    plain = load_recipe(None, [])
    assert pool_api._with_served_environment(plain) is plain and len(deployed) == 1  # nothing to serve
