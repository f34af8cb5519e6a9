"""Rollout side of Inflight: vLLM engines that sample scored groups and install weight pushes in flight.

- :mod:`rollout.engine` -- :class:`~rollout.engine.RolloutEngine`, the facade around vLLM's ``AsyncLLM``;
- :mod:`rollout.sampling` / :mod:`rollout.labels` -- its groups, version labels;
- :mod:`rollout.options` -- recipe ``vllm_cfg`` -> engine arguments, checked against the installed vLLM;
- its wings, which never import the engine core back: :mod:`rollout.install` (the in-flight install: verify a
  weight push, stage it, install it), :mod:`rollout.episodes` (environments and multi-turn episodes),
  :mod:`rollout.rewards` (reward functions, their registry, worker processes).

This package speaks only :mod:`protocol`; it never imports ``learner`` or ``services`` (the prompts it samples
are made on the driver, in ``services/data/``).
Importing it does not import vLLM.
"""
