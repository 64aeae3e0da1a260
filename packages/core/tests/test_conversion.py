"""weightsync_core.convert: strict, typed, and its refusals name the field."""

from dataclasses import dataclass, field
from typing import Literal

import pytest
import torch

from weightsync_core import ConversionError, convert


class OwnError(ValueError):
    pass


@dataclass(frozen=True)
class Inner:
    count: int = 1
    rate: float = 0.5

    def __post_init__(self) -> None:
        if self.count < 1:
            raise OwnError(f"count must be >= 1, got {self.count}")


@dataclass
class Outer:
    inner: Inner = field(default_factory=Inner)
    mode: Literal["a", "b"] = "a"
    flag: bool = False
    names: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def test_builds_nested_structures_and_takes_an_int_for_a_float():
    built = convert({"inner": {"count": 3, "rate": 2}, "names": ["x"], "env": {"A": "1"}}, Outer)
    assert built == Outer(Inner(3, 2.0), names=["x"], env={"A": "1"})
    assert isinstance(built.inner.rate, float)


@pytest.mark.parametrize(("data", "path", "expected", "value"), [
    ({"flag": "false"}, ("flag",), "True or False", "false"),
    ({"inner": {"count": True}}, ("inner", "count"), "an integer", True),
    ({"inner": {"count": "5"}}, ("inner", "count"), "an integer", "5"),
    ({"mode": "c"}, ("mode",), "one of 'a', 'b'", "c"),
    ({"env": {"A": 1}}, ("env",), "a mapping of a string to a string", {"A": 1}),
    ({"names": ["x", 2]}, ("names",), "a list of a string", ["x", 2]),
    ({"inner": 3}, ("inner",), "a mapping of keys", 3),
])
def test_a_wrong_type_names_the_field_what_it_accepts_and_what_was_given(
        data, path, expected, value):
    with pytest.raises(ConversionError) as raised:
        convert(data, Outer)
    error = raised.value
    assert (error.kind, error.path, error.expected, error.value) == ("type", path, expected,
                                                                     value)
    assert str(error).startswith(f"{'.'.join(path)} must be {expected}, got {value!r}")


def test_an_unknown_key_anywhere_is_refused_with_the_closest_names():
    with pytest.raises(ConversionError) as raised:
        convert({"inner": {"cuont": 2}}, Outer)
    error = raised.value
    assert (error.kind, error.path, error.value) == ("unknown", ("inner", "cuont"), 2)
    assert error.close == ("inner.count",) and error.choices == ("count", "rate")
    assert "Did you mean 'inner.count'?" in str(error)


def test_the_structures_own_check_keeps_its_words_and_its_exception():
    with pytest.raises(ConversionError) as raised:
        convert({"inner": {"count": 0}}, Outer)
    error = raised.value
    assert (error.kind, error.path) == ("invalid", ("inner",))
    assert error.reason == "count must be >= 1, got 0"
    assert isinstance(error.error, OwnError)
    assert isinstance(error, ValueError)


@dataclass
class _Typed:
    dtype: torch.dtype


@pytest.mark.parametrize("given", [torch.bfloat16, "bfloat16"], ids=["dtype", "its name"])
def test_a_torch_dtype_is_taken_as_itself_or_by_its_name(given):
    assert convert({"dtype": given}, _Typed).dtype is torch.bfloat16


def test_a_name_that_is_no_torch_dtype_is_refused():
    with pytest.raises(ConversionError, match="'bfloat17' is not a torch dtype"):
        convert({"dtype": "bfloat17"}, _Typed)


def test_bounds_set_by_msgspec_meta_are_checked_and_described():
    from typing import Annotated

    from msgspec import Meta

    from weightsync_core.api.conversion import describe_type

    @dataclass
    class Sized:
        size: Annotated[int, Meta(gt=0, le=64)] = 1

    assert describe_type(Annotated[int, Meta(gt=0, le=64)]) == "an integer > 0 and <= 64"
    with pytest.raises(ConversionError, match=r"size must be an integer > 0 and <= 64, got 65"):
        convert({"size": 65}, Sized)


def test_a_structure_built_in_python_is_checked_against_its_annotations():
    from weightsync_core.api.conversion import check_fields

    @dataclass
    class Flags:
        verify: bool = True
        name: str = "x"

    check_fields(Flags())
    with pytest.raises(ConversionError, match=r"verify must be True or False, got 'no' \(str\)"):
        check_fields(Flags(verify="no"))  # pyright: ignore[reportArgumentType]
