"""The probe's report as data: ``ProbeReport.to_dict()`` and ``fullbatch probe --json PATH``.

Every field of the report and of each window (:class:`~fullbatch._probe._report.WindowCheck`)
goes out under its own name, whatever fields the dataclasses hold (a field added to them flows
through); a few derived keys make it easy to read by machine: ``verdict``, each window's
``micro_batch_ranks`` (the rank of each weight) and ``clip`` as ``{"max_norm", "total_norm"}``.
Non-finite numbers (a weight of a micro-batch with no items) are ``null``. :data:`SCHEMA` lists
the keys a reader may rely on, by type; :func:`problems` checks a dict against it without any
JSON-schema package. The schema is versioned (:data:`SCHEMA_VERSION`): a key removed or whose
meaning changes bumps it, a key added does not. Documented in docs/probe.md, "The report as
data".
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["SCHEMA", "SCHEMA_VERSION", "problems", "report_dict"]

SCHEMA_VERSION = 1

_NUMBER = ["number", "null"]  # null: not finite (nan, inf)
_NUMBERS = {"type": "array", "items": {"type": _NUMBER}}
_STRINGS = {"type": "array", "items": {"type": "string"}}

_OPTIMIZER = {
    "type": "object",
    "required": {
        "label": {"type": "string"},
        "ok": {"type": "boolean"},
        "pattern": {"type": "string"},
        "error": {"type": _NUMBER},
        "tolerance": {"type": _NUMBER},
        "factor": {"type": _NUMBER},
        "weights": _NUMBERS,
        "precision": _NUMBERS,
    },
}

_WINDOW = {
    "type": "object",
    "required": {
        "step": {"type": "integer"},
        "ok": {"type": "boolean"},
        "pattern": {"type": "string"},
        "diagnosis": {"type": "string"},
        "error": {"type": _NUMBER},
        "tolerance": {"type": _NUMBER},
        "band": {"type": _NUMBER},
        "micro_batches": {"type": "integer"},
        "count": {"type": _NUMBER},
        "weights": _NUMBERS,
        "precision": _NUMBERS,
        "micro_batch_ranks": {"type": "array", "items": {"type": "integer"}},
        "ranks": {"type": "array", "items": {"type": "integer"}},
        "factor": {"type": _NUMBER},
        "factor_precision": {"type": _NUMBER},
        "leftover": {"type": _NUMBER},
        "clip": {
            "type": ["object", "null"],
            "required": {"max_norm": {"type": _NUMBER}, "total_norm": {"type": _NUMBER}},
        },
        "engine": {"type": "string"},
        "objective": {"type": "string"},
        "optimizers": _STRINGS,
        "per_optimizer": {"type": "array", "items": _OPTIMIZER},
        "no_backward": {"type": "integer"},
        "statistic_share": {"type": _NUMBER},  # null: no MoE aux loss in the objective
    },
}

#: The keys a reader may rely on, with their JSON types; more keys may be present.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": {
        "schema_version": {"type": "integer"},
        "ok": {"type": "boolean"},
        "verdict": {"type": "string"},  # right, wrong, nothing checked, failed
        "requested": {"type": ["integer", "null"]},
        "engine": {"type": "string"},
        "problems": _STRINGS,
        "failure": {"type": "string"},
        "windows": {"type": "array", "items": _WINDOW},
    },
}

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "integer": int,
    "number": (int, float),
    "boolean": bool,
    "null": type(None),
}


def _plain(value: Any) -> Any:
    """JSON-ready: tuples as lists, non-finite floats as None, dataclasses as dicts."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def report_dict(report: Any) -> dict[str, Any]:
    """``report`` (a :class:`~fullbatch._probe._report.ProbeReport`) as JSON-ready data.

    >>> from fullbatch._probe._report import ProbeReport
    >>> data = report_dict(ProbeReport())
    >>> data["schema_version"], data["verdict"], data["windows"], problems(data)
    (1, 'nothing checked', [], [])
    """
    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION, "ok": report.ok}
    out["verdict"] = report.verdict
    for f in dataclasses.fields(report):
        if f.name != "windows":
            out[f.name] = _plain(getattr(report, f.name))
    out["windows"] = [_window(w) for w in report.windows]
    return out


def _window(check: Any) -> dict[str, Any]:
    data = _plain(check)
    data["micro_batch_ranks"] = [r for r, n in enumerate(check.ranks) for _ in range(n)]
    if check.clip is not None:
        data["clip"] = {"max_norm": _plain(check.clip[0]), "total_norm": _plain(check.clip[1])}
    return data


def problems(data: Any, schema: dict[str, Any] = SCHEMA, where: str = "$") -> list[str]:
    """Where ``data`` breaks ``schema`` (empty: it fits): a missing required key or a value of
    another type, each as ``"$.windows[0].error: expected number or null, got str"``.

    >>> problems({"a": 1}, {"type": "object", "required": {"a": {"type": "string"}}})
    ['$.a: expected string, got int']
    """
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    fits = [
        k for k in kinds
        if isinstance(data, _TYPES[k]) and not (k in ("integer", "number") and data is True)
        and not (k in ("integer", "number") and data is False)
    ]  # fmt: skip
    if not fits:
        return [f"{where}: expected {' or '.join(kinds)}, got {type(data).__name__}"]
    found: list[str] = []
    if fits[0] == "object":
        for key, sub in schema.get("required", {}).items():
            if key not in data:
                found.append(f"{where}: missing key {key!r}")
            else:
                found += problems(data[key], sub, f"{where}.{key}")
    if fits[0] == "array" and "items" in schema:
        for i, item in enumerate(data):
            found += problems(item, schema["items"], f"{where}[{i}]")
    return found
