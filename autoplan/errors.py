"""The errors autoplan raises: each names the culprit (op, module path, source line, constraint) and a way out.

All derive from ``AutoplanError``, and from the built-in class a caller would already catch.
"""

from __future__ import annotations

from solvers import InfeasibleError, SolverTimeoutError


class AutoplanError(Exception):
    """Base of every error autoplan raises on purpose."""


class ConstraintError(AutoplanError, ValueError):
    """A constraint that cannot be applied to this model and mesh (bad target, unsplittable shape...)."""


class UnsupportedOpError(AutoplanError, RuntimeError):
    """An op has no sharding rule and strict mode forbids the replicate-only fallback."""


class TracingError(AutoplanError, RuntimeError):
    """The model's step could not be captured as a static graph on fake tensors.

    The message names the op, the module path and the user's source line; the error torch raised is
    the ``__cause__``.
    """

    def __init__(self, message: str, *, op: str | None, module_path: str, source: str | None):
        super().__init__(message)
        self.op, self.module_path, self.source = op, module_path, source


class InfeasiblePlanError(AutoplanError, InfeasibleError):
    """No plan meets the constraints. ``groups`` names a minimal conflicting set of them; under a
    peak cap, ``smallest_peak_bytes`` is the least estimated peak a plan reaches otherwise; under
    a parameter budget no plan meets, ``smallest_param_bytes`` is the least budget one does."""

    def __init__(
        self,
        groups: list[str],
        message: str,
        smallest_peak_bytes: float | None = None,
        *,
        smallest_param_bytes: int | None = None,
    ):
        super().__init__(groups, message)
        self.smallest_peak_bytes = smallest_peak_bytes
        self.smallest_param_bytes = smallest_param_bytes


class PlanMismatchError(AutoplanError, ValueError):
    """A plan applied to a model or mesh it was not made for; ``differences`` lists what differs."""

    def __init__(self, differences: list[str], message: str):
        super().__init__(message)
        self.differences = differences


class InputMismatchError(AutoplanError, ValueError):
    """A parallel module called with inputs other than the plan was traced with (another constant, a
    tensor where ``None`` was, another dtype or shard shape); ``problems`` names each argument."""

    def __init__(self, problems: list[str], message: str):
        super().__init__(message)
        self.problems = problems


class SolverLimitError(AutoplanError, SolverTimeoutError):
    """The solver's time limit passed before it found any plan; ``elapsed`` seconds were spent."""

    def __init__(self, cause: SolverTimeoutError, elapsed: float):
        super().__init__(
            f"no plan found within time_limit={cause.time_limit:g} s ({elapsed:.1f} s spent; the ILP has"
            f" {cause.n_vars} variables and {cause.n_rows} rows, backend {cause.backend}): raise time_limit,"
            " or pin placements (add_node_constraint) so that the ILP is smaller",
            cause.time_limit,
            cause.backend,
            cause.n_vars,
            cause.n_rows,
        )
        self.elapsed = elapsed
