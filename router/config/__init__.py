"""The bottom layer: the config file's reader and its building blocks.

`settings` reads one YAML file into frozen dataclasses and validates it; `durations`, `presets` and
`redaction` are the pure helpers it (and the components that parse their own blocks) build on.
"""
