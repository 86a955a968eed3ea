"""Routing policies: one module each, registered by name in `registry.BUILTIN`."""
