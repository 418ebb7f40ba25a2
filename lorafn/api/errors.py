"""Turning pydantic validation errors into one line a user can act on."""

from __future__ import annotations

from pydantic import ValidationError


def format_validation_error(err: ValidationError, prefix: str = "spec") -> str:
    """One clause per problem, e.g. `spec.scaling.minReplicas: Input should be >= 0 (got -1)`."""
    clauses = []
    for problem in err.errors():
        path = ".".join([prefix, *(str(p) for p in problem["loc"])])
        got = problem.get("input")
        shown = f" (got {got!r})" if got is not None and not isinstance(got, dict | list) else ""
        clauses.append(f"{path}: {problem['msg']}{shown}")
    return "; ".join(clauses)
