"""The two steps between SGLang's scheduler and its dispatcher, run from the release or
checkout under test: the forward batch's DP padding and the decode CUDA-graph runner's bucket.

=========================================  ====================================================
SGLang code (paths under srt/)             what it decides here
=========================================  ====================================================
``model_executor/forward_batch_info.py:    the list every rank publishes for
ForwardBatch.prepare_mlp_sync_batch``      ``get_dp_global_num_tokens()`` (each entry aligned
                                           to attn_tp; MAX_LEN or SUM_LEN by the release's own
                                           ``DpPaddingMode.get_dp_padding_mode``) and the rows
                                           the rank's DP group holds after padding; run from
                                           its first line until it publishes
                                           (``set_dp_buffer_len``, directly or through
                                           ``set_dp_buffer_len_from_batch``)
``model_executor/runner/decode_cuda_graph_ the bucket a rank replays: the statements of
runner.py: DecodeCudaGraphRunner.          ``load_batch`` (0.5.14+) or ``replay_prepare``
load_batch`` (0.5.10-0.5.13:               (``CudaGraphRunner``, 0.5.10-0.5.13) that choose it,
``cuda_graph_runner.py: CudaGraphRunner.   the ``if self.require_mlp_tp_gather:`` block, every
replay_prepare``)                          later statement that can change ``bs`` (a backward
                                           slice to the method's end) and what they read,
                                           sliced out and compiled alone; its helpers
                                           (``_pad_to_bucket``, ``_max_dp_batch_size``) from
                                           the release's runner classes
=========================================  ====================================================

Everything else they read is the gate's stand-in for process state, each named in ``_standins``
with the server default it answers (no context parallelism, prefill CUDA graphs off, elastic EP
off, a CUDA host, FlashInfer's A2A as the MoE backend); a name or attribute that is neither the
release's code nor a declared stand-in stops the run with its name (``release_code``).
"""
from __future__ import annotations

import ast
import contextvars
import copy
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from ..model.sglang_context import SGLangContext
from ..model.world import World
from ..sandbox.release_code import (
    FileNamespace,
    Strict,
    UnmodelledAttribute,
    compile_def,
    find_def,
)
from .sources import BUCKET_METHODS, FORWARD_BATCH, PADDING_METHOD, rel_path
from .standins import _Backend, _Envs

__all__ = ["Padded", "Padding", "GraphRunner", "ReleaseCodeError", "STANDINS"]


class ReleaseCodeError(RuntimeError):
    """The release's padding or bucket code could not be run, or produced no value."""


@dataclass(frozen=True)
class Padded:
    """What ``prepare_mlp_sync_batch`` produced on one DP group's rank."""

    published: List[int]  # what get_dp_global_num_tokens() returns from then on
    num_tokens: int  # the rows the DP group holds after padding (before the attn-TP scatter)
    max_len: bool  # DpPaddingMode.MAX_LEN


class _Published(BaseException):
    """Raised by the stand-in ``set_dp_buffer_len``: the padding is done, stop there."""

    def __init__(self, padded: Padded):
        self.padded = padded


@dataclass(frozen=True)
class _Step:
    world: World
    ctx: SGLangContext
    dp_rank: int

    @functools.cached_property
    def parallel(self):
        w = self.world
        return Strict("get_parallel()", attn_tp_size=w.attn_tp_size, attn_dp_rank=self.dp_rank,
                      attn_dp_size=w.dp_size, num_dp_ranks=w.dp_size, attn_dp_enabled=True,
                      attn_cp_size=1, attn_cp_rank=0,
                      tp_group=Strict("get_parallel().tp_group", ca_comm=None))

    @functools.cached_property
    def flags(self):  # written by the release's code only on paths the gate does not run
        return Strict("get_flags()", dp=Strict(
            "get_flags().dp", use_world_group_for_gather=False, joiner_skip_all_gather=False,
            scoped_gather_slot=None, max_len_with_idle=False, prefill_graph_has_dp_gather=False))


_step: contextvars.ContextVar[_Step] = contextvars.ContextVar("sglang_forward_step")


def _set_dp_buffer_len(global_dp_buffer_len, local_dp_buffer_len, dp_max_padding,
                       global_num_tokens=None, *rest, **kw):
    raise _Published(Padded(None if global_num_tokens is None else list(global_num_tokens),
                            local_dp_buffer_len, bool(dp_max_padding)))


def _parallel():
    return _step.get().parallel




def _no_prefill_graphs():
    return Strict("cuda_graph_config", prefill=Strict("cuda_graph_config.prefill", bs=()))


class _NoCustomAllReduce:
    """No object is one: the gate's host has no custom all-reduce communicator."""


def _standins() -> dict:
    """Process state the release's padding and runner code read, as the gate models it."""
    return {
        # the parallel state of the step's DP group (DP attention on, no context parallelism)
        "get_parallel": _parallel,
        "get_attention_tp_size": lambda: _step.get().world.attn_tp_size,
        "get_attention_dp_size": lambda: _step.get().world.dp_size,
        "get_attention_dp_rank": lambda: _step.get().dp_rank,
        "get_attention_cp_size": lambda: 1,
        "get_cp_padding_align_size": lambda: 1,
        "enable_cp_v2": lambda: False,
        "is_dsa_enable_prefill_cp": lambda: False,
        "is_mla_cp_enabled": lambda: False,
        "get_flags": lambda: _step.get().flags,  # elastic EP off: the gather spans the attention-DP replicas
        "get_spec": lambda: Strict("get_spec()", speculative_algorithm=(
            "EAGLE" if _step.get().ctx.speculative else None)),
        "get_moe_a2a_backend": lambda: _Backend("flashinfer"),
        "get_exec": lambda: Strict("get_exec()", graph=Strict(
            "get_exec().graph", cuda_graph_config=_no_prefill_graphs())),
        "envs": _Envs(),  # every SGLANG_* variable of these paths unset
        "_is_hip": False, "_is_npu": False, "_USE_ROCM700A_WA": False,
        "_DP_MAX_LEN_WITH_IDLE": False,  # set only for hybrid-SSM models (0.5.14-0.5.22)
        "CustomAllReduceV2": _NoCustomAllReduce,
        # where the padding publishes: the recorder stops it there
        "set_dp_buffer_len": _set_dp_buffer_len,
    }


STANDINS = _standins()


def _root(path: Path, rel: Optional[str] = None) -> Path:
    """The tree holding ``path`` as its ``rel`` (default: the folder above its ``sglang/srt``)."""
    path = Path(path)
    if rel is None:
        parts = path.parts
        at = max(i for i in range(len(parts) - 1) if parts[i] == "sglang" and parts[i + 1] == "srt")
        return Path(*parts[:at])
    return path.parents[len(Path(rel).parts) - 1]




class _Mode:
    """``forward_batch.forward_mode`` for one context: ``is_<mode>()`` answered by name."""

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr):
        if attr.startswith("is_"):
            return lambda *a, **k: attr[3:] == self.name
        raise UnmodelledAttribute(f"forward_mode.{attr}")


class Padding:
    """``ForwardBatch.prepare_mlp_sync_batch`` of one release, run until it publishes."""

    def __init__(self, path: Path, tag: str = ""):
        self.path = Path(path)
        ns = FileNamespace(_root(path, FORWARD_BATCH), path, STANDINS)
        self.fn = ns.method(*PADDING_METHOD)
        if self.fn is None:
            raise ReleaseCodeError(f"{path}: no ForwardBatch.prepare_mlp_sync_batch")
        self.source = (f"{rel_path(path)}:{self.fn.__code__.co_firstlineno} "
                       f"ForwardBatch.prepare_mlp_sync_batch(){tag}")

    def run(self, world: World, ctx: SGLangContext, dp_rank: int, listed: Sequence[int],
            requests: int, is_extend: bool) -> Padded:
        """Group ``dp_rank``'s padding of the gathered (and speculatively scaled) ``listed``;
        ``requests``: its batch size."""
        batch = Strict(
            "ForwardBatch", global_num_tokens_cpu=list(listed),
            global_num_tokens_for_logprob_cpu=list(listed), batch_size=requests,
            is_extend_in_batch=is_extend, forward_mode=_Mode(_mode(ctx)),
            can_run_dp_breakable_cuda_graph=False, can_run_dp_prefill_cuda_graph=False,
            dp_spec_prefill_coordination_applied=False, global_num_tokens_gpu=None,
            global_num_tokens_padded_cpu=None,
            spec_info=(Strict("spec_info", num_tokens_per_req=ctx.tokens_per_req)
                       if ctx.draft_forward else None))
        runner = Strict("model_runner", server_args=Strict(
            "server_args", cuda_graph_config=_no_prefill_graphs()),
            enable_elastic_ep=False, is_draft_worker=ctx.draft_forward,
            attn_tp_sequence_sharded=lambda n: world.attn_tp_size > 1)
        token = _step.set(_Step(world, ctx, dp_rank))
        try:
            self.fn(batch, runner)
        except _Published as done:
            return done.padded
        except Exception as exc:  # noqa: BLE001 - the release's own code failed on this step
            raise ReleaseCodeError(f"{self.source} raised {type(exc).__name__}: {exc}") from exc
        finally:
            _step.reset(token)
        raise ReleaseCodeError(f"{self.source} returned without publishing the DP list "
                               f"(no set_dp_buffer_len)")


def _mode(ctx: SGLangContext) -> str:
    return {"decode": "decode", "replay": "decode", "capture": "decode",
            "extend": "extend", "mixed": "mixed"}[ctx.forward_mode]


# --- the decode CUDA-graph runner's bucket -------------------------------------------------------
def _reads(nodes) -> set:
    return {n.id for node in nodes for n in ast.walk(node)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _assigns(node, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Store)
               for n in ast.walk(node))


def _bucket_slice(method: ast.FunctionDef) -> Optional[ast.FunctionDef]:
    """``def _bucket(self, forward_batch)``: the ``if self.require_mlp_tp_gather:`` block of
    ``method`` that chooses ``bs``; every statement after it, in its block and the blocks
    around it, that can change what ``bs`` holds when the method goes on (one that assigns
    ``bs``, or a name such a statement reads: a backward slice, so an edit that re-chooses
    the bucket after the block is run, as Python runs it); and the assignments before it that
    those read (outer blocks first). Returns ``bs``."""
    def search(block, before, rest):
        for i, stmt in enumerate(block):
            if (isinstance(stmt, ast.If) and "require_mlp_tp_gather" in
                    {getattr(n, "attr", None) for n in ast.walk(stmt.test)}
                    and (_assigns(stmt, "bs") or _assigns(stmt, "index"))):
                return before + block[:i], stmt, block[i + 1:] + rest
            for inner in ("body", "orelse"):
                found = search(getattr(stmt, inner, None) or [], before + block[:i],
                               block[i + 1:] + rest) if isinstance(stmt, ast.If) else None
                if found:
                    return found
        return None

    found = search(method.body, [], [])
    if found is None:
        return None
    preceding, choice, rest = found
    after, flows = [], {"bs"}  # what decides bs at the method's end, read backwards
    for stmt in reversed(rest):
        if any(_assigns(stmt, name) for name in flows):
            after.insert(0, stmt)
            flows |= _reads([stmt])
    needed, kept = _reads([choice] + after), []
    for stmt in reversed(preceding):
        if isinstance(stmt, ast.Assign) and all(isinstance(t, ast.Name) for t in stmt.targets) \
                and {t.id for t in stmt.targets} & needed:
            kept.insert(0, stmt)
            needed |= _reads([stmt.value])
    body = [copy.deepcopy(s) for s in kept + [choice] + after]
    ret = ast.Return(ast.Name("bs", ast.Load()))
    ast.copy_location(ret, body[-1])
    fn = ast.FunctionDef("_a2a_gate_bucket", ast.arguments(
        posonlyargs=[], args=[ast.arg("self"), ast.arg("forward_batch")], kwonlyargs=[],
        kw_defaults=[], defaults=[]), body + [ret], [], None)
    return ast.copy_location(fn, method)


class _RunnerSelf(Strict):
    """The runner's ``self``: the fields given; a method of its class chain, compiled from the
    release, for any other name; else ``UnmodelledAttribute``."""

    def __init__(self, what: str, methods: Callable[[str], Optional[Callable]], **fields):
        super().__init__(what, **fields)
        object.__setattr__(self, "_methods", methods)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("_what", "_methods"):
            raise AttributeError(name)
        fn = self.__dict__["_methods"](name)
        if fn is None:
            return Strict.__getattr__(self, name)
        return fn


def _class_home(ns: FileNamespace, cls: Optional[str], depth: int = 0):
    """``(namespace, name)`` of the file that defines class ``cls`` as ``ns`` sees it (its own
    class, or one it imports, through re-exports such as a package's ``__init__.py``)."""
    if cls is None or depth > 8:
        return None
    if find_def(ns.path, cls) is not None:
        return ns, cls
    if cls in ns.imports:
        module, original = ns.imports[cls]
        path = ns.module_file(module)
        if path is not None:
            return _class_home(ns.namespace_of(path), original, depth + 1)
    return None


class GraphRunner:
    """One of the release's CUDA-graph runners (the decode runner, or the EAGLE draft runner
    for a speculative draft forward): the bucket each rank replays."""

    def __init__(self, path: Path, tag: str = "", methods=BUCKET_METHODS):
        self.path = Path(path)
        self.ns = FileNamespace(_root(path), path, STANDINS)
        for cls, name in methods:
            node = find_def(path, name, cls)
            if node is not None:
                break
        else:
            raise ReleaseCodeError(f"{path}: none of " + ", ".join(f"{c}.{m}" for c, m in methods))
        self.cls = cls
        sliced = _bucket_slice(node)
        if sliced is None:
            raise ReleaseCodeError(f"{rel_path(path)}:{node.lineno} {cls}.{name}() has no "
                                   f"`if self.require_mlp_tp_gather:` block choosing bs")
        self.fn = compile_def(sliced, path, self.ns, "_a2a_gate_bucket")
        self.source = (f"{rel_path(path)}:{sliced.body[0].lineno} {cls}.{name}() "
                       f"(its bucket choice){tag}")
        self._methods = {}

    def _method(self, name: str) -> Optional[Callable]:
        """Method ``name`` of the runner class or its bases (looked up as Python would, in
        the files the tree holds); static methods unbound."""
        if name not in self._methods:
            self._methods[name] = self._find(self.ns, self.cls, name)
        return self._methods[name]

    def _find(self, ns: FileNamespace, cls: str, name: str):
        node = find_def(ns.path, name, cls)
        if node is not None:
            fn = ns.method(cls, name)
            static = any(isinstance(d, ast.Name) and d.id == "staticmethod"
                         for d in node.decorator_list)
            return fn if static else (lambda *a, **k: fn(self._self, *a, **k))
        for base in getattr(find_def(ns.path, cls), "bases", []):
            home = _class_home(ns, getattr(base, "id", None))
            found = home and self._find(*home, name)
            if found is not None:
                return found
        return None

    def bucket(self, ctx: SGLangContext, capture_bs: Sequence[int], require_gather: bool,
               requests: int, gathered_requests: Optional[Sequence[int]]) -> int:
        """The batch size a rank with ``requests`` requests replays (its graph's bucket)."""
        k = ctx.tokens_per_req
        spec = _Backend("eagle" if ctx.speculative else "none")
        self._self = _RunnerSelf(
            f"{self.cls} (self)", self._method, require_mlp_tp_gather=require_gather,
            capture_bs=list(capture_bs), num_tokens_per_bs=k, captured_req_width=k,
            model_runner=Strict("model_runner", spec_algorithm=spec,
                                is_draft_worker=ctx.draft_forward))
        counts = None if gathered_requests is None else list(gathered_requests)
        batch = Strict("forward_batch", batch_size=requests,
                       global_num_tokens_cpu=None if counts is None else [n * k for n in counts],
                       original_global_num_tokens_cpu=counts)
        try:
            bs = self.fn(self._self, batch)
        except Exception as exc:  # noqa: BLE001 - the release's own code failed on this step
            raise ReleaseCodeError(f"{self.source} raised {type(exc).__name__}: {exc}") from exc
        if type(bs) is not int:
            raise ReleaseCodeError(f"{self.source} chose bucket {bs!r}, not an int")
        return bs
