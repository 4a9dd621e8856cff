"""The exact CPU model of FlashInfer's MoE all-to-all (``a2a``) and the seeded tensors,
stand-in MoE and reference it is checked against (``inputs``), numpy only; and that model as
FlashInfer 0.7.2's ``MoeAlltoAll`` for a rank pool without a GPU, over the pool's process group
(``gloo``: imports torch where it is used)."""
