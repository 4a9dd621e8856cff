"""Where the code under test comes from: the verified release caches (``wheels``), and the tree
under test with the engine's own code beside its dispatcher file (``tree``, ``companions``).
Read, never run here: running it is ``dispatcher.sandbox``'s."""
