"""The job wing: a learner job attached to a rollout pool.

The two loops (:mod:`.loop_async`, :mod:`.loop_sync`) read like the algorithm;
:class:`.learner_job.LearnerJob` holds one verb per line of them. Behind the
verbs: the prompt book (:mod:`.prompt_book`: ledger, buffer, back-off over the
prompt source), the parity rule (:mod:`.parity`), skipped steps (:mod:`.skips`),
the run log (:mod:`.run_log`), checkpoints (:mod:`.checkpoints`) and the
learner's Ray actors (:mod:`.learner_actor`). This wing imports nothing from
the pool wing: it reaches the pool only through the DeploymentHandle it is given.
"""
