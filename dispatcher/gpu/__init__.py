"""Where ranks run on GPUs: the environment and hardware probes (``env``), the one place
FlashInfer is imported (``flashinfer``), the stand-in MoE in torch (``torch_ops``), the
per-rank checks both tiers make (``checks``), every rank in one process on one GPU
(``single``) and one process per rank (``rank_pool``). Imported only where torch is."""
