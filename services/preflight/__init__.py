"""Checks before anything starts (``inflight validate``, ``run``, ``pool deploy``, ``learner attach``): the
recipe's data, prompt files, rewards, environment, model and engine options, every problem at once."""
