"""``inflight pool status`` as a person reads it: the pool's status dict rendered as plain-text tables.

:func:`render` takes what :meth:`services.pool.deployment.RolloutPool.status` returns (``--json`` prints
that dict as it is) and writes a header line, the engines (id, state, version, pid, last error), the
learner (attached, id, step, reward) and the last refit (seconds, bytes, pause). The learner's step,
reward and refit numbers come from its last step report (``status["last_report"]``, the report
:meth:`~services.job.learner_job.LearnerJob` sends each step) and show ``-`` while there is none.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

NONE = "-"
ERROR_WIDTH = 60


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart, under a header and a rule."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in lines)


def fmt_seconds(s: Any) -> str:
    """``1.23s`` / ``45ms``; ``-`` for None or a non-number."""
    if not isinstance(s, (int, float)) or s != s:  # NaN
        return NONE
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s"


def fmt_bytes(n: Any) -> str:
    """``1.5 MiB`` style; ``-`` for None or a non-number."""
    if not isinstance(n, (int, float)) or n != n:  # NaN
        return NONE
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return NONE  # unreachable


def fmt_duration(s: Any) -> str:
    """``3h02m`` / ``4m05s`` / ``12s``."""
    if not isinstance(s, (int, float)):
        return NONE
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _value(v: Any, spec: str = "") -> str:
    if v is None or (isinstance(v, float) and v != v):  # NaN
        return NONE
    return format(v, spec) if spec and isinstance(v, (int, float)) else str(v)


def engine_state(e: dict, pool_version: int | None) -> str:
    """The engine's ``state`` as the pool named it (``services.pool.engine_table.STATES``: starting, up, stale,
    draining, down); for a status without one, ``up``/``down`` and ``stale`` when up at another version."""
    if e.get("state"):
        return str(e["state"])
    if not e.get("up"):
        return "down"
    return "stale" if pool_version is not None and e.get("version") != pool_version else "up"


def engines_table(engines: dict[str, dict], pool_version: int | None) -> str:
    """One row per engine: id, state (:func:`engine_state`), version, pid, last error (cut to one line)."""
    rows = []
    for eid, e in sorted(engines.items(), key=lambda kv: _engine_order(kv[0])):
        state = engine_state(e, pool_version)
        err = " ".join(str(e.get("error") or NONE).split())
        rows.append([eid, state, _value(e.get("version")), _value(e.get("pid")),
                     err if len(err) <= ERROR_WIDTH else err[:ERROR_WIDTH - 3] + "..."])
    return table(["engine", "state", "version", "pid", "last error"], rows or [["(none)", "", "", "", ""]])


def _engine_order(eid: str) -> tuple[str, int]:
    """``p-engine-2`` before ``p-engine-10``."""
    head, _, tail = eid.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (eid, -1)


def learner_table(learner: dict | None, report: dict | None, now: float) -> str:
    """Attached or not, the learner's id and how long ago it attached, its last step and reward."""
    report = report or {}
    since = learner.get("since") if learner else None
    attached = f"yes, {fmt_duration(now - since)} ago" if isinstance(since, (int, float)) else \
        ("yes" if learner else "no")
    rows = [["attached", attached], ["id", _value(learner.get("id")) if learner else NONE],
            ["step", _value(report.get("step"))], ["reward mean", _value(report.get("reward_mean"), ".4f")],
            ["gen KL error", _value(report.get("gen_kl_error"), ".2e")]]
    return table(["learner", ""], rows)


def refit_table(report: dict | None) -> str:
    """The last refit as the learner reported it: seconds (its step's refit phase), bytes, engine pause."""
    report = report or {}
    rows = [["seconds", fmt_seconds(report.get("refit_s"))], ["bytes", fmt_bytes(report.get("refit_bytes"))],
            ["pause", fmt_seconds(report.get("refit_pause_s"))]]
    return table(["last refit", ""], rows)


def render(status: dict, now: float | None = None) -> str:
    """The whole ``pool status`` text for ``status`` (the pool's status dict, ``PoolStatus.to_json()``); ``now``
    defaults to the clock."""
    now = time.time() if now is None else now
    flags = [f for f in ("paused", "draining") if status.get(f)]
    head = (f"pool {status.get('name', '?')}: version {_value(status.get('version'))}, "
            f"{'ready' if status.get('ready') else 'not ready'}{''.join(', ' + f for f in flags)}, "
            f"up {fmt_duration(status.get('uptime_s'))}, pid {_value(status.get('pid'))}")
    counts = (f"prompts: {_value(status.get('waiting_prompts'))} waiting, "
              f"{_value(status.get('requeued_prompts'))} requeued, {_value(status.get('undelivered_prompts'))} "
              f"undelivered")
    report = status.get("last_report")
    parts = [f"{head}\n{counts}", engines_table(status.get("engines") or {}, status.get("version")),
             learner_table(status.get("learner"), report, now), refit_table(report)]
    errors = status.get("errors") or []
    if errors:
        parts.append("recent errors:\n" + "\n".join(f"  {' '.join(str(e).split())}" for e in errors))
    return "\n\n".join(parts) + "\n"
