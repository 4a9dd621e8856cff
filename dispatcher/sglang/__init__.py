"""SGLang's own dispatcher file as the policy under test: the stand-ins for what it reads
(``standins``), loading it in a sandbox as a policy (``loader``), fetching and verifying
release files (``fetch``) and the per-release verdict table (``verdicts``).

    python -m dispatcher.sglang fetch 0.5.10 0.5.23    # pre-fill the verified cache
"""
