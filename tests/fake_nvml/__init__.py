"""A fake NVIDIA driver library for tests, and the subprocess that drives the real sampler against it.

`fake_nvml.c` is a stand-in for `libnvidia-ml.so.1` (see its header for the state file it reads on every
call). It is compiled with gcc and found by the dynamic loader through LD_LIBRARY_PATH, so the real `pynvml`
runs unmodified: its ctypes structs, version words and error mapping are what is under test too.

The sampler runs in a child process (`serve`), not in pytest's: pynvml keeps the library it loaded
module-global for the life of the process, so a test for "no library at all" needs a process that never
loaded one, and the fake must not leak into other tests that expect no NVML. The child answers one JSON
request per line on stdin with one JSON line on stdout, so a test steps it sample by sample and changes the
fake GPU in between without sleeping.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("fake_nvml.c")
SONAME = "libnvidia-ml.so.1"


def compile_fake(out_dir: Path) -> Path:
    """Build the fake library into out_dir (which then goes on LD_LIBRARY_PATH); its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / SONAME
    subprocess.run(
        ["gcc", "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
         f"-Wl,-soname,{SONAME}", "-o", str(target), str(SOURCE)],
        check=True, capture_output=True, text=True,
    )
    return target


def serve() -> None:
    """The child's loop. Requests: {"op": "init", "index": N} | {"op": "sample"} | {"op": "close"}.

    Replies: {"ok": ...} with the result, or {"error": exception class name, "message": str(exception)}.
    """
    import asyncio
    import dataclasses
    import json
    import logging
    import sys

    from worker.nvml import NvmlSampler

    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)
    loop = asyncio.new_event_loop()
    sampler: NvmlSampler | None = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["op"] == "init":
                sampler = NvmlSampler(request.get("index", 0))
                result: object = {"name": sampler.name, "uuid": sampler.uuid}
            elif request["op"] == "sample":
                assert sampler is not None
                result = dataclasses.asdict(loop.run_until_complete(sampler.sample()))
            elif request["op"] == "close":
                assert sampler is not None
                sampler.close()
                result = None
            else:
                raise ValueError(f"unknown op {request['op']!r}")
            reply: dict[str, object] = {"ok": result}
        except Exception as exc:  # reported to the test, which asserts on it
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)
    loop.close()
