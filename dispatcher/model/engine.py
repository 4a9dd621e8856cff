"""What makes a policy an *engine* policy: an engine's own dispatcher code run by the gate
(``dispatcher/sglang``, ``dispatcher/vllm``), as opposed to a plain rule ``(RankView) -> int``.

Only these types get an engine's privileges: to be bound to the whole world it runs in
(``bind``), to map a world to the nearest one its engine runs (``engine_world``) and, per step,
to declare a world impossible (``NotApplicable``). They are granted by type, never by an
attribute, so a plain rule cannot choose the worlds it is checked on.
"""
from __future__ import annotations

import abc

from .world import World

__all__ = ["EnginePolicy", "EngineStep", "RemotePolicy", "is_engine"]


class EngineStep(abc.ABC):
    """One engine policy bound to one world (and context): called with a rank's view, it
    returns the runtime that rank's engine code passed; ``notes()`` says what each rank saw."""

    replay_args: str = ""  # e.g. " --context ...", for the replay line
    spec: str = ""

    @abc.abstractmethod
    def __call__(self, view) -> int: ...

    def notes(self) -> str:
        return ""


class EnginePolicy(abc.ABC):
    """An engine's dispatcher file, loaded: ``engine`` names it ("sglang", "vllm")."""

    engine: str = ""
    # whether a step carries the engine's serving context beside its world (SGLang's
    # ``SGLangContext``: forward mode, CUDA graph, speculative decoding, ...)
    takes_context: bool = False

    @property
    def runs_modelled_a2a(self) -> bool:
        """Whether the file runs the FlashInfer MoE A2A the gate models (vLLM's two-sided
        backend runs other kernels: no such workspace)."""
        return True

    @property
    @abc.abstractmethod
    def spec(self) -> str: ...

    @abc.abstractmethod
    def bind(self, world: World, *args) -> EngineStep: ...

    @abc.abstractmethod
    def engine_world(self, world: World, keep_cap: bool = False) -> World: ...


class RemotePolicy(abc.ABC):
    """A policy whose code runs in another process (``dispatcher.supervised``): the checks ask
    it for whole answers (``rule_values``: every rank of one world) instead of calling it per
    rank here. ``is_engine``: whether the code there is an engine policy."""

    is_engine: bool = False

    @abc.abstractmethod
    def rule_values(self, world: World, name: str): ...


def is_engine(policy) -> bool:
    """Whether ``policy`` is an engine's dispatcher code, here or in a supervised process."""
    return isinstance(policy, EnginePolicy) or (isinstance(policy, RemotePolicy)
                                                and policy.is_engine)
