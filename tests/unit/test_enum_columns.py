"""A status column read back is its enum's member, found in the enum's own value map: a page
that reads thousands of rows (a session's timeline with 3,000 delivered results, the console's
lists) pays a dictionary look-up per value, not the enum's constructor."""

from __future__ import annotations

import enum

import pytest

from models import Role
from models.base import StrEnumType


def test_a_stored_value_comes_back_as_its_member_without_calling_the_enum(monkeypatch: pytest.MonkeyPatch) -> None:
    column = StrEnumType(Role)
    calls: list[object] = []
    real = enum.EnumType.__call__

    def counted(cls: type, *args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(enum.EnumType, "__call__", counted)
    assert [column.process_result_value(v, None) for v in ("TOOL", "USER", "ASSISTANT")] == [
        Role.TOOL,
        Role.USER,
        Role.ASSISTANT,
    ]
    assert column.process_result_value("TOOL", None) is Role.TOOL
    assert calls == []
    assert column.process_result_value(None, None) is None


def test_a_value_the_enum_does_not_have_is_refused_as_before() -> None:
    with pytest.raises(ValueError, match="NOT_A_ROLE"):
        StrEnumType(Role).process_result_value("NOT_A_ROLE", None)
