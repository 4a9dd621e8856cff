"""The exact CPU model of FlashInfer's MoE all-to-all (``a2a``) and the seeded tensors,
stand-in MoE and reference it is checked against (``inputs``). numpy only."""
