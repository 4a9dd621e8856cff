"""FlashInfer itself, as source: the releases' A2A files (``fetch``), the API each generation
offers (``api``) and its host layout code built for the CPU (``host_layout``)."""
