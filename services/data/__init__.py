"""The data wing: what a run's prompts are made of, prepared on the driver (the engines never import it).

- :mod:`services.data.dataset` / :mod:`services.data.data_errors` -- the rows of the data files and the Hub, and
  where a bad file is bad;
- :mod:`services.data.prompt_source` / :mod:`services.data.prompt_template` -- rows into prompts through the chat
  template, the validation prompts;
- :mod:`services.data.tasks` -- the built-in prompt sets (``data.dataset_name``);
- :mod:`services.data.images` / :mod:`services.data.image_refs` / :mod:`services.data.image_pool` /
  :mod:`services.data.image_prompts` -- a row's images, read within bounds, prepared in worker processes, shown in
  the prompt; :mod:`services.data.vision_rules` / :mod:`services.data.omni_images` -- the model family's image
  rules (Qwen2-VL's, Nano-Omni's);
- :mod:`services.data.learner_images` -- the learner job's side of the images.

The job wing and the pool wing may import it; it imports neither.
"""
