"""The metric names the Grafana dashboard queries, and the check that a ``/metrics`` scrape exposes them.

Shared by the unit test (a :class:`services.pool.metrics.PoolMetrics` render) and the pool integration
test (a real pool's scrape). Names are compared by family, as the exposition's ``# TYPE`` lines name them
(prometheus_client writes those even for a labelled family that has no sample yet).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "inflight-dashboard.json"
METRIC = re.compile(r"\binflight_[A-Za-z0-9_]+")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
TYPE_LINE = re.compile(r"^# TYPE (?P<name>\S+) (?P<type>\S+)$", re.M)
HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def dashboard_exprs(dashboard: dict) -> list[str]:
    """Every PromQL expression of ``dashboard``: panel targets (rows' nested panels too) and query variables."""
    out: list[str] = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query" and query:
            out.append(query["query"] if isinstance(query, dict) else query)
    return out


def load_exprs(path: Path = DASHBOARD) -> list[str]:
    """The expressions of the dashboard file at ``path``."""
    return dashboard_exprs(json.loads(path.read_text()))


def metric_names(expr: str) -> set[str]:
    """The ``inflight_*`` series names ``expr`` selects (string literals, e.g. label values, left out)."""
    return set(METRIC.findall(STRING.sub('""', expr)))


def families(exposition: str) -> dict[str, str]:
    """Family name -> type, from the ``# TYPE`` lines of a Prometheus text exposition."""
    return {m["name"]: m["type"] for m in TYPE_LINE.finditer(exposition)}


def missing(names: set[str], exposition: str) -> list[str]:
    """The names of ``names`` that ``exposition`` has no family for: a histogram's ``_bucket``/``_sum``/
    ``_count`` series count as its family, any other name must be a family itself (counters with ``_total``)."""
    fams = families(exposition)

    def found(name: str) -> bool:
        if name in fams:
            return fams[name] not in ("histogram", "summary")  # a histogram is queried by its series
        for suffix in HISTOGRAM_SERIES:
            base = name.removesuffix(suffix)
            if base != name and fams.get(base) in ("histogram", "summary"):
                return suffix != "_bucket" or fams[base] == "histogram"
        return False

    return sorted(n for n in names if not found(n))


def dashboard_names(path: Path = DASHBOARD) -> set[str]:
    """Every ``inflight_*`` name the dashboard at ``path`` queries."""
    return {n for e in load_exprs(path) for n in metric_names(e)}
