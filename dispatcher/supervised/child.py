"""The child side of ``dispatcher.supervised``: the process that loads the policy the user named
and answers the parent's requests, each under ``model.guard`` (see the package's text)."""
from __future__ import annotations

import pickle
from multiprocessing.connection import Connection

from ..model import properties
from ..model.generations import using
from ..model.guard import CALL_TIMEOUT, CallTimedOut, GateInterrupt, guarded
from ..policies import PolicyError, load_policy
from ..sandbox.wire import _interned, _loads, _plain, _portable

__all__ = ["_serve"]


def _serve(fd_in: int, fd_out: int, spec: str, spare: bool = False) -> None:
    """The child's loop: load ``spec``, then answer requests until the pipe closes. A spare
    (``prewarm``) first imports the gate's own code the load needs (torch, the engine's
    loader), then waits to be told to load: nothing of the policy is read before that."""
    rx, tx = Connection(fd_in, writable=False), Connection(fd_out, readable=False)
    if spare:
        from ..engines import engine_of_spec

        engine = engine_of_spec(spec)
        try:
            if engine is not None:
                engine.module("loader")  # the gate's loader (torch with it), not the engine's code
        except ImportError:
            pass  # load_policy says why, once told to load
        try:
            if pickle.loads(rx.recv_bytes()) != "load":
                return
        except EOFError:
            return
    try:
        _, policy = load_policy(spec)
    except PolicyError as exc:
        tx.send_bytes(pickle.dumps(("load-error", str(exc))))
        return
    tx.send_bytes(pickle.dumps(("ready", isinstance(policy, properties.EnginePolicy))))
    bound = {}  # key -> a bound step, made on the first request that names it
    while True:
        try:
            request = pickle.loads(rx.recv_bytes())
        except EOFError:
            return
        op, generation, seconds, budget, args = request
        args = _interned(args)
        CALL_TIMEOUT.seconds = seconds  # the parent's limit for this policy, tripped or not
        properties.RULE_BUDGET.seconds = budget
        try:
            with using(generation), guarded(2 * seconds):  # one timer for the whole request
                answer = ("ok", _answer(policy, bound, op, args))
        except KeyboardInterrupt:
            return
        except (CallTimedOut, properties.RuleHung) as exc:  # stopped by its own timer
            answer = ("hung", f"[slow rule] {exc} (--rule-timeout-s): stopped"
                      if isinstance(exc, CallTimedOut) else str(exc))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back as an answer
            answer = ("raise", _portable(_as_verdict(exc)))
        try:
            data = pickle.dumps(answer)
            if not _plain(answer[1]):
                _loads(data)  # the parent's unpickler must take it: find out here
        except Exception as exc:  # noqa: BLE001 - an answer the parent would refuse
            asked = (f"its {args[1] or 'call'}()" if op == "call" else
                     f"its {args[0]!r}" if op == "getattr" else op)
            data = pickle.dumps(("raise", _portable(properties.RuleCrashed(
                f"[rule crashed] {spec}: {asked} handed back something the gate cannot take "
                f"from its process: {exc}"))))
        tx.send_bytes(data)


def _as_verdict(exc: BaseException) -> BaseException:
    if isinstance(exc, GateInterrupt):  # os._exit or a fork inside an engine method
        return properties.RuleCrashed(f"[rule crashed] {exc}: the gate kept the process (an "
                                      f"exit from a policy never passes for a verdict)")
    return exc


def _answer(policy, bound: dict, op: str, args: tuple):
    if op == "rule_values":
        key, world, name = args
        target = policy if key is None else bound[key]
        values = properties.rule_values(target, world, name)
        return properties.RuleValues(list(values), values.notes, values.replay_args)
    if op == "bind":
        key, bind_args, bind_kwargs = args
        bound[key] = policy.bind(*bind_args, **bind_kwargs)
        while len(bound) > 64:  # the oldest binding goes (a replay binds once)
            bound.pop(next(iter(bound)))
        return None
    if op == "getattr":
        (name,) = args
        value = getattr(policy, name)
        return ("method",) if callable(value) else ("value", value)
    if op == "call":
        key, name, call_args, call_kwargs = args
        target = policy if key is None else bound[key]
        return getattr(target, name)(*call_args, **call_kwargs) if name else \
            target(*call_args, **call_kwargs)
    raise ValueError(f"unknown request {op!r}")
