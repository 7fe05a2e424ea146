"""Types of the fixtures shared by the tests, so a test reads `model_factory: ModelFactory`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from doubles.scripted_model import Script, ScriptedModelServer
    from tests.conftest import Stack


class ModelFactory(Protocol):
    """`model_factory(script)`: a started scripted model server, stopped at the test's end."""

    def __call__(self, script: Script, /) -> ScriptedModelServer: ...


class StackFactory(Protocol):
    """`stack_factory(script)`: a scripted model and real Celery workers, closed at the test's end."""

    def __call__(self, script: Script, /) -> Stack: ...
