"""The bug classes of SGLang's FlashInfer dispatcher, each as a check on one step.

Every class is one record: a regime (``applies``, and the strategy that draws its worlds and
contexts, ``steps``), a check on what every EP rank's own ``dispatch()`` did in it, the first
release that shipped it with the shrunk step it fails on there, and the words that failure
must say (``tests/sglang/test_releases.py`` re-measures both). A check returns ``None``
or the violation in words, with what SGLang itself saw (the ``dp_global`` each rank was
handed, the cap and workspace it constructed, the expert id it marks padding with) and a
replay line. docs/sglang.md gives the public record of each class.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import strategies.sglang as regimes
from ..model.sglang_context import SGLangContext
from ..model.generations import PINNED_RELEASES_GENERATION, replay_flag
from ..model.mnnvl import workspace_size_per_rank
from ..model.world import World
from ..sizing import NotApplicable
from .forward import ReleaseCodeError
from .loader import Outcome, SGLangRelease
from .report import describe_outcomes, describe_sources

__all__ = ["BugClass", "BUG_CLASSES", "BUGS", "HAZARDS", "RUNTIME_CLASSES", "describe_outcomes", "describe_sources",
           "describe_step", "check_step", "class_problem", "step_problem"]


@dataclass(frozen=True)
class BugClass:
    key: str  # the regime name and the column id
    title: str
    record: str  # where the public record of it is
    applies: Callable[[World, SGLangContext], bool]  # is a step in this class's regime
    check: Callable[[SGLangRelease, World, SGLangContext, List[Outcome]], Optional[str]]
    steps: Callable[[], object]  # the Hypothesis strategy of its regime's (world, ctx) steps
    # the first release that ships it and the shrunk step it fails on there (measured), and
    # what that failure must say
    first_seen: Tuple[str, World, SGLangContext]
    words: str
    # A hazard, not a bug: the dispatcher would break only if another component broke its
    # invariant (a context SGLang's own code does not produce). Its own column of the
    # verdict table ("hardening"), never a failing test.
    hazard: bool = False
    # Its failure is an unsound launch (a runtime some rank passes); the other classes (the cap
    # built, padding marks, tightness) do not change what a launch sees.
    runtime: bool = False


def describe_step(release: SGLangRelease, world: World, ctx: SGLangContext,
                  outs: Sequence[Outcome]) -> str:
    """The world in words, what SGLang saw and did on each rank, and the replay line."""
    return (f"world:\n{world.describe()}\n  context: {ctx!r}\n"
            f"  what SGLang {release.label} saw and did:\n{describe_outcomes(outs, world)}\n"
            f"{describe_sources(release)}\n"
            f"replay: python -m dispatcher{replay_flag(world.flashinfer)}"
            f"{release.companions.replay_flag if release.companions else ''} --policy {shlex.quote(release.spec)} "
            f"--context \"{ctx!r}\" \"{world!r}\"")


def _launched(outs: Sequence[Outcome]) -> List[Outcome]:
    return [o for o in outs if o.launch is not None]


def _together(outs: Sequence[Outcome]) -> Optional[str]:
    """Every rank launches, or none does: a rank that launches alone hangs its peers."""
    launched = _launched(outs)
    if launched and len(launched) != len(outs):
        alone = [r for r, o in enumerate(outs) if o.launch is not None]
        return f"ranks {alone} launch the A2A and the others do not: the launched ranks hang"
    return None


def _runtime_problems(world: World, outs: Sequence[Outcome], rows_world: World) -> Optional[str]:
    """Rank-invariant, an int, >= 1 and covering every rank's rows (of ``rows_world``)."""
    problem = _together(outs)
    if problem:
        return problem
    values = [o.runtime for o in _launched(outs)]
    if not values:
        return None
    if len(set(values)) > 1:
        return f"ranks pass different runtimes {values}: they corrupt each other (NaN, IMA)"
    runtime = values[0]
    if type(runtime) is not int or runtime < 1:
        return f"runtime {runtime!r} is not a positive int: FlashInfer rejects it"
    if runtime < rows_world.max_rows:
        return (f"runtime {runtime} < {rows_world.max_rows} rows on rank "
                f"{rows_world.rows_per_rank.index(rows_world.max_rows)}: FlashInfer writes "
                f"past that rank's slots, silently")
    return None


def _sp_prescatter(release, world, ctx, outs):
    problem = _runtime_problems(world, outs, world)
    if problem:
        return problem
    launched = _launched(outs)
    if not (world.payload_fits_cap and launched) or launched[0].runtime == world.ideal_runtime:
        return None
    runtime, cap = launched[0].runtime, launched[0].launch.max_num_tokens
    why = ("the pre-scatter count" if runtime == max(world.dp_global or (0,))
           else "the static cap" if runtime == cap else "not the post-scatter rows")
    return (f"runtime {runtime} != {world.ideal_runtime}, the post-scatter rows: {why}, so "
            f"every SP rank moves and computes {runtime / world.ideal_runtime:.1f}x the rows "
            f"(past the cap: a crash)")


def _constructed_cap(release, world, ctx, outs):
    expected = world.max_num_tokens if ctx.cap_from_env else ctx.expected_cap_when_derived
    for r, o in enumerate(outs):
        rec = o.launch
        if rec is None:
            continue
        if rec.max_num_tokens != expected:
            how = ("the per-rank cap set in SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK"
                   if ctx.cap_from_env else
                   f"max(chunked_prefill_size={ctx.chunked_prefill_size}, 4096)")
            return (f"EP rank {r} constructed MoeAlltoAll(max_num_tokens={rec.max_num_tokens}) "
                    f"but the cap is {expected} ({how})")
        if rec.payload_bytes_per_token is not None:
            need = workspace_size_per_rank(world.ep_size, rec.max_num_tokens,
                                           rec.payload_bytes_per_token, world.moe.combine_bytes)
            if rec.workspace_size_per_rank < need:
                return (f"EP rank {r} sized its workspace {rec.workspace_size_per_rank} B but "
                        f"the payload it dispatches needs {need} B at its cap")
    return None


def _cuda_graph_buckets(release, world, ctx, outs):
    try:
        replayed = release.replay_world(world, ctx)
    except ReleaseCodeError as exc:
        return str(exc)
    problem = _runtime_problems(world, outs, replayed)
    if problem:
        return f"replaying buckets {list(replayed.group_tokens)}: {problem}"
    return None


def _sound_launch(release, world, ctx, outs):
    """The classes whose damage is an unsound launch: checked as such, nothing more (against
    the rows the release's own forward batch padded each rank to)."""
    try:
        rows = release.padded_world(world, ctx)
    except ReleaseCodeError as exc:
        return str(exc)
    return _runtime_problems(world, outs, rows)


def _padding(release, world, ctx, outs):
    for r, o in enumerate(outs):
        rec = o.launch
        if rec is None:
            continue
        mark = rec.invalid_token_expert_id
        if mark is None:
            return (f"EP rank {r} dispatches without invalid_token_expert_id: padding rows "
                    f"keep garbage expert ids and the MoE computes on them (NaN)")
        if type(mark) is not int or 0 <= mark < world.moe.num_experts:
            return (f"EP rank {r} marks padding with expert id {mark!r}, a real expert of "
                    f"{world.moe.num_experts}")
    return None


def _extend_over_cap(release, world, ctx, outs):
    problem = _together(outs)
    if problem:
        return problem
    for r, o in enumerate(outs):
        rec = o.launch
        if rec is None:
            continue
        if type(rec.runtime) is int and type(rec.max_num_tokens) is int \
                and rec.runtime > rec.max_num_tokens:
            return (f"EP rank {r} launched runtime {rec.runtime} over its cap "
                    f"{rec.max_num_tokens}: the server crashes in FlashInfer 0.7.2 (at dispatch "
                    f"past MoeAlltoAll's cap check; the kernel's own size check counts the "
                    f"combine region too, so up to about 2x the cap fails only at combine)")
        if rec.runtime < world.max_rows:
            return (f"EP rank {r} launched runtime {rec.runtime} for {world.max_rows} rows: a "
                    f"silent overflow")
    return None


def _eager(ctx: SGLangContext) -> bool:
    return ctx.forward_mode == "decode" and not ctx.draft_forward


def _step(ep_size, dp_size, group_tokens, max_num_tokens) -> World:
    """A measured step of a pinned release (on the generation the releases run on)."""
    return World(ep_size=ep_size, dp_size=dp_size, group_tokens=group_tokens,
                 max_num_tokens=max_num_tokens, flashinfer=PINNED_RELEASES_GENERATION)


_COLLAPSING = SGLangContext(**regimes.COLLAPSING)
BUG_CLASSES: Dict[str, BugClass] = {c.key: c for c in (
    BugClass("sp-prescatter", "SP runtime above the post-scatter rows", "SGLang #25685",
             lambda w, c: _eager(c) and not w.dp_attention and w.attn_tp_size > 1, _sp_prescatter,
             regimes.sp_prescatter_steps, ("0.5.10", _step(2, 1, (1,), 1), SGLangContext()),
             "the pre-scatter count"),
    BugClass("constructed-cap", "constructed cap", "SGLang #25907, #26643",
             lambda w, c: True, _constructed_cap, regimes.constructed_cap_steps,
             ("0.5.10", _step(2, 1, (1,), 1), SGLangContext()), "max_num_tokens=2"),
    BugClass("collapsed-dp-global", "collapsed dp_global", "SGLang #27945",
             lambda w, c: _eager(c) and w.dp_attention and w.payload_fits_cap, _sound_launch,
             regimes.collapsed_dp_global_steps, ("0.5.10", _step(2, 2, (0, 1), 1), _COLLAPSING),
             "different runtimes", runtime=True),
    BugClass("cuda-graph-buckets", "per-rank CUDA-graph buckets",
             "SGLang #29461 -> #30242 -> #30450",
             lambda w, c: c.forward_mode == "replay" and w.dp_attention, _cuda_graph_buckets,
             regimes.cuda_graph_bucket_steps,
             ("0.5.10", _step(2, 2, (2, 0), 2), replace(_COLLAPSING, forward_mode="replay")),
             "replaying buckets [2, 1]", runtime=True),
    BugClass("all-idle", "all-idle DP step", "SGLang #22394",
             lambda w, c: max(w.group_tokens) == 0, _sound_launch, regimes.all_idle_steps,
             ("0.5.15", _step(2, 2, (0, 0), 1), SGLangContext(skip_all_gather=True)),
             "runtime 0", runtime=True),
    BugClass("stale-draft", "stale draft dp_global (hazard)", "SGLang's MoRI recv-bound test",
             lambda w, c: c.stale_by > 0, _sound_launch, regimes.stale_draft_steps,
             ("0.5.10", _step(1, 1, (2,), 2),
              SGLangContext(speculative=True, draft_forward=True, stale_by=1)),
             "runtime 1 < 2 rows", hazard=True),  # a hazard: "exposed"
    BugClass("padding-slots", "padding slots unmarked", "SGLang #24850",
             lambda w, c: True, _padding, regimes.padding_slot_steps,
             ("0.5.10", _step(1, 1, (1,), 1), SGLangContext()),
             "without invalid_token_expert_id"),
    BugClass("extend-over-cap", "a batch over the cap", "SGLang #39818",
             lambda w, c: c.forward_mode in ("decode", "extend", "mixed") and not w.payload_fits_cap
             and not c.draft_forward, _extend_over_cap, regimes.extend_over_cap_steps,
             ("0.5.10", _step(1, 1, (2,), 1), SGLangContext(forward_mode="extend")),
             "over its cap 1", runtime=True),
)}


BUGS = tuple(k for k, c in BUG_CLASSES.items() if not c.hazard)
RUNTIME_CLASSES = tuple(k for k, c in BUG_CLASSES.items() if c.runtime)
HAZARDS = tuple(k for k, c in BUG_CLASSES.items() if c.hazard)


def class_problem(release: SGLangRelease, key: str, world: World, ctx: SGLangContext,
                  outs: Sequence[Outcome]) -> Optional[str]:
    """Class ``key``'s violation in a step whose outcomes are ``outs``, or None (also when the
    step is outside the class's regime)."""
    if not BUG_CLASSES[key].applies(world, ctx):
        return None
    return BUG_CLASSES[key].check(release, world, ctx, outs)


def check_step(release: SGLangRelease, key: str, world: World, ctx: SGLangContext) -> Optional[str]:
    """The violation of class ``key`` in this step (with the step described), or None
    (also when the step is outside the class's regime)."""
    if not BUG_CLASSES[key].applies(world, ctx):
        return None
    try:
        outs = release.step(world, ctx)
    except NotApplicable:
        return None
    problem = class_problem(release, key, world, ctx, outs)
    if problem is None:
        return None
    return f"[{key}] {problem}\n{describe_step(release, world, ctx, outs)}"


def step_problem(release: SGLangRelease, world: World, ctx: SGLangContext,
                 outs: Sequence[Outcome]) -> Optional[str]:
    """What is wrong with any step SGLang can produce, whatever its class: every rank takes
    the same path (launch, routed around the A2A, or an error); SGLang raises only where no
    valid runtime exists (or in a mode it refuses); a launch is an int >= 1, the same on every
    rank, within the cap SGLang built and covering the rows each rank holds (the replayed
    buckets, or the padded step). None when the step is sound."""
    kinds = {"launch" if o.launch else "around" if o.routed_around else "error" for o in outs}
    if len(kinds) > 1:
        return f"ranks take different paths {sorted(kinds)}: the others hang"
    if kinds == {"error"}:
        refused_mode = ctx.skip_all_gather and world.dp_attention and world.ep_size > 1
        if world.payload_fits_cap and not refused_mode:
            return "SGLang raised in a valid step"
        return None
    if kinds == {"around"}:
        return None
    values = [o.runtime for o in outs]
    if len(set(values)) > 1:
        return f"ranks pass different runtimes {values}"
    runtime, cap = values[0], outs[0].launch.max_num_tokens
    if type(runtime) is not int or runtime < 1:
        return f"runtime {runtime!r} is not an int >= 1"
    if runtime > cap:
        return (f"runtime {runtime} over the cap {cap} SGLang built: FlashInfer's assert "
                f"crashes the server")
    rows = release.forward_world(world, ctx)  # the replayed buckets, or the padded step
    if runtime < rows.max_rows:
        return f"runtime {runtime} < {rows.max_rows} rows: silent overflow"
    return None
