"""The base of every config model: strict, frozen, documented.

`extra="forbid"` makes a typo an error; `use_attribute_docstrings` turns the one-line docstring
under each field into its description (shown in errors and checked by a test: every field has one).
Imports only pydantic, so configs can be validated on any machine.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A frozen pydantic model that rejects unknown keys and documents every field."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
        protected_namespaces=(),
    )
