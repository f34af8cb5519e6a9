"""Every recipe key is read by the code: a key that is accepted and does nothing misleads its user.

For each leaf field of :class:`services.recipe.config.Recipe` (and of the learner and rollout models it embeds),
the source of ``services/``, ``rollout/`` and ``learner/`` must read it, as an attribute access
``x.field`` or as the name in a string constant (``getattr(cfg, "field")``, a mapping key). Two reads do
not count: one inside a ``@model_validator`` / ``@field_validator`` (validating a key is not using it), and
``self.field`` outside a config model (``self.max_model_len`` of an engine is not the recipe's key). The
check is by name, so a name several models share (``enabled``, ``seed``) passes once any of them is read.
"""
from __future__ import annotations

import ast
import warnings
from pathlib import Path

from protocol.config_base import ConfigModel
from services.recipe.config import Recipe

ROOT = Path(__file__).resolve().parents[3]
SOURCE_DIRS = ("services", "rollout", "learner")
NOT_USES = {"services/recipe/docs.py", "services/recipe/rules.py"}
"""config_docs renders every field into docs/configuration.md, recipe_rules checks keys against each other (the
Recipe validator's body): showing or validating a key is not using it."""
ALLOWED_UNREAD: dict[str, str] = {
    "policy.generation.backend": "its type admits only 'vllm', the one backend, so it cannot change behaviour; "
                                 "kept so that NeMo-RL recipes, which name it, load unchanged",
    "policy.generation.vllm_kwargs.kernel_config": "handed whole to vLLM's engine arguments "
                                                   "(rollout.vllm_kwargs.merge_vllm_kwargs: model_dump)",
    "policy.generation.vllm_kwargs.skip_mm_profiling": "handed whole to vLLM's engine arguments "
                                                       "(rollout.vllm_kwargs.merge_vllm_kwargs: model_dump)",
}
"""Recipe keys no code reads, each with the reason it still belongs in a recipe."""
VALIDATORS = {"model_validator", "field_validator"}


def leaf_fields(model: type[ConfigModel] = Recipe, prefix: str = "") -> dict[str, str]:
    """Dotted key path -> field name, for every field that is not itself a config model."""
    out: dict[str, str] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, ConfigModel):
            out.update(leaf_fields(ann, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = name
    return out


def config_model_names(model: type[ConfigModel] = Recipe) -> set[str]:
    names = {model.__name__}
    for field in model.model_fields.values():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, ConfigModel):
            names |= config_model_names(ann)
    return names


def _is_validator(node: ast.AST) -> bool:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    for d in node.decorator_list:
        func = d.func if isinstance(d, ast.Call) else d
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name in VALIDATORS:
            return True
    return False


def names_read(tree: ast.AST, models: set[str]) -> set[str]:
    """Attribute names accessed and string constants in ``tree``, less validators and foreign ``self.x``."""
    found: set[str] = set()

    def visit(node: ast.AST, in_model: bool) -> None:
        if _is_validator(node):
            return
        if isinstance(node, ast.ClassDef):
            in_model = node.name in models
        if isinstance(node, ast.Attribute):
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if in_model or not on_self:
                found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
        for child in ast.iter_child_nodes(node):
            visit(child, in_model)

    visit(tree, False)
    return found


def source_reads() -> set[str]:
    models = config_model_names()
    found: set[str] = set()
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() not in NOT_USES:
                with warnings.catch_warnings():  # invalid escapes in docstrings are not this test's business
                    warnings.simplefilter("ignore", SyntaxWarning)
                    warnings.simplefilter("ignore", DeprecationWarning)
                    found |= names_read(ast.parse(path.read_text(), str(path)), models)
    return found


def test_the_walk_sees_nested_models():
    keys = leaf_fields()
    assert {"policy.megatron_cfg.optimizer.lr", "policy.generation.vllm_cfg.max_num_seqs",
            "loss_fn.ratio_clip_min", "grpo.async_grpo.enabled"} <= set(keys)


def test_validator_reads_and_foreign_self_do_not_count():
    src = ("class Engine:\n    def f(self):\n        return self.alpha\n"
           "class Recipe:\n    @model_validator(mode='after')\n    def _check(self):\n        return cfg.beta\n"
           "    def used(self):\n        return self.gamma\n"
           "def g(cfg):\n    return cfg.delta, getattr(cfg, 'epsilon')\n")
    assert names_read(ast.parse(src), {"Recipe"}) >= {"gamma", "delta", "epsilon"}
    assert not names_read(ast.parse(src), {"Recipe"}) & {"alpha", "beta"}


def test_every_recipe_key_is_read_by_some_code():
    reads = source_reads()
    unread = sorted(path for path, name in leaf_fields().items() if name not in reads and path not in ALLOWED_UNREAD)
    assert not unread, (f"recipe keys that no code in {', '.join(SOURCE_DIRS)} reads (outside validators): "
                        f"{unread}; wire each one or remove it (a removed key in a recipe must be an error)")


def test_the_allow_list_names_real_unread_keys_with_reasons():
    keys, reads = leaf_fields(), source_reads()
    for path, reason in ALLOWED_UNREAD.items():
        assert path in keys and reason.strip(), f"ALLOWED_UNREAD[{path!r}]: not a recipe key, or no reason"
        assert keys[path] not in reads, f"ALLOWED_UNREAD[{path!r}]: the code reads it now; drop the entry"
