"""`specsplit-edge serve` driven by the official `openai` client, against the real cloud fixture
(tritonserver + gateway with the tiny target) and a real ONNX Runtime draft.

The tiny models have no tokenizer, so the draft's export gets one here: 256 ASCII tokens (single
characters, then two-letter pairs), so any generated id decodes to plain text, and a chat template
without special tokens. Expected outputs come from transformers running the tiny target.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from specsplit.edge.text import TextCodec
from specsplit.shared.tiny import reference_greedy
from tests.test_end_to_end import triton_sessions

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow
EDGE = str(Path(sys.executable).parent / "specsplit-edge")
TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
N = 24
PROMPT = "Write a haiku about gRPC."


def write_tokenizer(model_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models

    singles = ["\n"] + [chr(c) for c in range(32, 127)]
    pairs = [a + b for a in "etaoinshrdlucmfw" for b in "etaoinshrdlucmfw"]
    vocab = {t: i for i, t in enumerate((singles + pairs)[:256])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: encoding uses single chars
    tok.decoder = decoders.Fuse()
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))


@pytest.fixture(scope="module")
def draft_dir(tiny, tmp_path_factory) -> Path:
    """The unrelated tiny draft (mostly rejected: the split really corrects it), with text."""
    d = tmp_path_factory.mktemp("openai") / "draft"
    shutil.copytree(tiny.draft_onnx, d)
    write_tokenizer(d)
    return d


class EdgeServe:
    """`specsplit-edge serve` as a child process on a free port; always stopped."""

    def __init__(self, *args: str, log_path: Path):
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [EDGE, "serve", "--port", "0", *args]
        self.cloud = args[args.index("--server") + 1] if "--server" in args else ""
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.url = ""
        found = threading.Event()

        def read():
            for line in self.proc.stdout:
                if not found.is_set() and "serving the OpenAI API on " in line:
                    self.url = line.split(" on ")[1].strip()
                    found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(120):
            self.stop()
            raise RuntimeError(f"serve did not start:\n{log_path.read_text()[-3000:]}")

    def client(self, async_: bool = False):
        cls = openai.AsyncOpenAI if async_ else openai.OpenAI
        return cls(base_url=self.url, api_key="unused", max_retries=0, timeout=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def serve(cloud, draft_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    server = EdgeServe(
        "--server", cloud.address, "--draft", str(draft_dir), "--concurrency", "2",
        "--max-draft-tokens", "3", "--retry-window", "0", log_path=log,
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def codec(draft_dir) -> TextCodec:
    return TextCodec(draft_dir)


def expected(tiny, codec: TextCodec, ids: list[int], n: int = N) -> str:
    return codec.decode(reference_greedy(tiny.target, ids, n))


def chat_ids(codec: TextCodec, prompt: str = PROMPT) -> list[int]:
    return codec.chat_ids([{"role": "user", "content": prompt}])


def chat(client, prompt=PROMPT, **kw):
    messages = [{"role": "user", "content": prompt}]
    return client.chat.completions.create(model="any", messages=messages, **kw)


def assert_sessions_freed(cloud) -> None:
    """The cloud holds no session within 5 s (the tiny pair runs 900 tokens in far longer)."""
    for _ in range(50):
        if triton_sessions(cloud.triton_url) == 0:
            return
        time.sleep(0.1)
    assert triton_sessions(cloud.triton_url) == 0


def test_models_lists_the_served_model(serve):
    assert [m.id for m in serve.client().models.list()] == ["specsplit"]


def test_chat_greedy_equals_the_targets_greedy(serve, tiny, codec):
    r = chat(serve.client(), temperature=0, max_tokens=N)
    ids = chat_ids(codec)
    assert r.choices[0].message.content == expected(tiny, codec, ids)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), N)
    spec = r.model_extra["specsplit"]
    assert spec["route"] == "split" and spec["new_tokens"] == N
    assert spec["target_forward_passes"] == spec["rounds"] > 0
    assert 0 <= spec["acceptance_rate"] < 0.5  # an unrelated draft: the cloud corrects it
    assert spec["tokens_per_round"] == pytest.approx(N / spec["rounds"])


def test_chat_streamed_equals_not_streamed(serve, tiny, codec):
    stream = chat(
        serve.client(),
        temperature=0,
        max_completion_tokens=N,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected(tiny, codec, chat_ids(codec))
    assert chunks[0].choices[0].delta.role == "assistant"
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason == "length"
    assert last.model_extra["specsplit"]["new_tokens"] == N
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N


@pytest.mark.parametrize("stream", [False, True])
def test_completion_greedy_equals_the_targets_greedy(serve, tiny, codec, stream):
    prompt = "def quicksort(xs):"
    r = serve.client().completions.create(
        model="specsplit", prompt=prompt, temperature=0, max_tokens=N, stream=stream
    )
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert text == expected(tiny, codec, codec.encode(prompt))


def test_greedy_equals_specsplit_edge_generate(serve, cloud, draft_dir):
    out = subprocess.run(
        [EDGE, "generate", "--server", cloud.address, "--draft", str(draft_dir), "--prompt",
         PROMPT, "--max-new-tokens", str(N), "--json"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    r = chat(serve.client(), temperature=0, max_tokens=N)
    assert r.choices[0].message.content == json.loads(out.stdout)["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_generation_early(serve, tiny, codec, cloud, stream):
    full = expected(tiny, codec, chat_ids(codec), 40)
    stop = full[12:15]
    cut = full[: full.find(stop)]
    # max_tokens as long as the tiny context allows: run to the end, it would take many seconds
    many = 900
    stops = ["\x00never", stop]
    r = chat(serve.client(), temperature=0, max_tokens=many, stop=stops, stream=stream)
    if stream:
        chunks = [c for c in r if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish, spec = chunks[-1].choices[0].finish_reason, chunks[-1].model_extra["specsplit"]
    else:
        text, finish, spec = r.choices[0].message.content, r.choices[0].finish_reason, r.specsplit
    assert text == cut and finish == "stop"
    assert spec["finish"] == "STOP_STRING" and spec["new_tokens"] < 40
    # The stream was cancelled, not run to `many` tokens: the cloud freed its session at once.
    assert_sessions_freed(cloud)


def test_client_gone_mid_stream_frees_the_session(serve, cloud):
    stream = chat(serve.client(), temperature=0, max_tokens=900, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)  # the role, then the first text
    stream.close()
    assert_sessions_freed(cloud)


def test_sampling_with_a_seed_repeats(serve):
    client = serve.client()
    a, b, c = (chat(client, temperature=0.9, seed=s, max_tokens=N) for s in (7, 7, 8))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    assert a.specsplit["seed"] == 7


def test_top_k_one_samples_the_targets_greedy_output(serve, tiny, codec):
    """top_k reaches both sides: with k = 1 sampling has one choice, the target's argmax."""
    r = chat(serve.client(), temperature=0.9, seed=7, max_tokens=N, extra_body={"top_k": 1})
    assert r.choices[0].message.content == expected(tiny, codec, chat_ids(codec))


def test_concurrent_requests_beyond_the_pool_all_equal_the_target(serve, tiny, codec):
    """Four requests on a pool of two drafters: two wait, none mixes another's state."""
    prompts = ["alpha", "bravo charlie", "delta", "echo foxtrot golf"]

    async def all_at_once():
        client = serve.client(async_=True)
        async with client:
            return await asyncio.gather(
                *(chat(client, p, temperature=0, max_tokens=N) for p in prompts)
            )

    for r, p in zip(asyncio.run(all_at_once()), prompts, strict=True):
        assert r.choices[0].message.content == expected(tiny, codec, chat_ids(codec, p))


def test_the_pools_drafters_share_one_session(draft_dir):
    """The endpoint loads the draft once: each slot's drafter is the first's ``another``
    (its own sequence on the same ONNX Runtime session), not a new session holding the weights
    again."""
    from specsplit.edge.openai.app import Endpoint, ServeConfig

    endpoint = Endpoint(ServeConfig(server="127.0.0.1:1", draft_dir=draft_dir, model_name="m"))
    drafters = [endpoint.pool._make_drafter() for _ in range(3)]
    assert len({id(d) for d in drafters}) == 3
    assert all(d._session is drafters[0]._session for d in drafters)
    drafters[1].forward([1, 2, 3])
    assert drafters[0].cached == [] and drafters[2].cached == []


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(n=2), "n"),
        (dict(temperature=3.0), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(presence_penalty=0.5), "presence_penalty"),
        (dict(logprobs=True), "logprobs"),
        # max_tokens=1: were one of these accepted, it would end at once
        (dict(extra_body={"min_p": 0.1}, max_tokens=1), "min_p"),
        (dict(extra_body={"repetition_penalty": 1.2}, max_tokens=1), "repetition_penalty"),
        (dict(extra_body={"functions": [{"name": "f"}]}, max_tokens=1), "functions"),
    ],
)
def test_bad_request_is_an_openai_400(serve, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(serve.client(), **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert param in e.value.body["message"]


def health(server: EdgeServe) -> tuple[int, dict]:
    url = server.url.removesuffix("/v1") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(serve) -> dict[str, float]:
    """/metrics (open without a key, beside /v1): sample name with labels -> value."""
    base = serve.url.removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as r:
        text = r.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def test_metrics_count_each_request_and_its_speculation(serve, codec):
    """/metrics named after vLLM's (edge.openai.metrics) moves by exactly what one request
    reports in vLLM's per-request shape, metrics.speculative_decoding."""
    p = "specsplit_edge"
    before = scrape(serve)
    r = chat(serve.client(), temperature=0, max_tokens=N)
    after = scrape(serve)
    spec = r.model_extra["metrics"]["speculative_decoding"]
    ours = r.model_extra["specsplit"]
    # (none, possibly: on a slow machine auto may lead, and a led stream of this unrelated draft
    # pauses its drafting)
    assert spec["num_drafts"] == ours["num_drafts"]
    assert spec["num_accepted_tokens"] == ours["accepted"]
    assert spec["num_draft_tokens"] == ours["drafted"]
    assert spec["num_accepted_tokens_per_pos"] == ours["accepted_per_position"]

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved(f"{p}_prompt_tokens_total") == len(chat_ids(codec))
    assert moved(f"{p}_generation_tokens_total") == N
    assert moved(f'{p}_request_success_total{{finished_reason="length"}}') == 1
    assert moved(f"{p}_spec_decode_num_drafts_total") == spec["num_drafts"]
    assert moved(f"{p}_spec_decode_num_draft_tokens_total") == spec["num_draft_tokens"]
    assert moved(f"{p}_spec_decode_num_accepted_tokens_total") == spec["num_accepted_tokens"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"{p}_{name}_count") == 1
    assert moved(f"{p}_inter_token_latency_seconds_count") == ours["rounds"] - 1
    assert after[f"{p}_num_requests_running"] == 0


def test_health_is_ok_while_the_cloud_serves(serve):
    assert health(serve) == (200, {"status": "ok", "cloud": "SERVING"})


def test_malformed_body_is_an_openai_400(serve):
    for body in (b"{not json", json.dumps({"model": "x"}).encode()):  # no messages
        request = urllib.request.Request(f"{serve.url}/chat/completions", body, method="POST")
        request.add_header("Content-Type", "application/json")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, timeout=30)
        assert e.value.code == 400
        assert json.loads(e.value.read())["error"]["type"] == "invalid_request_error"


@pytest.fixture(scope="module")
def serve_without_cloud(draft_dir, tmp_path_factory):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve-down") / "serve.log"
    server = EdgeServe(
        "--server", f"127.0.0.1:{port}", "--draft", str(draft_dir), "--retry-window", "0",
        log_path=log,
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_health_is_503_while_the_cloud_is_down(serve_without_cloud):
    """A balancer stops routing to an edge whose cloud cannot serve."""
    status, body = health(serve_without_cloud)
    assert status == 503 and body["status"] == "unavailable" and body["cloud"] == "UNAVAILABLE"
    assert serve_without_cloud.cloud in body["reason"]


@pytest.mark.parametrize("stream", [False, True])
def test_cloud_down_is_an_openai_503(serve_without_cloud, stream):
    with pytest.raises(openai.InternalServerError) as e:
        chat(serve_without_cloud.client(), temperature=0, max_tokens=N, stream=stream)
    assert e.value.status_code == 503
    assert e.value.body["code"] == "cloud_unavailable"
    assert "UNAVAILABLE" in e.value.body["message"]


def test_an_api_key_is_required_when_set(cloud, draft_dir, tiny, codec, tmp_path):
    server = EdgeServe(
        "--server", cloud.address, "--draft", str(draft_dir), "--api-key", "sekret",
        log_path=tmp_path / "serve.log",
    )  # fmt: skip
    try:
        with pytest.raises(urllib.error.HTTPError) as no_key:  # no Authorization header
            urllib.request.urlopen(server.url + "/models", timeout=10)
        assert no_key.value.code == 401
        assert json.loads(no_key.value.read())["error"]["code"] == "invalid_api_key"
        for key in ("unused", "sekret-not"):
            client = openai.OpenAI(base_url=server.url, api_key=key, max_retries=0, timeout=60)
            with pytest.raises(openai.AuthenticationError) as e:
                chat(client, temperature=0, max_tokens=N)
            assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        client = openai.OpenAI(base_url=server.url, api_key="sekret", max_retries=0, timeout=120)
        r = chat(client, temperature=0, max_tokens=N)
        assert r.choices[0].message.content == expected(tiny, codec, chat_ids(codec))
        with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health", timeout=10) as h:
            assert h.status == 200  # for load balancers: no key
    finally:
        server.stop()


def test_serve_without_a_draft_tokenizer_fails_clearly(tiny):
    r = subprocess.run(
        [EDGE, "serve", "--port", "0", "--draft", str(tiny.draft_onnx)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "tokenizer.json" in r.stderr
