"""The in-flight install: a weight push verified, staged and installed into a serving vLLM engine.

- :mod:`rollout.install.installer` -- :class:`~rollout.install.installer.Installer`, one install at a time;
- :mod:`rollout.install.weight_receiver` -- verify a push and stage it in shared memory;
- :mod:`rollout.install.collective_receiver` / :mod:`rollout.install.ipc_receiver` -- the vLLM worker extension
  that receives a collective push, and the CUDA IPC views of a colocated learner's buffers;
- :mod:`rollout.install.direct_load` / :mod:`rollout.install.cpu_reload` -- plain ``load_weights`` once proven
  equal to ``reload_weights``, and the CPU kernels rebuilt after a reload.
"""
