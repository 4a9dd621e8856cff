"""How a rank pool's example fails: each exception names what the ranks reported (a start that
failed, a rank that crashed or did not answer, a mismatch, a sizing error, FlashInfer's refusal,
a CUDA fault, an engine's error, any other error)."""
from __future__ import annotations

__all__ = ["RankPoolError", "PoolStartFailed", "RankCrashed", "RankTimeout", "RemoteMismatch",
           "RemoteSizingError", "RemoteEngineError", "RemoteRefused", "RemoteKernelFault",
           "RemoteError"]


class RankPoolError(AssertionError):
    """Base for failures reported by the pool."""


class PoolStartFailed(RankPoolError):
    """The ranks could not start (bad environment, NCCL, FlashInfer); not retried."""


class RankCrashed(RankPoolError):
    pass


class RankTimeout(RankPoolError):
    pass


class RemoteMismatch(RankPoolError):
    """The real kernels returned something other than the reference."""


class RemoteSizingError(RankPoolError):
    """The ranks' agreed validation refused the runtime (no kernel was launched)."""


class RemoteRefused(RankPoolError):
    """FlashInfer 0.7.4's dispatch op refused a rank's call (its own rows exceed its runtime);
    the ranks it accepted would wait on it until ``timeout_sec`` and trap. The pool reports it
    with the world and keeps every rank in step (none is left spinning)."""


class RemoteKernelFault(RankPoolError):
    """A CUDA error on a rank: its context is dead; the pool is rebuilt."""


class RemoteEngineError(RankPoolError):
    """The engine's own code (SGLang's dispatch()) raised on every rank before any kernel
    launched: the ranks are still in step, the pool is kept."""


class RemoteError(RankPoolError):
    """A Python exception on a rank (e.g. a FlashInfer argument check). The pool is kept when
    every rank answered (each rank waits for its own kernels first, so none is left in one);
    rebuilt when a rank did not answer: it may wait in a collective the failed rank never
    reached."""


def _is_cuda_fault(exc: BaseException, text: str) -> bool:
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in text or "illegal" in text
