"""pydantic's validation errors in the words of kvbatch's TOML files (the index spec, the
schedule): one `dotted.field: what is wrong` per error, the field as the file spells it, so
both files read and fail alike."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

# errors whose message says what is wrong without the value (the rest end with ", got ...")
_SELF_EXPLAINED = ("missing", "extra_forbidden", "value_error", "assertion_error")


@dataclass(frozen=True)
class FieldError:
    location: tuple[str | int, ...]  # as pydantic gives it (field names as the file spells them)
    message: str

    @property
    def field(self) -> str:
        return ".".join(str(p) for p in self.location)


def field_errors(err: ValidationError) -> list[FieldError]:
    """Each error of `err` with a message a person can act on."""
    out = []
    for item in err.errors():
        kind = item["type"]
        msg = item["msg"].removeprefix("Value error, ")
        if kind == "missing":
            msg = "missing (required)"
        elif kind == "extra_forbidden":
            msg = "unknown field"
        elif kind not in _SELF_EXPLAINED and "input" in item:
            msg = f"{msg[:1].lower()}{msg[1:]}, got {item['input']!r}"
        out.append(FieldError(tuple(item["loc"]), msg))
    return out
