"""The pure model: the world (``world``), FlashInfer's byte layout (``workspace``), the
checks before launch (``validation``), the properties (``properties``) and the safe reader
of a world's repr (``parse``). Nothing here runs a kernel or imports torch."""
