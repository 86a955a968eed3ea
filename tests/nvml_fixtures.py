"""Fixtures for NVML tests: the fake driver library, the fake GPU's state file, and sampler child processes.

Imported by the test modules that use them (not from conftest.py, so only NVML tests pay for gcc).
See tests/fake_nvml/__init__.py for why the sampler runs in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fake_nvml import compile_fake

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the compiled fake libnvidia-ml.so.1, built once per session."""
    return compile_fake(tmp_path_factory.mktemp("fake-nvml")).parent


class FakeGpu:
    """The fake library's state file (read by it on every call) and its call log."""

    def __init__(self, directory: Path) -> None:
        self.state_path = directory / "gpu.state"
        self.log_path = directory / "nvml-calls.log"
        self._state: dict[str, object] = {}
        self.set()

    def set(self, **values: object) -> None:
        """Change the GPU; takes effect at the next NVML call. `**{"key.1": v}` sets it for device 1 only."""
        self._state.update(values)
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text("".join(f"{k}={v}\n" for k, v in self._state.items()))
        os.replace(tmp, self.state_path)  # the library never reads a half-written file

    def calls(self) -> list[str]:
        """NVML functions called so far, in order."""
        return self.log_path.read_text().split() if self.log_path.exists() else []


@pytest.fixture
def fake_gpu(tmp_path: Path) -> FakeGpu:
    return FakeGpu(tmp_path)


class SamplerProcess:
    """An NvmlSampler in a child process that sees `lib_dir` as the only place for libnvidia-ml.so.1."""

    def __init__(self, lib_dir: Path, gpu: FakeGpu, stderr_path: Path) -> None:
        self.stderr_path = stderr_path
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(lib_dir),
            "FAKE_NVML_STATE": str(gpu.state_path),
            "FAKE_NVML_LOG": str(gpu.log_path),
            "PYTHONWARNINGS": "error",  # as strict as the test suite itself
        }
        self._stderr = stderr_path.open("w")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from tests.fake_nvml import serve; serve()"],
            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
        )

    def request(self, op: str, **args: Any) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, f"sampler process died:\n{self.stderr_path.read_text()}"
        return json.loads(line)

    def ok(self, op: str, **args: Any) -> Any:
        reply = self.request(op, **args)
        assert "ok" in reply, reply
        return reply["ok"]

    def sample(self) -> dict[str, Any]:
        return self.ok("sample")

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def stop(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()


@pytest.fixture
def start_sampler(fake_nvml_dir: Path, fake_gpu: FakeGpu, tmp_path: Path) -> Iterator[Any]:
    """start_sampler(lib_dir=fake) -> SamplerProcess, not yet initialised (send it "init")."""
    started: list[SamplerProcess] = []

    def start(lib_dir: Path = fake_nvml_dir) -> SamplerProcess:
        proc = SamplerProcess(lib_dir, fake_gpu, tmp_path / f"sampler-{len(started)}.stderr")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()
