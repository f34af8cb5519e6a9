"""Environments and multi-turn episodes, token-in/token-out (docs/environments.md).

- :mod:`rollout.episodes.environment` -- ``Message``, ``Turn``, ``EnvStep``, the environment protocols, ``as_async``;
- :mod:`rollout.episodes.episode` -- a group's episodes played in the engine;
- :mod:`rollout.episodes.chat_turns` -- environment messages rendered once with the chat template, as ids;
- :mod:`rollout.episodes.tool_calls` / :mod:`rollout.episodes.calculator` -- tool calls and the calculator tool;
- :mod:`rollout.episodes.env_registry` / :mod:`rollout.episodes.env_http` -- what a recipe's ``env.<name>``
  builds, and the HTTP client of an environment server;
- :mod:`rollout.episodes.envs` -- the example environments.
"""
