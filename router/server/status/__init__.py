"""The status page on the admin listener (issue #20): every endpoint of every model with its state, load,
telemetry and recent latencies, the admission queues, recent routing decisions, and drain/resume buttons,
updating every second. Plain HTML, one small script and one style sheet, all served by the router.

- page.py: the routes, the JSON feed built from the router's live objects, the sampler task;
- history.py: the bounded recorder of the last minutes (sparklines, TTFT and inter-token percentiles);
- sessions.py: the login form's session cookie and CSRF token, for browsers (the admin token otherwise);
- assets/: index.html, login.html, status.js, status.css, favicon.svg (package data).
"""
