"""Rewards: reward functions, their registry and bounded scorer, and weighted rewards in worker processes.

- :mod:`rollout.rewards.registry` -- the named functions (``get_reward_fn``), ``module:function`` loading,
  :func:`~rollout.rewards.registry.score_group` under a deadline;
- :mod:`rollout.rewards.reward_types` -- ``RewardInput``, ``RewardFailure``, ``RewardFn``;
- :mod:`rollout.rewards.reward_fns` / :mod:`rollout.rewards.math_verify_reward` /
  :mod:`rollout.rewards.tag_rewards` -- the shipped functions;
- :mod:`rollout.rewards.reward_env` / :mod:`rollout.rewards.reward_workers` -- several weighted functions in
  worker processes (``env.<name>.reward_functions``).
"""
