"""The top layer: the aiohttp listeners and everything that serves one request or runs the process.

`app` is the composition root (it builds the `RouterContext` and the two applications), `handlers` the
OpenAI-compatible API and the admin API, `route` what every data path shares (the request's description and
the pick), `proxy` the forwarding, `supervisor` the multi-process mode. Nothing below this package imports it.
"""
