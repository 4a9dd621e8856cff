"""The suite's options, profiles, fixtures and hooks are the gate's pytest plugin,
``dispatcher/plugin/__init__.py``, so the installed gate (``a2a-gate``, or ``pytest -p dispatcher.plugin
--pyargs dispatcher.suite``) and this checkout run the same suite the same way."""
pytest_plugins = ["dispatcher.plugin"]
