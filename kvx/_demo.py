"""``kvx demo``: a local cluster on one machine, a batch of requests through
it, and a report that says what moved and that every byte was right.

The cluster is what an operator runs, on embedded defaults: ``kvx metadata``,
``kvx prefill`` and ``kvx decode`` with the synthetic engine, and ``kvx proxy``
finding them in the metadata service, each a child process in its own process
group, on free loopback ports, with a cluster secret in a private temporary
directory. Whatever happens (the report, a failure, Ctrl-C, SIGTERM), every
child is stopped before ``run`` returns: SIGTERM to its group, then SIGKILL
to whatever of the group is left after ``STOP_TIMEOUT_S`` (at once on a
second signal). The signal handlers only note the signal; the demo stops at its
next poll (see ``StopRequest``). On Linux a child also gets SIGKILL when the
demo itself is killed (``PR_SET_PDEATHSIG``).

``kvx demo --agents`` is the agent-level demo: two agents, no daemons.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import numpy as np

from kvx._spawn import dying_with_parent
from kvx.config import MiB
from kvx.daemon.shapes import PRESETS, ModelShape
from kvx.errors import ConfigError, KvxError

BLOCK_TOKENS = 16  # the daemons' default --block-size, in tokens
START_TIMEOUT_S = 90.0  # each child, to say it is up; the machine may be busy
STOP_TIMEOUT_S = 15.0  # each child, from SIGTERM to SIGKILL
REQUEST_TIMEOUT_S = 120.0
MAX_REQUESTS = 1_000_000
MAX_CONCURRENCY = 64  # the daemons' default --max-inflight
MIN_PROMPT_WORDS, MAX_PROMPT_WORDS = 8, 1024
LOG_TAIL_LINES = 20
LOG_READ_BYTES = 64 * 1024

_METADATA_RE = re.compile(r"kvx metadata service on (\S+:\d+)")
_DAEMON_RE = re.compile(r"(?:prefill|decode) \S+ ready: API (http://\S+), admin (http://\S+),")
_PROXY_RE = re.compile(r"kvx proxy on (http://\S+)")
# Prompts are words from this list: the synthetic engine's tokens are words.
_WORDS = (
    "kv",
    "cache",
    "block",
    "prefill",
    "decode",
    "token",
    "layer",
    "head",
    "key",
    "value",
    "page",
    "pool",
)


class DemoError(KvxError):
    """The cluster did not start, a child died, or an answer was wrong."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stopped(BaseException):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class StopRequest:
    """Ctrl-C, SIGTERM or SIGHUP, noted by a handler that only stores the signal's
    number; ``check()``, called where the demo polls, raises ``_Stopped`` from there.

    A handler that raises (as Python's own for Ctrl-C does) raises at whatever
    bytecode the main thread is at, which may be inside a library's ``with lock:``
    after the lock was taken and before the block began (``threading.Condition``'s
    ``__enter__`` is Python code): the lock is then held for good. The demo hung so
    at its exit, the interpreter joining worker threads blocked on such a lock.

    A second signal does not wait for the next check: ``on_again`` (the cluster
    sets it) SIGKILLs every child, so every wait on them ends at once.
    """

    def __init__(self) -> None:
        self.signum = 0
        self.on_again: Callable[[], None] = lambda: None

    def handler(self, signum: int, frame: FrameType | None) -> None:
        # No locks, no raising: it runs between any two bytecodes of the main thread.
        if self.signum:
            self.on_again()
        else:
            self.signum = signum

    def check(self) -> None:
        if self.signum:
            raise _Stopped(self.signum)


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# -- the children ------------------------------------------------------------------


class Child:
    """One kvx command in its own process group, its output in a log file."""

    def __init__(self, label: str, args: list[str], log_path: str) -> None:
        self.label = label
        self.log_path = log_path
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                # SIGKILL when the demo dies, however it dies
                dying_with_parent([sys.executable, "-m", "kvx", "--log-level", "INFO", *args], env),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                process_group=0,  # Ctrl-C in the terminal reaches the demo only; it stops the rest
            )
        self.pid = self.process.pid

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - LOG_READ_BYTES))
            return f.read().decode(errors="replace")

    def tail(self) -> str:
        lines = self.log().splitlines()[-LOG_TAIL_LINES:]
        return "\n".join(f"    | {line}" for line in lines) or "    (its log is empty)"

    def exited(self) -> str | None:
        """None while it runs; how it ended once it has."""
        code = self.process.poll()
        if code is None:
            return None
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"

    def died(self, when: str) -> DemoError:
        return DemoError(
            f"the {self.label} (pid {self.pid}) {self.exited()} {when}; the end of its log:\n{self.tail()}"
        )

    def wait_for(
        self, pattern: re.Pattern[str], deadline: float, check: Callable[[], None] = lambda: None
    ) -> re.Match[str]:
        """The first match of ``pattern`` in the log, which the child writes once it is up;
        ``check`` runs at each poll (it raises to stop waiting)."""
        while True:
            check()
            found = pattern.search(self.log())
            if found:
                return found
            if self.exited() is not None:
                raise self.died("while starting")
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the {self.label} (pid {self.pid}) did not start within {START_TIMEOUT_S:.0f} s; "
                    f"the end of its log:\n{self.tail()}"
                )
            time.sleep(0.05)

    def signal_group(self, signum: int) -> None:
        # The group is the child's own (process_group=0): its pid is the group id. A group
        # whose processes have all exited is gone, and killpg says so.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signum)


def stop_children(children: list[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to each child's group, SIGKILL to what is left at ``timeout_s``."""
    for child in children:
        if child.process.poll() is None:
            child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children:
        try:
            child.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.signal_group(signal.SIGKILL)
            child.process.wait(10)
        # Anything the child started in its group goes with it.
        child.signal_group(signal.SIGKILL)


# -- the cluster -------------------------------------------------------------------


class LocalCluster:
    """Metadata service, synthetic prefill and decode daemons and the proxy,
    each a child process on free loopback ports; a context manager."""

    def __init__(
        self,
        model_shape: str = "tiny",
        num_blocks: int | None = None,
        daemon_args: tuple[str, ...] = (),
        say: Callable[[str], None] = lambda text: None,
        stop: StopRequest | None = None,
    ) -> None:
        if model_shape not in PRESETS:
            raise ConfigError(f"--model-shape must be one of {', '.join(PRESETS)}, not {model_shape!r}")
        self.shape: ModelShape = PRESETS[model_shape]
        self.num_blocks = num_blocks
        self.daemon_args = daemon_args
        self.say = say
        self.stop_request = stop or StopRequest()
        self.stop_request.on_again = self.kill
        self.dir = ""
        self.children: dict[str, Child] = {}
        self.metadata = self.proxy_url = ""
        self.api_url: dict[str, str] = {}
        self.admin_url: dict[str, str] = {}

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, key: str, label: str, args: list[str]) -> Child:
        child = Child(label, args, os.path.join(self.dir, f"{key}.log"))
        self.children[key] = child
        return child

    def start(self) -> None:
        started = time.monotonic()
        self.dir = tempfile.mkdtemp(prefix="kvx-demo-")  # mode 0700: the secret stays private
        secret_file = os.path.join(self.dir, "secret")
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        deadline = time.monotonic() + START_TIMEOUT_S
        meta = self._spawn(
            "metadata", "metadata service", ["metadata", "--listen", "127.0.0.1:0", "--admin-listen", "off"]
        )
        self.metadata = meta.wait_for(_METADATA_RE, deadline, self.stop_request.check).group(1)
        self.say(f"  metadata service  pid {meta.pid:<7} {self.metadata} (memory store)")
        deadline = time.monotonic() + START_TIMEOUT_S
        common = ["--metadata", self.metadata, "--secret-file", secret_file, "--model-shape", self.shape.name]
        common += ["--api-port", "0", "--admin-port", "0", "--agent-port", "0"]
        # A demo stops at once: no grace period for routers that are its own children.
        common += ["--drain-grace-s", "0", "--drain-timeout-s", "2"]
        if self.num_blocks is not None:
            common += ["--num-blocks", str(self.num_blocks)]
        for role in ("prefill", "decode"):
            self._spawn(role, f"{role} daemon", [role, "--name", f"{role}-0", *common, *self.daemon_args])
        proxy = self._spawn(
            "proxy",
            "proxy",
            ["proxy", "--metadata", self.metadata, "--listen", "127.0.0.1:0", "--refresh-s", "0.5"],
        )
        for role in ("prefill", "decode"):
            child = self.children[role]
            found = child.wait_for(_DAEMON_RE, deadline, self.stop_request.check)
            self.api_url[role], self.admin_url[role] = found.group(1), found.group(2)
            self.say(
                f"  {role + ' daemon':<17} pid {child.pid:<7} API {self.api_url[role]}, "
                f"admin {self.admin_url[role]}"
            )
        self.proxy_url = proxy.wait_for(_PROXY_RE, deadline, self.stop_request.check).group(1)
        self._wait_discovered(deadline)
        self.say(
            f"  kvx proxy         pid {proxy.pid:<7} {self.proxy_url}: found prefill-0 and decode-0 "
            f"in the metadata service; all up in {time.monotonic() - started:.1f} s"
        )

    def _wait_discovered(self, deadline: float) -> None:
        """Until the proxy's /healthz answers 200: it has found a prefill and a decode."""
        reason = ""
        while True:
            self.check_alive("while starting")
            try:
                status, body = http_get(self.proxy_url + "/healthz", 5.0)
                if status == 200:
                    return
                reason = str(json.loads(body).get("reason", body[:200]))
            except (DemoError, ValueError) as exc:
                reason = str(exc)
            if time.monotonic() > deadline:
                raise DemoError(
                    f"the proxy did not find the daemons in the metadata service within "
                    f"{START_TIMEOUT_S:.0f} s ({reason}); the end of its log:\n{self.children['proxy'].tail()}"
                )
            time.sleep(0.1)

    def explain(self, exc: DemoError) -> str:
        """Why the demo failed: a child that died says more than what failed after it."""
        for child in self.children.values():
            if child.exited() is not None and f"(pid {child.pid})" not in str(exc):
                return f"{child.died('during the run')}\n  (then: {exc})"
        return str(exc)

    def check_alive(self, when: str) -> None:
        """Raises _Stopped once a stop was asked for, DemoError for a child that died."""
        self.stop_request.check()
        for child in self.children.values():
            if child.exited() is not None:
                raise child.died(when)

    @property
    def pids(self) -> dict[str, int]:
        return {key: child.pid for key, child in self.children.items()}

    def kill(self) -> None:
        """SIGKILL to every child's group, now (safe in a signal handler: no locks)."""
        for child in list(self.children.values()):
            child.signal_group(signal.SIGKILL)

    def stop(self) -> None:
        """Proxy and daemons first (they unregister as they go), the metadata service last."""
        children = self.children
        try:
            stop_children([children[k] for k in ("proxy", "decode", "prefill") if k in children])
            stop_children([children[k] for k in ("metadata",) if k in children])
        except BaseException:
            self.kill()  # an error while stopping: no more waiting
            raise
        finally:
            if self.dir:
                shutil.rmtree(self.dir, ignore_errors=True)


def http_get(url: str, timeout_s: float) -> tuple[int, str]:
    """GET on a loopback URL of the cluster, without any HTTP(S)_PROXY of the environment."""
    import urllib.error
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout_s) as response:
            return response.status, response.read(4 * MiB).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(4 * MiB).decode(errors="replace")
    except OSError as exc:
        raise DemoError(f"GET {url}: {getattr(exc, 'reason', exc)}") from None


@dataclasses.dataclass
class DecodeTotals:
    """What the decode daemon's /metrics say it moved and checked."""

    bytes: float = 0.0
    transfers: float = 0.0
    seconds: float = 0.0
    blocks_verified: float = 0.0
    verify_failures: float = 0.0
    requests_failed: float = 0.0
    backends: set[str] = dataclasses.field(default_factory=set)

    def __sub__(self, other: DecodeTotals) -> DecodeTotals:
        fields = ("bytes", "transfers", "seconds", "blocks_verified", "verify_failures", "requests_failed")
        out = DecodeTotals(**{f: getattr(self, f) - getattr(other, f) for f in fields})
        out.backends = set(self.backends)
        return out


def decode_totals(admin_url: str) -> DecodeTotals:
    """The decode daemon's transfer and verification counters, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = http_get(admin_url + "/metrics", 10.0)
    if status != 200:
        raise DemoError(f"{admin_url}/metrics answered {status}")
    out = DecodeTotals()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "kvx_transfer_bytes_total" and labels.get("outcome") == "ok":
                out.bytes += value
                out.backends.add(labels.get("backend", "?"))
            elif name == "kvx_transfer_duration_seconds_sum":
                out.seconds += value
            elif name == "kvx_transfer_duration_seconds_count":
                out.transfers += value
            elif name == "kvx_blocks_verified_total":
                out.blocks_verified += value
            elif name == "kvx_verify_failures_total":
                out.verify_failures += value
            elif name == "kvx_requests_total" and labels.get("outcome") == "failed":
                out.requests_failed += value
    return out


def pool_blocks(admin_url: str) -> int:
    status, body = http_get(admin_url + "/v1/status", 10.0)
    if status != 200:
        raise DemoError(f"{admin_url}/v1/status answered {status}")
    return int(json.loads(body)["pool"]["blocks"])


def leases_held(admin_url: str) -> int:
    status, body = http_get(admin_url + "/v1/status", 10.0)
    if status != 200:
        raise DemoError(f"{admin_url}/v1/status answered {status}")
    return int(json.loads(body)["leases"]["held"])


# -- the requests ------------------------------------------------------------------


def make_prompts(count: int, max_words: int, seed: int = 7, min_words: int = 8) -> Iterator[str]:
    """``count`` prompts, made as they are needed, their lengths spread evenly on a log
    scale from ``min_words`` to ``max_words``."""
    rng = np.random.default_rng(seed)
    lo = min(min_words, max_words)
    for _ in range(count):
        words = int(math.exp(rng.uniform(math.log(lo), math.log(max_words))))
        yield " ".join(rng.choice(_WORDS, min(max(words, lo), max_words)))


def words_prompt(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(_WORDS, words))


@dataclasses.dataclass
class Answer:
    words: int
    ttft_s: float = 0.0
    latency_s: float = 0.0
    error: str = ""


def stream_completion(
    client: Any, url: str, model: str, prompt: str, max_tokens: int
) -> tuple[float, float, str]:
    """POST a streamed completion: (seconds to the first token, seconds to the end, the text)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first = 0.0
    text: list[str] = []
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise DemoError(f"HTTP {response.status_code}: {response.read()[:500].decode(errors='replace')}")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise DemoError(f"the stream broke: {event['error']}")
            if not first:
                first = time.perf_counter() - start
            text.append(event["choices"][0]["text"])
    return first, time.perf_counter() - start, "".join(text)


def _ask(client: Any, cluster: LocalCluster, prompt: str, max_tokens: int) -> Answer:
    from kvx.daemon.synthetic import expected_answer, render

    answer = Answer(words=len(prompt.split()))
    try:
        answer.ttft_s, answer.latency_s, text = stream_completion(
            client, cluster.proxy_url, f"kvx-synthetic-{cluster.shape.name}", prompt, max_tokens
        )
    except Exception as exc:  # httpx's errors (the proxy went away), a bad answer: all end the run
        answer.error = str(exc) if isinstance(exc, DemoError) else f"{type(exc).__name__}: {exc}"
        return answer
    want = render(expected_answer(prompt, cluster.shape, BLOCK_TOKENS, max_tokens))
    if text != want:
        answer.error = f"wrong answer for a {answer.words}-word prompt: {text[:60]!r}, not {want[:60]!r}"
    return answer


class Progress:
    """A bar on a terminal; a line at every quarter otherwise."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total, self.stream = total, stream
        self.tty = stream.isatty()
        self.next_quarter = 1
        self.open = False  # a bar is on the line

    def update(self, done: int, failed: int) -> None:
        bad = f", {failed} failed" if failed else ""
        if self.tty:
            width = 30
            filled = width * done // self.total
            self.stream.write(
                f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests{bad}"
            )
            self.open = done < self.total
            if not self.open:
                self.stream.write("\n")
        else:
            while self.next_quarter <= 4 and done * 4 >= self.next_quarter * self.total:
                self.stream.write(f"  {done}/{self.total} requests{bad}\n")
                self.next_quarter += 1
        self.stream.flush()

    def close(self) -> None:
        if self.open:  # stopped midway: end the bar's line
            self.open = False
            self.stream.write("\n")
            self.stream.flush()


def send_batch(
    cluster: LocalCluster,
    prompts: Iterable[str],
    concurrency: int,
    max_tokens: int,
    progress: Progress | None,
) -> list[Answer]:
    """Every prompt through the proxy, ``concurrency`` at a time; stops at the first
    failure, a dead child or a stop request.

    The senders are daemon threads, not a ThreadPoolExecutor's: the interpreter
    joins those at exit without a bound, so one stuck in a request (or on a lock)
    would keep a stopped demo from exiting. The proxy's end (cluster.stop) ends
    the requests still in flight."""
    import httpx

    client = httpx.Client(
        trust_env=False,
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0),
        limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
    )
    todo = iter(prompts)
    todo_lock = threading.Lock()  # a generator is not safe to advance from two threads
    # Each sender puts one answer at a time, then None when it is done: a small bound.
    results: queue.Queue[Answer | None] = queue.Queue(concurrency)
    done = threading.Event()  # stop sending: the run is over

    def put(item: Answer | None) -> None:
        while not done.is_set():
            with contextlib.suppress(queue.Full):
                results.put(item, timeout=0.5)
                return

    def sender() -> None:
        while not done.is_set():
            with todo_lock:
                prompt = next(todo, None)
            if prompt is None:
                break
            put(_ask(client, cluster, prompt, max_tokens))
        put(None)

    threads = [threading.Thread(target=sender, name=f"kvx-demo-{i}", daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    answers: list[Answer] = []
    failed = 0
    senders = len(threads)
    try:
        while senders:
            with contextlib.suppress(queue.Empty):
                answer = results.get(timeout=0.5)
                if answer is None:
                    senders -= 1
                else:
                    answers.append(answer)
                    failed += bool(answer.error)
                    if progress is not None:
                        progress.update(len(answers), failed)
                    if failed:
                        break
            cluster.check_alive("during the run")
    finally:
        done.set()
        if not senders:
            client.close()
        # else: senders may still use it; the proxy's end (cluster.stop) ends their requests.
    return answers


# -- kvx demo ----------------------------------------------------------------------


@contextlib.contextmanager
def _stop_on_signals(stop: StopRequest) -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP are noted in ``stop`` while the block runs; one
    that came after the block's last check is raised as it ends."""
    old = {s: signal.signal(s, stop.handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    stop.check()


def run(
    requests: int = 64,
    concurrency: int = 4,
    model_shape: str = "tiny",
    max_tokens: int = 16,
    out: Any = sys.stdout,
    err: Any = sys.stderr,
) -> int:
    """``kvx demo``: 0 when every request was answered right and every block verified."""

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    try:
        import httpx  # noqa: F401  # kvx proxy needs it too
    except ImportError:
        print("kvx demo: it runs kvx proxy, which needs httpx: pip install 'kvx[proxy]'", file=err)
        return 1
    shape = PRESETS[model_shape]
    say(
        f"kvx demo: a local cluster, synthetic engine, model shape {shape.name} ({shape.layers} layers x "
        f"{'K/V' if shape.planes == 2 else 'latent'} x {_fmt_bytes(shape.token_plane_bytes)} per token = "
        f"{_fmt_bytes(shape.token_bytes)} of KV per token)"
    )
    stop = StopRequest()
    cluster = LocalCluster(model_shape, say=say, stop=stop)
    try:
        with _stop_on_signals(stop), cluster:
            try:
                code = _run_batch(cluster, requests, concurrency, max_tokens, say, err)
            except DemoError as exc:  # while the children's state and logs are still there
                stop.check()  # a second signal killed the children: that is not a failure
                raise DemoError(cluster.explain(exc)) from None
    except DemoError as exc:
        print(f"kvx demo: FAILED: {exc}", file=err, flush=True)
        code = 1
    except (KeyboardInterrupt, _Stopped) as exc:  # KeyboardInterrupt: before the handlers are in
        signum = exc.signum if isinstance(exc, _Stopped) else signal.SIGINT
        print(f"\nkvx demo: stopped by {signal.Signals(signum).name}", file=err, flush=True)
        code = 128 + signum
    if cluster.children:
        pids = ", ".join(f"{key} {pid}" for key, pid in cluster.pids.items())
        say(f"  stopped every process it started (pids: {pids})")
    return code


def _run_batch(
    cluster: LocalCluster,
    requests: int,
    concurrency: int,
    max_tokens: int,
    say: Callable[[str], None],
    err: Any,
) -> int:
    shape = cluster.shape
    # Each request in flight holds its blocks on both sides: a prompt must fit beside the others.
    blocks = pool_blocks(cluster.admin_url["decode"])
    max_words = max(1, min(MAX_PROMPT_WORDS, blocks * BLOCK_TOKENS // concurrency))
    prompts = make_prompts(requests, max_words, min_words=MIN_PROMPT_WORDS)
    say(
        f"  sending {requests} completions through the proxy, {concurrency} at a time, streamed, "
        f"max_tokens {max_tokens}, prompts of {min(MIN_PROMPT_WORDS, max_words)} to {max_words} words (a word is a token)"
    )
    before = decode_totals(cluster.admin_url["decode"])
    started = time.perf_counter()
    progress = Progress(requests, err)
    try:
        answers = send_batch(cluster, prompts, concurrency, max_tokens, progress)
    finally:
        progress.close()
    wall_s = time.perf_counter() - started
    failures = [a for a in answers if a.error]
    if failures:
        raise DemoError(f"{len(failures)} of {len(answers)} requests failed; the first: {failures[0].error}")
    moved = decode_totals(cluster.admin_url["decode"]) - before
    per_block = shape.layers * shape.planes
    want_blocks = sum(-(-a.words // BLOCK_TOKENS) for a in answers) * per_block
    want_bytes = want_blocks * BLOCK_TOKENS * shape.token_plane_bytes
    ttft_ms = np.asarray([a.ttft_s for a in answers]) * 1e3
    say(f"  requests:  {len(answers)} answered in {wall_s:.2f} s = {len(answers) / wall_s:.1f} requests/s")
    say(
        f"  KV moved:  {_fmt_bytes(moved.bytes)} in {moved.transfers:.0f} READs by decode over "
        f"{', '.join(sorted(moved.backends)) or '?'} (its /metrics: kvx_transfer_bytes_total)"
    )
    if moved.seconds > 0:
        say(
            f"  transfer:  {moved.bytes / moved.seconds / 1e9:.2f} GB/s (bytes / time in READs, "
            f"kvx_transfer_duration_seconds), {moved.seconds / max(1.0, moved.transfers) * 1e3:.2f} ms per request"
        )
    say(
        f"  TTFT:      p50 {np.percentile(ttft_ms, 50):.1f} ms, p99 {np.percentile(ttft_ms, 99):.1f} ms "
        f"(time to the first streamed token through the proxy, {concurrency} requests in flight)"
    )
    problems = []
    if moved.transfers != len(answers) or moved.bytes != want_bytes:
        problems.append(
            f"decode READ {moved.bytes:.0f} bytes in {moved.transfers:.0f} transfers; the prompts "
            f"need {want_bytes} bytes in {len(answers)}"
        )
    if moved.blocks_verified != want_blocks or moved.verify_failures:
        problems.append(
            f"decode verified {moved.blocks_verified:.0f} blocks of the {want_blocks} it moved "
            f"({moved.verify_failures:.0f} verification failures)"
        )
    deadline = time.monotonic() + 10.0
    while (held := leases_held(cluster.admin_url["prefill"])) and time.monotonic() < deadline:
        cluster.stop_request.check()
        time.sleep(0.1)
    if held:
        problems.append(f"prefill still holds the KV of {held} request(s) that decode read")
    if problems:
        raise DemoError("; ".join(problems))
    say(
        f"verified: every answer equals the single-engine answer, and decode checked all "
        f"{want_blocks} blocks ({_fmt_bytes(want_bytes)}) byte for byte; prefill freed every request's KV"
    )
    return 0


# -- kvx demo --agents ---------------------------------------------------------------


def run_agents(
    layers: int, num_blocks: int, block_size: int, request_blocks: int, out: Any = sys.stdout
) -> int:
    """``kvx demo --agents``: two agents, one READ and one WRITE, every byte checked."""
    from kvx._datapath import io as _io
    from kvx._worker import Worker, WorkerConfig, pattern
    from kvx.agent import Agent
    from kvx.layout import KVLayout
    from kvx.metadata.service import MetadataServer, ThreadedServer
    from kvx.v1.metadata_pb2 import Role

    secret = secrets.token_bytes(32)
    layout_kwargs = dict(num_layers=layers, num_blocks=num_blocks, block_size_bytes=block_size)
    pool_bytes = layers * 2 * num_blocks * block_size
    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    say(
        f"kvx demo --agents: KV pool of {layers} layers x K/V x {num_blocks} blocks x {_fmt_bytes(block_size)} "
        f"= {_fmt_bytes(pool_bytes)} on each side"
    )
    with (
        ThreadedServer(MetadataServer("127.0.0.1:0")) as service,
        Worker(
            WorkerConfig(
                "prefill-0", pool_bytes, seed=42, auth_secret=secret, metadata=service.address, role="prefill"
            )
        ) as prefill,
        Agent("decode-0", auth_secret=secret, metadata=service.address, role="decode") as decode,
    ):
        pool = np.empty(pool_bytes, np.uint8)
        # Touch every page now, as an engine's KV cache is; np.zeros would fault them in mid-transfer.
        pool.fill(0)
        region = decode.register(pool)
        agents = service.call(service.server.store.list())
        say(
            f"  metadata service on {service.address} (in-process, memory store): "
            f"{', '.join(f'{a.name} ({Role.Name(a.role)[5:].lower()})' for a in agents)} registered"
        )
        peer = decode.connect("prefill-0")
        say(
            f"  prefill agent pid {prefill.pid}, decode agent pid {os.getpid()}: decode found prefill-0 "
            f"by name, connected over {peer.backend} ({_io.IMPL} data path), HMAC-authenticated"
        )

        rng = np.random.default_rng(7)
        src_blocks = np.sort(rng.choice(num_blocks, request_blocks, replace=False))
        dst_blocks = np.sort(rng.choice(num_blocks, request_blocks, replace=False))
        remote_layout = KVLayout(regions=(peer.regions[0].id,), **layout_kwargs)
        local_layout = KVLayout(regions=(region.id,), **layout_kwargs)
        local, remote = local_layout.descs(dst_blocks), remote_layout.descs(src_blocks)
        say(
            f"  pull: decode READs {request_blocks} blocks = {len(remote)} descriptors "
            f"({len(remote.coalesce())} after coalescing), {_fmt_bytes(remote.total_bytes)}"
        )

        transfer = peer.read(local, remote, notify=b"request demo-1: KV received")
        transfer.wait(30)
        duration_s = transfer.duration_s
        assert duration_s is not None  # wait() returned, so it is done
        say(
            f"  moved {_fmt_bytes(transfer.bytes)} in {duration_s * 1e3:.1f} ms = "
            f"{transfer.throughput_gbps:.2f} GB/s"
        )
        notes = prefill.call("notifications", 10.0)
        say(
            f"  prefill got notification {notes[0][1]!r} from {notes[0][0]!r}"
            if notes
            else "  prefill got NO notification"
        )

        expected = pattern(42, pool_bytes)
        ok = bool(notes)
        for lo, ro in zip(local.offset.tolist(), remote.offset.tolist(), strict=True):
            if not np.array_equal(pool[lo : lo + block_size], expected[ro : ro + block_size]):
                say(f"  MISMATCH at local offset {lo}")
                ok = False
                break
        untouched = np.ones(pool_bytes, bool)
        for lo in local.offset.tolist():
            untouched[lo : lo + block_size] = False
        if pool[untouched].any():
            say("  bytes outside the requested blocks changed")
            ok = False

        # Push: decode WRITEs a few blocks back and prefill's memory changes.
        pool[:] = 0xAB
        push = remote_layout.descs(src_blocks[:4], layers=[0])
        start = time.perf_counter()
        peer.write(local_layout.descs(dst_blocks[:4], layers=[0]), push).wait(30)
        elapsed_ms = (time.perf_counter() - start) * 1e3
        first = push.offset.tolist()[0]
        pushed_ok = prefill.call("peek", first, block_size) == b"\xab" * block_size
        say(
            f"  push: decode WRITEs {len(push)} blocks into prefill in {elapsed_ms:.1f} ms: "
            f"{'landed' if pushed_ok else 'MISSING'}"
        )
        ok = ok and pushed_ok
        if ok:
            say(f"verified: all {transfer.bytes} bytes match prefill's blocks, nothing else changed")
            return 0
        say("FAILED: see above")
        return 1
