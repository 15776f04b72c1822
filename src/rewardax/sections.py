"""Section: the base of every configuration section, on pydantic v2.

pydantic does the typing: each field is checked and converted by its annotation at construction
and at every assignment (`validate_assignment`), YAML's and the command line's strings included
("2e-5", "true", "null"), and a field's help text is the docstring under it
(`use_attribute_docstrings`). rewardax adds what a user of a command-line tool expects on top:
text forms pydantic does not read (`null` for an optional field, `[a, b]` or a single value for a
list) and errors that say `optim.name must be one of 'adamw', ... (did you mean 'adamw'?)` as a
ConfigError instead of a pydantic ValidationError.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Any, ClassVar, Literal

import pydantic

from rewardax.errors import ConfigError

_NULLS = {"null", "none", "~", ""}


def type_name(tp: Any) -> str:
    """A short readable name of a field type: `float | null`, `'adamw' | 'lion'`, `list[int]`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (list, tuple):
        return f"list[{type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def _options(tp: Any) -> tuple[list[Any], bool]:
    """The non-null members of a field type and whether null is allowed."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        return [a for a in args if a is not type(None)], type(None) in args
    return [tp], False


def _choices(tp: Any) -> tuple[Any, ...]:
    return tuple(
        c for o in _options(tp)[0] if typing.get_origin(o) is Literal for c in typing.get_args(o)
    )


def _from_text(value: Any, tp: Any) -> Any:
    """The forms of a value pydantic does not read by itself, converted for field type `tp`."""
    options, nullable = _options(tp)
    if isinstance(value, str):
        text = value.strip()
        if nullable and text.lower() in _NULLS and text not in _choices(tp):
            return None
    if any(typing.get_origin(o) in (list, tuple) for o in options):
        if isinstance(value, str):
            text = value.strip()
            if text[:1] in "[(" and text[-1:] in "])":
                text = text[1:-1]
            return [part.strip().strip("'\"") for part in text.split(",") if part.strip()]
        if value is not None and not isinstance(value, (list, tuple)):
            return [value]  # `report_to: wandb` means a list of one
    return value


_MESSAGES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "tuple_type": "must be a list",
    "dict_type": "must be a mapping",
}


def describe_error(error: pydantic.ValidationError, section: str, fields: dict[str, Any]) -> str:
    """pydantic's errors as rewardax's lines: `section.field must be ...; got VALUE`."""
    lines = []
    for item in error.errors(include_url=False):
        loc = [part for part in item["loc"] if not isinstance(part, str) or part in fields]
        name = str(loc[0]) if loc else ""
        where = f"{section}.{name}" + "".join(f"[{i}]" for i in loc[1:])
        value, kind = item.get("input"), item["type"]
        tp = fields[name].annotation if name in fields else Any
        if kind == "literal_error":
            # The field's choices, or its items' for a list of choices (loc names the item).
            choices = _choices(typing.get_args(tp)[0] if len(loc) > 1 else tp)
            close = difflib.get_close_matches(
                str(value), [str(c) for c in choices], n=1, cutoff=0.5
            )
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(
                f"{where} must be one of {', '.join(map(repr, choices))}; got {value!r}{hint}"
            )
        elif value is None and len(loc) == 1:
            lines.append(f"{where} cannot be null; give a {type_name(tp)}")
        elif kind in _MESSAGES:
            lines.append(f"{where} {_MESSAGES[kind]}; got {value!r}")
        else:
            lines.append(f"{where}: {item['msg']}; got {value!r}")
    return "; ".join(lines)


def unknown_field(
    key: str, candidates: typing.Iterable[str], source: str | None = None
) -> ConfigError:
    """The error for a key no section has, with the closest valid one."""
    where = f" in {source}" if source else ""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "`rewardax train --help` lists every field"
    return ConfigError(f"unknown configuration key {key!r}{where}; {hint}")


class Section(pydantic.BaseModel):
    """A configuration section: typed fields with their help as docstrings, checked on assignment.

    Subclasses set `section` (its name in RewardConfig, used in messages). Construction and
    assignment raise ConfigError naming `section.field`; an unknown field name suggests the
    closest one.
    """

    model_config = pydantic.ConfigDict(
        extra="forbid",
        validate_assignment=True,
        use_attribute_docstrings=True,
        coerce_numbers_to_str=True,  # `run_name: 2024` is a name
        revalidate_instances="never",
    )
    section: ClassVar[str] = ""
    # Fields added after run names were first hashed from `to_dict()`: left out of it while they
    # hold their default, so that an existing config keeps its dict, YAML and run name.
    omit_when_default: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, **values: Any) -> None:
        fields = type(self).model_fields
        for key in values:
            if key not in fields:
                names = [f"{self.section}.{n}" for n in fields]
                raise unknown_field(f"{self.section}.{key}", names)
        try:
            super().__init__(**values)
        except pydantic.ValidationError as error:
            raise ConfigError(describe_error(error, self.section, fields)) from None

    def __setattr__(self, name: str, value: Any) -> None:
        fields = type(self).model_fields
        if name not in fields:
            raise unknown_field(f"{self.section}.{name}", [f"{self.section}.{n}" for n in fields])
        try:
            super().__setattr__(name, value)
        except pydantic.ValidationError as error:
            raise ConfigError(describe_error(error, self.section, fields)) from None

    @pydantic.field_validator("*", mode="before")
    @classmethod
    def _read_text(cls, value: Any, info: pydantic.ValidationInfo) -> Any:
        return _from_text(value, cls.model_fields[info.field_name].annotation)

    def replace(self, **changes: Any) -> Section:
        """A copy with `changes` applied and checked (pydantic's model_copy does not check)."""
        return type(self)(**{**self.model_dump(), **changes})

    def to_dict(self) -> dict[str, Any]:
        """{field: value} with plain JSON/YAML types (tuples as lists); the `omit_when_default`
        fields only when they differ from their default."""
        values = self.model_dump(mode="json")
        for name in self.omit_when_default:
            if values[name] == type(self).model_fields[name].get_default(call_default_factory=True):
                del values[name]
        return values

    @classmethod
    def field_help(cls) -> dict[str, str]:
        """{field: help text}, from the docstring under each field."""
        return {
            name: " ".join((f.description or "").split()) for name, f in cls.model_fields.items()
        }
