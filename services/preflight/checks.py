"""What a recipe points to, checked before anything starts: ``inflight validate`` and the first thing ``run``,
``pool deploy`` and ``learner attach`` do (before Ray or vLLM start, which takes a minute or more).

:func:`check_recipe` looks at everything at once and returns every problem, one :class:`Problem` each (the key,
its value, what was found and what was expected): the data files or globs (they exist, load, have the columns of
``data.input_key`` / ``output_key`` / ``messages_key``, and their first rows map to a prompt and an answer), the
prompt and system-prompt files, the reward functions and the environment class (imported: a recipe names code,
run as a script would be, docs/security.md), and the model directory (``config.json`` the learner supports, a
tokenizer beside it) or ``tiny://`` name. The data are read with the run's own reader
(:func:`services.data.dataset.load_rows`), so what passes here is what the run reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.models.variant import TOKENIZER_MARKERS, has_tokenizer
from services.preflight.engine_checks import check_vllm_kwargs
from services.recipe.config import PolicyConfig, Recipe, RecipeError
from services.recipe.data import HUB_PREFIX

FIRST_ROWS = 8
"""Rows of each data file mapped to a prompt and an answer (the run maps every row as it draws it)."""


@dataclass(frozen=True)
class Problem:
    """One thing a recipe points to that cannot be used."""

    key: str
    """The recipe key, dotted (``data.train_data_path``)."""
    value: str
    """Its value, as the recipe gives it."""
    why: str
    """What was found and what was expected."""

    def line(self) -> str:
        return f"{self.key} {self.value!r}: {self.why}"


@dataclass
class RecipeChecks:
    """What :func:`check_recipe` found."""

    problems: list[Problem] = field(default_factory=list)
    """Each a reason the run would fail; empty: everything the recipe points to is usable."""
    notes: list[str] = field(default_factory=list)
    """One line each on what the run will use (the model's family, the environment) or could not check here."""

    def add(self, key: str, value: str, error: BaseException | str, what: str = "") -> None:
        """A problem from an error whose message may already begin with the key (or ``what``) and the value, as
        the readers' own do."""
        why = str(error) if isinstance(error, str) else _message(error)
        for prefix in (f"{key}: {value!r}: ", f"{key} {value!r}: ", f"{what} {value!r}: ", f"{key}: "):
            if why.startswith(prefix):
                why = why[len(prefix):]
                break
        self.problems.append(Problem(key, value, why))

    def raise_problems(self) -> None:
        """Raise :class:`RecipeProblems` (every problem, one line each) if there is any."""
        if self.problems:
            raise RecipeProblems(self.problems)


class RecipeProblems(RecipeError):
    """Every problem :func:`check_recipe` found; the CLI prints one line each and exits 2."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        lines = [p.line() for p in problems]
        text = lines[0] if len(lines) == 1 else \
            f"{len(lines)} problems with what the recipe points to:\n  " + "\n  ".join(lines)
        super().__init__("", text)


def check_recipe(recipe: Recipe, *, here: bool) -> RecipeChecks:
    """Every problem with what ``recipe`` points to. ``here``: the run starts on this machine, so a
    ``policy.model_name`` that is no directory here is a problem; otherwise (``validate``, perhaps of a recipe for
    another machine) a name that may be a hub id or a path elsewhere is a note."""
    checks = RecipeChecks()
    _check_model(recipe.policy, here, checks)
    _check_prompt_files(recipe, checks)
    _check_data(recipe, checks)
    _check_scoring(recipe, checks)
    check_vllm_kwargs(recipe, checks)
    return checks


def _message(error: BaseException) -> str:
    """An error as one line: its message (a ``FileNotFoundError``'s is the reader's own), else its type."""
    text = " ".join(str(error).split())
    return text if isinstance(error, (ValueError, FileNotFoundError)) and text else \
        f"{type(error).__name__}: {text}" if text else type(error).__name__


def _check_model(policy: PolicyConfig, here: bool, checks: RecipeChecks) -> None:
    from services.models.source import check_model

    key, name = "policy.model_name", policy.model_name
    path = Path(name).expanduser()
    tokenizer = policy.tokenizer.name
    own_tokenizer = tokenizer is None or Path(tokenizer).expanduser().resolve() == path.resolve()
    if name.startswith("tiny://") or (path / "config.json").is_file():
        try:
            checks.notes.append(f"{key}: {check_model(name)}")
        except ValueError as err:
            checks.add(key, name, err)
            return
        if own_tokenizer and not name.startswith("tiny://") and not has_tokenizer(path):
            checks.add(key, name, f"no tokenizer in the model directory (expected one of {list(TOKENIZER_MARKERS)}: "
                                  f"the engines and the learner load it from there; or set policy.tokenizer.name)")
    elif path.exists() or here:
        checks.add(key, name, "no model directory here (no config.json); expected a local Hugging Face checkpoint "
                              "directory (hub ids are not downloaded) or tiny://ARCH")
    else:
        checks.notes.append(f"{key}: {check_model(name)}")
    if tokenizer is not None and not own_tokenizer and not has_tokenizer(Path(tokenizer).expanduser()):
        if Path(tokenizer).expanduser().exists() or here:
            checks.add("policy.tokenizer.name", tokenizer, f"not a tokenizer directory here (expected one of "
                                                           f"{list(TOKENIZER_MARKERS)})")
        else:
            checks.notes.append(f"policy.tokenizer.name: not checked: {tokenizer!r} is not a directory on this "
                                f"machine; a run needs a local tokenizer directory")


def _check_prompt_files(recipe: Recipe, checks: RecipeChecks) -> None:
    from services.data.prompt_template import read_system_prompt, read_template

    d = recipe.data
    for key, path, read in (("data.prompt_file", d.prompt_file, read_template),
                            ("data.system_prompt_file", d.system_prompt_file, read_system_prompt)):
        if path is None:
            continue
        try:
            read(path)
        except (OSError, ValueError) as err:  # missing, unreadable, not UTF-8, empty, not one {}
            checks.add(key, path, err)


def _check_data(recipe: Recipe, checks: RecipeChecks) -> None:
    d = recipe.data
    for key, path, split in (("data.train_data_path", d.train_data_path, d.train_split),
                             ("data.val_data_path", d.val_data_path, d.val_split)):
        if path is None:
            continue
        if path.startswith(HUB_PREFIX):
            checks.notes.append(f"{key}: {path} is read from the Hugging Face Hub (or its cache) when the run "
                                f"starts; not checked here")
            continue
        _check_rows(recipe, key, path, split, checks)


def _check_rows(recipe: Recipe, key: str, path: str, split: str | None, checks: RecipeChecks) -> None:
    """The file(s) at ``path`` load, have the mapped columns, and their first rows map to a prompt and answer."""
    from services.data.dataset import InvalidRow, RowMapper, load_rows, split_rows

    d = recipe.data
    try:
        rows = load_rows(path, key, split=split)
        mapper = RowMapper.of(d)
        mapper.check_columns(rows, key)
    except Exception as err:  # noqa: BLE001 - any reader error (missing, unreadable, malformed) is the file's
        checks.add(key, path, err)
        return
    if len(rows) == 0:
        checks.add(key, path, "no rows")
        return
    if key == "data.train_data_path" and d.val_data_path is None and d.split_validation_size > 0:
        seed = recipe.grpo.seed if d.split_validation_seed is None else d.split_validation_seed
        try:
            split_rows(rows, d.split_validation_size, seed)
        except ValueError as err:
            checks.add("data.split_validation_size", str(d.split_validation_size), err)
    if d.skip_invalid_rows:
        return
    for i in range(min(FIRST_ROWS, len(rows))):
        try:
            mapper.map(rows.row(i))
        except InvalidRow as err:
            checks.add(key, path, f"{rows.where(i)}: {err} (set data.skip_invalid_rows: true to skip and count "
                                  f"such rows)")
            return
        except Exception as err:  # noqa: BLE001 - a row that cannot be read at all
            checks.add(key, path, f"{rows.where(i)}: {_message(err)}")
            return


def _check_scoring(recipe: Recipe, checks: RecipeChecks) -> None:
    """The reward functions that score the data and the environment class that plays its episodes import."""
    from rollout.episodes.env_registry import TOOL_CALLS, load_environment_class
    from rollout.rewards.registry import REWARD_FNS, get_reward_fn

    name = recipe.data.env_name
    if name is None:
        rewards = [("env.reward_fn", recipe.env.reward_fn)]
    else:
        e = recipe.env.named[name]
        rewards = [(f"env.{name}.reward_functions[{i}].name", f.name) for i, f in enumerate(e.reward_functions)]
    for key, fn in rewards:
        if fn in REWARD_FNS:
            continue
        try:
            get_reward_fn(fn)
        except ValueError as err:
            checks.add(key, fn, err, "reward function")
    if name is not None and (agent := recipe.env.named[name].agent) is not None:
        _check_agent(checks, name, agent)
    if name is None or not (e := recipe.env.named[name]).episodic:
        return
    turns = f"up to {recipe.grpo.max_rollout_turns} turns"
    if e.url is not None:
        checks.notes.append(f"env.{name}: environment server {e.url}, {turns}")
    elif e.environment == TOOL_CALLS:
        checks.notes.append(f"env.{name}: tool_calls with {', '.join(e.tools)}, {turns}")
    elif e.environment is not None:
        try:
            cls = load_environment_class(e.environment)
        except ValueError as err:
            checks.add(f"env.{name}.environment", e.environment, err, "environment")
            return
        served = ", served by Ray Serve" if e.serve else ""
        checks.notes.append(f"env.{name}: {cls.__module__}.{cls.__qualname__}{served}, {turns}")


def _check_agent(checks: RecipeChecks, name: str, agent: str) -> None:
    """An agent server is noted (it is called when episodes run); a coroutine is imported and its signature read."""
    if agent.startswith(("http://", "https://")):
        checks.notes.append(f"env.{name}: agent server {agent} (POST /run per episode)")
        return
    from services.pool.agent_server import load_agent

    try:
        fn = load_agent(agent, name)
    except ValueError as err:
        checks.add(f"env.{name}.agent", agent, err, "agent")
        return
    checks.notes.append(f"env.{name}: agent {agent} ({fn.__qualname__}) through the pool's OpenAI endpoint")
