"""SGLang's own code the gate runs beside the dispatcher file, and where each piece lives.

Paths are under ``python/`` in a checkout, at the top of a wheel. ``NEEDED`` is one record per
piece: its homes, the first and last pinned release that has it (tests/meta/test_companions.py
checks every pinned release has exactly the pieces this table says), and what it decides.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Optional, Tuple

from ..releases.companions import Needed, parse
from ..sandbox.release_code import find_def

__all__ = ["RELEASES", "RELEASE_FILE", "COMMON", "OVERRIDES", "DP_ATTN", "SPEC_INFO", "MOE_HOOK",
           "SERVER_ARGS", "VERSION_FILES", "COMPANIONS", "NEEDED", "TOPOLOGY_ASSERT",
           "FORWARD_BATCH", "DP_ATTENTION", "DECODE_RUNNERS", "RUNNER_BASE", "RUNNER_PACKAGE", "PADDING_METHOD",
           "BUCKET_METHODS", "PADDING", "rel_path", "BUCKET_CHOICE", "DRAFT_RUNNER", "DRAFT_METHODS",
           "DRAFT_BUCKET_CHOICE", "flashinfer_assert", "GATHER_IMPORTERS"]

# Every release on the package index whose dispatcher file differs from the one before
# (0.5.11 = 0.5.10, 0.5.21 = 0.5.20, byte for byte).
RELEASES = ("0.5.10", "0.5.12", "0.5.13", "0.5.14", "0.5.15", "0.5.16", "0.5.17", "0.5.18",
            "0.5.19", "0.5.20", "0.5.22", "0.5.23")
RELEASE_FILE = "sglang/srt/layers/moe/token_dispatcher/flashinfer.py"
COMMON = "sglang/srt/utils/common.py"  # require_mlp_tp_gather()
OVERRIDES = "sglang/srt/arg_groups/overrides.py"  # the A2A cap derivation (0.5.22+)
DP_ATTN = ("sglang/srt/managers/scheduler_components/dp_attn.py",  # the scheduler's DP gather
           "sglang/srt/managers/scheduler_dp_attn_mixin.py")  # (its 0.5.10-0.5.12 home)
SPEC_INFO = "sglang/srt/speculative/spec_info.py"  # spec_scale_global_num_tokens (0.5.16+)
MOE_HOOK = "sglang/srt/arg_groups/moe_hook.py"  # server-arg checks of FlashInfer A2A (0.5.19+)
SERVER_ARGS = "sglang/srt/server_args.py"  # the same checks before 0.5.19
VERSION_FILES = ("sglang/version.py",)  # what release a tree says it is
# the forward batch's DP padding and the decode CUDA-graph runner (dispatcher/sglang/forward.py)
FORWARD_BATCH = "sglang/srt/model_executor/forward_batch_info.py"
DP_ATTENTION = "sglang/srt/layers/dp_attention.py"  # DpPaddingMode, set_dp_buffer_len_from_batch
DECODE_RUNNERS = ("sglang/srt/model_executor/runner/decode_cuda_graph_runner.py",  # 0.5.14+
                  "sglang/srt/model_executor/cuda_graph_runner.py")  # 0.5.10-0.5.13
RUNNER_BASE = "sglang/srt/model_executor/runner/base_cuda_graph_runner.py"  # _pad_to_bucket
RUNNER_PACKAGE = "sglang/srt/model_executor/runner/__init__.py"  # re-exports the runner classes
PADDING_METHOD = ("ForwardBatch", "prepare_mlp_sync_batch")
BUCKET_METHODS = (("DecodeCudaGraphRunner", "load_batch"), ("CudaGraphRunner", "replay_prepare"))
DRAFT_RUNNER = "sglang/srt/speculative/eagle_draft_cuda_graph_runner.py"  # a draft's buckets
DRAFT_METHODS = (("EAGLEDraftCudaGraphRunner", "execute"),  # 0.5.14+
                 ("EAGLEDraftCudaGraphRunner", "replay"))  # 0.5.10-0.5.13
COMPANIONS = ((COMMON, OVERRIDES) + DP_ATTN + (SPEC_INFO, MOE_HOOK, SERVER_ARGS, FORWARD_BATCH,
                                               DP_ATTENTION) + DECODE_RUNNERS
              + (RUNNER_BASE, RUNNER_PACKAGE, DRAFT_RUNNER))

_TOPOLOGY_NAMES = {"dp_size", "tp_size", "attn_dp_size", "enable_dp_attention", "attn_dp_enabled_of"}


def _names(node: ast.AST) -> set:
    return {getattr(n, "attr", None) or getattr(n, "id", None) for n in ast.walk(node)}


def flashinfer_assert(path: Path) -> Optional[Tuple[ast.expr, int]]:
    """The first ``assert`` on the topology (it reads dp/tp sizes or DP attention) directly
    under ``if <...a2a...> == "flashinfer":`` in ``path`` (how 0.5.13-0.5.22 refuse a
    topology), with its line."""
    return _flashinfer_assert(parse(path))


@functools.lru_cache(maxsize=64)
def _flashinfer_assert(tree: ast.Module) -> Optional[Tuple[ast.expr, int]]:
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)):
            continue
        left, comps = node.test.left, node.test.comparators
        name = left.attr if isinstance(left, ast.Attribute) else getattr(left, "id", "")
        if not ("a2a" in name and len(comps) == 1 and isinstance(comps[0], ast.Constant)
                and comps[0].value == "flashinfer" and isinstance(node.test.ops[0], ast.Eq)):
            continue
        for stmt in node.body:
            if isinstance(stmt, ast.Assert) and _names(stmt.test) & _TOPOLOGY_NAMES:
                return stmt.test, stmt.lineno
    return None


TOPOLOGY_ASSERT = "the assert under moe_a2a_backend == \"flashinfer\""
PADDING = "ForwardBatch.prepare_mlp_sync_batch"
BUCKET_CHOICE = "the decode CUDA-graph runner's replay (load_batch / replay_prepare)"
DRAFT_BUCKET_CHOICE = "the EAGLE draft CUDA-graph runner's replay (execute / replay)"


def _has_method(path: Path, cls: str, name: str) -> bool:
    return isinstance(find_def(path, name, cls), ast.FunctionDef)


def rel_path(path: Path) -> str:
    """``path`` from its ``sglang/srt/`` on, as messages name SGLang's files."""
    p = Path(path).as_posix()
    return p[p.index("sglang/srt/"):] if "sglang/srt/" in p else p


# The files whose imports of a piece say where the engine takes it from (``Needed.imported_by``):
# the dispatcher file, the scheduler's gather, the forward batch and the CUDA-graph runners.
GATHER_IMPORTERS = (RELEASE_FILE,) + DP_ATTN + (FORWARD_BATCH,) + DECODE_RUNNERS + (DRAFT_RUNNER,)

NEEDED = (
    Needed("require_mlp_tp_gather", (COMMON,), "0.5.10",
           decides="whether the scheduler gathers every DP group's count",
           imported_by=GATHER_IMPORTERS),
    Needed("_update_gather_batch", DP_ATTN, "0.5.10",
           decides="the list get_dp_global_num_tokens() returns"),
    Needed("spec_scale_global_num_tokens", (SPEC_INFO,), "0.5.16",
           decides="a speculative forward's counts", imported_by=(FORWARD_BATCH,)),
    Needed("should_skip_scheduler_all_gather", DP_ATTN, "0.5.19",
           decides="whether the DP all-gather runs"),
    Needed("flashinfer_a2a_max_dispatch_tokens_per_rank", (OVERRIDES,), "0.5.22",
           decides="the A2A cap the server derives", imported_by=(RELEASE_FILE,)),
    Needed(TOPOLOGY_ASSERT, (MOE_HOOK, SERVER_ARGS), "0.5.13",  # 0.5.23's calls the function
           decides="which topologies may use FlashInfer's A2A",
           finder=lambda p: flashinfer_assert(p) is not None),
    Needed("_flashinfer_a2a_topology_is_supported", (MOE_HOOK,), "0.5.23",
           decides="which topologies may use FlashInfer's A2A"),
    Needed(PADDING, (FORWARD_BATCH,), "0.5.10",
           decides="the padded list every rank publishes and the rows each DP group holds",
           finder=lambda p: _has_method(p, *PADDING_METHOD)),
    Needed(BUCKET_CHOICE, DECODE_RUNNERS, "0.5.10",
           decides="the CUDA-graph bucket each rank replays",
           finder=lambda p: any(_has_method(p, c, m) for c, m in BUCKET_METHODS)),
    Needed(DRAFT_BUCKET_CHOICE, (DRAFT_RUNNER,), "0.5.10",
           decides="the CUDA-graph bucket each rank replays in a speculative draft forward",
           finder=lambda p: any(_has_method(p, c, m) for c, m in DRAFT_METHODS)),
)
