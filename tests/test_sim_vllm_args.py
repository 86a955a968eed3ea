"""`fleetroute sim --vllm ...`: the simulator reads a vLLM OpenAI-server command line, so it can stand in for
the vLLM image (the chart's worker pods in tests/test_cluster_in_a_box.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import aiohttp
import pytest

from loadtest.host import free_port
from worker.sim.cli import apply_vllm_args

ROOT = Path(__file__).resolve().parent.parent

# What helm/fleetroute renders for a pool (templates/worker/deployment.yaml), FP8 and speculative decoding on.
CHART_ARGS = [
    "--model=meta-llama/Llama-3.1-8B-Instruct", "--served-model-name", "llama-3-8b", "meta-llama/Llama-3.1-8B-Instruct",
    "--host=0.0.0.0", "--port=8000", "--tensor-parallel-size=1", "--enable-prefix-caching", "--kv-cache-dtype=fp8",
    "--no-enable-chunked-prefill", "--gpu-memory-utilization=0.92", "--max-model-len=16384",
    "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--max-num-seqs", "128",
]


def _args() -> argparse.Namespace:
    return argparse.Namespace(model="llama-3-8b", host="127.0.0.1", port=8000, seed=0, max_model_len=8192,
                              max_num_seqs=256, max_num_batched_tokens=8192, no_prefix_caching=False)


def test_the_charts_vllm_arguments_become_the_sims_settings():
    args = _args()
    not_modelled, ignored = apply_vllm_args(args, CHART_ARGS)
    assert (args.model, args.aliases, args.model_path) == (
        "llama-3-8b", ("meta-llama/Llama-3.1-8B-Instruct",), "meta-llama/Llama-3.1-8B-Instruct")
    assert (args.host, args.port, args.max_model_len, args.max_num_seqs) == ("0.0.0.0", 8000, 16384, 128)
    assert args.no_prefix_caching is False and args.kv_cache_dtype == "fp8"
    assert not_modelled == ["--tensor-parallel-size", "--gpu-memory-utilization", "--enable-chunked-prefill",
                            "--speculative-config"]
    assert ignored == []


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        pytest.param(["Qwen/Qwen2.5-1.5B-Instruct", "--port", "9000"], {"model": "Qwen/Qwen2.5-1.5B-Instruct",
                     "aliases": (), "port": 9000, "host": "0.0.0.0"}, id="vllm-serve-positional-model"),
        pytest.param(["--model", "m", "--no-enable-prefix-caching", "--max-model-len", "8k"],
                     {"no_prefix_caching": True, "max_model_len": 8000}, id="no-prefix-caching-and-8k"),
        pytest.param(["--model", "m", "--max-model-len=32K"], {"max_model_len": 32768}, id="binary-K"),
    ],
)
def test_vllm_forms(argv, expect):
    args = _args()
    apply_vllm_args(args, argv)
    assert {k: getattr(args, k) for k in expect} == expect


def test_unknown_arguments_are_ignored_and_named():
    args = _args()
    _, ignored = apply_vllm_args(args, ["--model", "m", "--dtype", "bfloat16", "--trust-remote-code"])
    assert args.model == "m" and ignored == ["--dtype", "bfloat16", "--trust-remote-code"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'", id="kv-dtype"),
        pytest.param(["--gpu-memory-utilization", "1.5"], "must be in (0, 1], got 1.5", id="gpu-mem"),
        pytest.param(["--speculative-config", "[1]"], "must be a JSON object", id="spec-config"),
        pytest.param(["a", "--model", "b"], "two models: 'a' and --model 'b'", id="two-models"),
    ],
)
def test_values_vllm_refuses_are_refused(argv, message):
    with pytest.raises(ValueError, match="vLLM arguments: .*" + message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        apply_vllm_args(_args(), argv)


async def test_the_sim_serves_a_vllm_command_line():
    port = free_port()
    argv = [a.replace("0.0.0.0", "127.0.0.1").replace("8000", str(port)) for a in CHART_ARGS] + ["--dtype", "auto"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "sim", "--time-scale", "0.01", "--vllm", *argv,
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stderr is not None
    logs = []
    try:
        async with asyncio.timeout(20):
            while not any(line.get("msg") == "sim listening" for line in logs):
                line = await proc.stderr.readline()
                assert line, f"the sim exited: {logs}"
                logs.append(json.loads(line))
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/models") as resp:
                models = await resp.json()
            async with http.post(f"http://127.0.0.1:{port}/v1/completions",
                                 json={"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "hi", "max_tokens": 2}) as resp:
                assert resp.status == 200
                answer = await resp.json()
    finally:
        proc.terminate()
        await proc.wait()
    assert [(m["id"], m["root"], m["max_model_len"]) for m in models["data"]] == [
        ("llama-3-8b", "meta-llama/Llama-3.1-8B-Instruct", 16384),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct", 16384)]
    assert answer["model"] == "llama-3-8b"  # vLLM answers with the first served name
    by_msg = {line["msg"]: line for line in logs}
    assert by_msg["vLLM arguments ignored: the simulator does not know them"]["arguments"] == ["--dtype", "auto"]
    assert "--speculative-config" in by_msg["vLLM arguments accepted but not modelled by the simulator"]["arguments"]
