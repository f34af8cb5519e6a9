"""The rule kinds and the translator: conflicts, NeutralOnly errors, Derive, When, prefix rules, the report."""
from __future__ import annotations

import pytest

from services.recipe.nemo_rl.rules import (
    Derive,
    Ignore,
    NeutralOnly,
    Rename,
    TranslationError,
    When,
    find_rule,
    leaves,
    translate,
)

INFLIGHT = {"a.x", "a.y", "b.z", "b.w"}


def run(data: dict, table: dict):
    return translate(data, table, lambda p: p in INFLIGHT)


def test_two_keys_mapping_to_one_target_must_agree():
    table = {"n.p": Rename("a.x"), "n.q": Rename("a.x")}
    out, report = run({"n": {"p": 3, "q": 3}}, table)
    assert out == {"a": {"x": 3}} and [m.source for m in report.mapped] == ["n.p", "n.q"]
    with pytest.raises(TranslationError, match=r"maps to a.x = 4, which n.p already set to 3") as err:
        run({"n": {"p": 3, "q": 4}}, table)
    assert err.value.path == "n.q"
    with pytest.raises(TranslationError, match="which a.x already set"):  # a kept key and a renamed one
        run({"a": {"x": 1}, "n": {"p": 2}}, table)


def test_neutral_only_accepts_the_off_values_and_names_key_value_and_why():
    table = {"n.lora": NeutralOnly((False,), "LoRA is not supported"), "n.any": NeutralOnly((), "never")}
    _, report = run({"n": {"lora": False}}, table)
    assert [(i.source, i.why) for i in report.ignored] == [("n.lora", "LoRA is not supported")]
    with pytest.raises(TranslationError) as err:
        run({"n": {"lora": True}}, table)
    assert str(err.value) == "n.lora: True is not supported (LoRA is not supported); expected False"
    with pytest.raises(TranslationError, match=r"^n.lora: 0 is not supported"):  # 0 is not False
        run({"n": {"lora": 0}}, table)
    with pytest.raises(TranslationError, match=r"^n.any: 1 is not supported \(never\)$"):
        run({"n": {"any": 1}}, table)


def test_derive_maps_several_targets_or_nothing_and_fills_the_error_path():
    def split(value, src):
        return [("a.x", value[0]), ("a.y", value[1])] if value else []

    def picky(value, src):
        raise TranslationError("", f"{value!r} is odd (other is {src.get('n.other')})")

    table = {"n.pair": Derive(split, "pair -> a.x, a.y"), "n.odd": Derive(picky, "never")}
    out, report = run({"n": {"pair": [1, 2]}}, table)
    assert out == {"a": {"x": 1, "y": 2}} and report.counts()["mapped"] == 1
    _, report = run({"n": {"pair": []}}, table)
    assert [(i.source, i.why) for i in report.ignored] == [("n.pair", "pair -> a.x, a.y")]
    with pytest.raises(TranslationError) as err:
        run({"n": {"odd": 5, "other": 7}}, table)
    assert err.value.path == "n.odd" and err.value.reason == "5 is odd (other is 7)"


def test_when_picks_a_rule_from_the_recipe_and_none_keeps_the_key():
    table = {"a.x": When(lambda s: s.get("mode") == "other", Ignore("not read in the other mode"), None, "mode")}
    out, report = run({"mode": "same", "a": {"x": 1}}, table)
    assert out["a"] == {"x": 1} and "a.x" in report.kept
    out, report = run({"mode": "other", "a": {"x": 1}}, table)
    assert "a" not in out and report.ignored[0].why == "not read in the other mode"


def test_prefix_rules_the_longest_wins_and_exact_beats_prefix():
    table = {"n.*": Ignore("n"), "n.m.*": Ignore("n.m"), "n.m.k": Rename("a.x")}
    assert find_rule(table, "n.q") == Ignore("n") and find_rule(table, "n.m.deep.er") == Ignore("n.m")
    assert find_rule(table, "n.m.k") == Rename("a.x") and find_rule(table, "q") is None
    out, report = run({"n": {"q": 1, "m": {"k": 2, "j": 3}}}, table)
    assert out == {"a": {"x": 2}} and sorted(i.why for i in report.ignored) == ["n", "n.m"]


def test_the_report_classifies_every_leaf_and_the_summary_groups_by_reason():
    data = {"a": {"x": 1}, "n": {"p": 2, "q": {}, "r": [1]}, "stray": 3}
    table = {"n.p": Rename("b.z"), "n.q": Ignore("empty"), "n.r": Ignore("empty")}
    out, report = run(data, table)
    assert list(leaves(data)) == [("a.x", 1), ("n.p", 2), ("n.q", {}), ("n.r", [1]), ("stray", 3)]
    assert report.counts() == {"leaves": 5, "kept": 1, "mapped": 1, "ignored": 2, "unknown": 1, "errors": 0}
    assert report.unknown == ["stray"] and out["stray"] == 3  # left for the schema to reject
    assert report.summary() == "2 of 5 recipe keys have no meaning here (1 kept, 1 mapped); by section, each reason " \
                               "once:\nn: 2 ignored\n  ignored: n.q, n.r: empty"


def test_the_summary_counts_each_section_names_each_reason_once_and_shortens_long_lists():
    data = {"s": {f"k{i}": i for i in range(6)}, "t": {"a": 1, "b": 2}, "u": {"c": 3}}
    table = {"s.*": Ignore("speed"), "t.a": Ignore("speed"), "t.b": Ignore("logging"), "u.c": Ignore("logging")}
    _, report = run(data, table)
    lines = report.summary().splitlines()
    assert lines[0].startswith("9 of 9 recipe keys have no meaning here")
    assert lines[1:] == ["s: 7 ignored", "  ignored: s.k0, s.k1, s.k2 (+4 more; 7 in all): speed",
                         "t: 2 ignored", "  ignored: t.b, u.c: logging"]
    assert report.summary(max_keys=None).count("s.k") == 6 and report.summary().count("speed") == 1


def test_not_strict_collects_every_error_and_goes_on():
    table = {"n.a": NeutralOnly((False,), "off"), "n.b": NeutralOnly((0,), "off"), "n.c": Rename("a.x")}
    out, report = translate({"n": {"a": True, "b": 1, "c": 2}}, table, lambda p: p in INFLIGHT, strict=False)
    assert [e.path for e in report.errors] == ["n.a", "n.b"] and out == {"a": {"x": 2}}
    assert report.counts()["errors"] == 2


def test_a_derive_may_skip_with_its_own_reason():
    from services.recipe.nemo_rl.rules import Skip

    table = {"n.a": Derive(lambda v, s: Skip(f"later ({v})"), "note")}
    _, report = run({"n": {"a": 1}}, table)
    assert report.ignored[0].why == "later (1)"
