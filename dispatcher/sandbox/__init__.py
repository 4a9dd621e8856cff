"""What runs code the gate did not write: the stand-ins an engine file runs on (``standins``,
``release_code``, ``engine_tensors``) and the bounded child processes every call into such code
goes through (``procs``). What code is run comes from ``dispatcher.releases``."""
