"""vLLM's own FlashInfer NVLink prepare/finalize as the policy under test: stand-ins for what
it reads (``standins``), loading it as an engine policy (``loader``), fetching and verifying
release files (``fetch``) and the per-release verdict table (``verdicts``).

    python -m dispatcher.vllm fetch 0.18.0 0.33.0      # pre-fill the verified cache
"""
