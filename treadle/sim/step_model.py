"""Step-time models: how long the simulated model runner takes for one SchedulerOutput.

Owns the `StepTimeModel` protocol (seconds of a step from its features, the features of
treadle.engine.trace.step_features, so that a model fitted on a real trace and the
simulator read a step the same way) and the `LinearStepModel` that `fit` produces and
`treadle simulate fit --save` writes. The other model is the roofline
(treadle/sim/roofline.py); which one a `--step-model` spec names is decided above both,
in treadle/sim/simulate.py (`make_step_model`), so that this module imports neither.

A model also says how long the engine spends between steps (`gap_seconds`: output
processing, streaming), during which the next step has not started. Nothing here runs
the scheduler or knows requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from treadle.engine.trace import FEATURE_NAMES


class StepTimeModel(Protocol):
    """Seconds of one engine step, from what the step computes."""

    name: str

    def step_seconds(self, features: dict) -> float: ...

    def gap_seconds(self, features: dict) -> float: ...

    def describe(self) -> dict: ...


def linear_rows(features: dict) -> int:
    """Rows the step's linear layers multiply: one per scheduled token."""
    return features["prefill_tokens"] + features["decode_tokens"]


@dataclass
class LinearStepModel:
    """step = intercept + sum of coefficient x feature; gap = gap_intercept + gap per row.

    Coefficients are seconds per unit of their feature (a token, a row, a context token
    read, an attended (query, key) pair, a swapped byte). With `narrow_max_rows` > 0, a
    step whose linears multiply at most that many rows (`linear_rows`) takes its own
    intercept and coefficients instead (`narrow_*`): the engine runs such steps with other
    kernels (the C small-row ones, treadle/worker/cpu/native_linear.py), whose cost per row is
    not the wide steps' (the fit finds the split, treadle/sim/fit.py)."""

    intercept: float
    coefficients: dict[str, float]
    gap_intercept: float = 0.0
    gap_per_row: float = 0.0
    """Seconds between steps per scheduled row (output processing of each request)."""
    name: str = "linear"
    source: str = ""
    fit_report: dict = field(default_factory=dict)
    narrow_max_rows: int = 0
    """Steps of at most this many linear rows use the narrow terms; 0: no split."""
    narrow_intercept: float = 0.0
    narrow_coefficients: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted((set(self.coefficients) | set(self.narrow_coefficients))
                         - set(FEATURE_NAMES))
        if unknown:
            raise ValueError(f"unknown step feature(s) {', '.join(unknown)}; "
                             f"known: {', '.join(FEATURE_NAMES)}")
        if self.narrow_max_rows < 0:
            raise ValueError(f"narrow_max_rows must be >= 0, got {self.narrow_max_rows}")
        self._terms = [(k, v) for k, v in self.coefficients.items() if v]
        self._narrow_terms = [(k, v) for k, v in self.narrow_coefficients.items() if v]

    def step_seconds(self, features: dict) -> float:
        if self.narrow_max_rows and linear_rows(features) <= self.narrow_max_rows:
            t, terms = self.narrow_intercept, self._narrow_terms
        else:
            t, terms = self.intercept, self._terms
        for name, coefficient in terms:
            t += coefficient * features[name]
        return t

    def gap_seconds(self, features: dict) -> float:
        return self.gap_intercept + self.gap_per_row * (features["decode_rows"]
                                                        + features["prefill_rows"])

    def describe(self) -> dict:
        return {"kind": "linear", "name": self.name, "source": self.source,
                "intercept_s": self.intercept, "coefficients_s": dict(self.coefficients),
                "gap_intercept_s": self.gap_intercept, "gap_per_row_s": self.gap_per_row,
                "narrow_max_rows": self.narrow_max_rows,
                "narrow_intercept_s": self.narrow_intercept,
                "narrow_coefficients_s": dict(self.narrow_coefficients),
                "fit": self.fit_report}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.describe(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "LinearStepModel":
        try:
            data = json.loads(Path(path).read_text())
            return cls(float(data["intercept_s"]), dict(data["coefficients_s"]),
                       float(data.get("gap_intercept_s", 0.0)),
                       float(data.get("gap_per_row_s", 0.0)),
                       data.get("name", "linear"), str(path), data.get("fit", {}),
                       int(data.get("narrow_max_rows", 0)),
                       float(data.get("narrow_intercept_s", 0.0)),
                       dict(data.get("narrow_coefficients_s", {})))
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a saved linear step model ({exc!r})") from None
