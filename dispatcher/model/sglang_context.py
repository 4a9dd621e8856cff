"""What an SGLang forward step reads beyond the world's topology (the ``sglang:`` policies'
second input; ``strategies.sglang_contexts()`` draws it).

Each field is a switch SGLang really has, and each one opens a regime its history had a bug
in (docs/sglang.md lists them with the PRs):

- ``forward_mode``: eager ``decode``, ``extend`` / ``mixed`` (prefill in the batch), CUDA-graph
  ``capture``, and ``replay`` (a decode step replaying the graph captured for its bucket, so
  the runtime is the one baked at capture: SGLang #30242);
- ``moe_dense_tp_size`` / ``enable_dp_lm_head``: decide SGLang's ``require_mlp_tp_gather()``;
  when it is False under DP attention the scheduler records only the local count
  (SGLang #27945) and picks CUDA-graph buckets per rank (#30242);
- ``skip_all_gather``: ``SGLANG_SCHEDULER_SKIP_ALL_GATHER``: no all-gather, so idle DP ranks
  run an idle batch even when every rank is idle (the only way an all-idle step reaches
  dispatch, SGLang #22394);
- ``draft_forward``: a speculative draft forward (draft decode, draft extend, multi-layer
  EAGLE), ``tokens_per_req`` tokens per request (``topk``, ``speculative_num_draft_tokens``,
  ``num_steps + 1``); SGLang gathers the request counts fresh and scales them by it
  (``dispatcher/sglang/scheduler.py``), so ``group_tokens`` is a multiple of it;
- ``stale_by``: the hardening column's hazard only: the draft is handed the target step's
  list, ``stale_by`` tokens fewer per busy group than it holds (SGLang never does this under
  DP attention; its MoRI test does it without DP attention, where FlashInfer's A2A is refused);
- ``cap_from_env``: ``SGLANG_FLASHINFER_NUM_MAX_DISPATCH_TOKENS_PER_RANK`` set to the world's
  cap; otherwise SGLang derives its cap, which must be ``max(chunked_prefill_size, 4096)``
  (SGLang #26643);
- ``sp_prefill_a2a``: the SP-prefill A2A server arg of newer releases.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .world import short_repr

__all__ = ["SGLangContext", "FORWARD_MODES", "CAPTURE_SIZES", "DERIVED_CAP_FLOOR"]

FORWARD_MODES = ("decode", "extend", "mixed", "capture", "replay")
# SGLang's default decode CUDA-graph batch sizes (the buckets a replayed step is padded to)
CAPTURE_SIZES: Tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96,
                                  104, 112, 120, 128, 136, 144, 152, 160, 168, 176, 184, 192,
                                  200, 208, 216, 224, 232, 240, 248, 256)
DERIVED_CAP_FLOOR = 4096  # max_running_requests per DP worker is capped at 4096 (SGLang #26643)


@dataclass(frozen=True, repr=False)
class SGLangContext:
    forward_mode: str = "decode"
    speculative: bool = False
    draft_forward: bool = False
    tokens_per_req: int = 1
    stale_by: int = 0
    moe_dense_tp_size: Optional[int] = None
    enable_dp_lm_head: bool = False
    skip_all_gather: bool = False
    cap_from_env: bool = True
    chunked_prefill_size: int = 8192
    sp_prefill_a2a: bool = False

    def __post_init__(self):
        if self.forward_mode not in FORWARD_MODES:
            raise ValueError(f"forward_mode {self.forward_mode!r} not in {FORWARD_MODES}")
        for name in ("speculative", "draft_forward", "enable_dp_lm_head", "skip_all_gather",
                     "cap_from_env", "sp_prefill_a2a"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("tokens_per_req", "stale_by", "chunked_prefill_size"):
            if type(getattr(self, name)) is not int:
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        if not 1 <= self.chunked_prefill_size <= 1 << 24:
            raise ValueError(f"chunked_prefill_size={self.chunked_prefill_size} must be in "
                             f"1..{1 << 24}")
        if self.draft_forward and not self.speculative:
            raise ValueError("a draft forward needs speculative=True")
        if self.tokens_per_req < 1 or (self.tokens_per_req > 1 and not self.draft_forward):
            raise ValueError("tokens_per_req >= 1, and > 1 only in a draft forward")
        if self.stale_by < 0 or (self.stale_by and not self.draft_forward):
            raise ValueError("stale_by >= 0, and > 0 only in a draft forward")
        if self.moe_dense_tp_size not in (None, 1):
            raise ValueError("moe_dense_tp_size is None or 1 (SGLang asserts it)")

    __repr__ = short_repr

    def _repr_pretty_(self, printer, cycle):  # Hypothesis/IPython: print the one-line replay
        printer.text(repr(self))

    @property
    def expected_cap_when_derived(self) -> int:
        """The cap SGLang must derive without the env var (SGLang #26643)."""
        return max(self.chunked_prefill_size, DERIVED_CAP_FLOOR)
