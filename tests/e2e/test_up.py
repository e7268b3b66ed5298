"""`moe-mesh up` as a user runs it: real processes, the demo model, the official openai client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from services.common.frames import spin_for
from tests.helpers import free_port, run_cli, short_dir

pytestmark = pytest.mark.slow  # starts processes or computes for seconds

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], check=False, capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def role_of(argv: list[str]) -> str | None:
    """The subcommand of a `python -P -m services.ops.cli [--global value ...] ROLE ...` command line."""
    if "services.ops.cli" not in argv:
        return None
    i = argv.index("services.ops.cli") + 1
    while i < len(argv) and argv[i].startswith("--"):
        i += 2  # --log-level info, --log-format json
    return argv[i] if i < len(argv) else None


def service_pids(up_pid: int, role: str) -> list[int]:
    """The processes of one role (`expert`, `core`, `gateway`) that `moe-mesh up` started."""
    return [
        pid
        for pid in children_of(up_pid)
        if role_of(Path(f"/proc/{pid}/cmdline").read_text().split("\0")) == role
    ]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    workdir = short_dir("mm-up-")  # given to `up`, which then keeps it (logs)
    names = ["--served-model-name", "smollm2-135m-moe8", "demo"]  # the folder's name, then an alias
    proc, url = start_up(cache, workdir, "--experts", "2", *names)
    yield proc, url, workdir, cache
    if proc.poll() is None:
        proc.kill()


def start_up(cache: Path, workdir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`moe-mesh up FLAGS` on a free port, once it says it serves: (its process, the API's URL)."""
    proc, url = launch_up(cache, workdir, *flags)
    wait_serving(proc)
    return proc, url


def launch_up(cache: Path, workdir: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    """`moe-mesh up FLAGS` on a free port, started: (its process, the API's URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.ops.cli",
            "up",
            "--port",
            str(port),
            *flags,
            "--workdir",
            str(workdir),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MOE_MESH_CACHE": str(cache)},
    )
    # up relays its services' progress and stats lines to stderr for as long as it runs: keep
    # reading them, or a long run would fill the pipe and block up's next write.
    proc.stderr_lines = []
    threading.Thread(target=lambda: proc.stderr_lines.extend(proc.stderr), daemon=True).start()
    return proc, f"http://127.0.0.1:{port}/v1"


def wait_serving(proc: subprocess.Popen) -> None:
    line = proc.stdout.readline()  # blocks until ready (or exit)
    if "serving" not in line:
        proc.kill()
        proc.wait()
        err = "".join(proc.stderr_lines) if hasattr(proc, "stderr_lines") else proc.stderr.read()
        raise AssertionError(f"moe-mesh up did not start: {line}{err[-3000:]}")


def test_demo_answers_paris_not_streamed(up):
    _, url, _, _ = up
    client = openai.OpenAI(base_url=url, api_key="unused")
    model = client.models.list().data[0].id
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.prompt_tokens > 0 and reply.usage.completion_tokens > 0


def test_demo_answers_paris_streamed(up):
    _, url, _, _ = up
    client = openai.OpenAI(base_url=url, api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=24, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "Paris" in text


def test_served_model_names_are_listed_and_answer(up):
    """`--served-model-name NAME ALIAS`: both listed, either answers under the name it was asked by,
    any other is a 404 naming the model, as vLLM does."""
    _, url, _, _ = up
    client = openai.OpenAI(base_url=url, api_key="unused")
    assert [model.id for model in client.models.list().data] == ["smollm2-135m-moe8", "demo"]
    reply = client.chat.completions.create(model="demo", messages=QUESTION, temperature=0, max_tokens=16)
    assert "Paris" in reply.choices[0].message.content and reply.model == "demo"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=2)
    assert missing.value.code == "model_not_found"
    # model paths never come from API input: the served checkpoint's own folder is just a name
    _, _, _, cache = up
    splits = [str(manifest.parent) for manifest in cache.glob("**/manifest.json")]
    assert splits
    for path in [*splits, str(cache), "../../etc/passwd"]:
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=path, messages=QUESTION, max_tokens=2)


def test_anthropic_prefill_is_continued(up):
    """An assistant turn at the end (Anthropic's prefill) is carried on from, not answered anew:
    the demo model finishes the sentence, and the reply does not repeat the prefill."""
    import anthropic

    _, url, _, _ = up
    client = anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key="unused", max_retries=0)
    prefill = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    reply = client.messages.create(
        model="smollm2-135m-moe8", max_tokens=8, messages=prefill, extra_body={"temperature": 0}
    )
    text = reply.content[0].text
    assert "Paris" in text and not text.lstrip().startswith("The capital"), text


def test_completions_echo_scores_the_prompt_as_mlx_lm_does(up):
    """Echo + logprobs with max_tokens 0, as evaluation harnesses score a text: each prompt token's
    logprob given the ones before it, equal to mlx-lm's own model over the unsplit checkpoint."""
    import mlx.core as mx
    import mlx_lm

    from services.tools.demo_model import ensure_demo_model

    _, url, _, cache = up
    client = openai.OpenAI(base_url=url, api_key="unused")
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    reply = client.completions.create(
        model="smollm2-135m-moe8", prompt=text, echo=True, logprobs=2, max_tokens=0
    )
    choice = reply.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 0
    model, tokenizer = mlx_lm.load(str(ensure_demo_model(cache, progress=False)))
    ids = tokenizer.encode(text)
    logits = model(mx.array(ids)[None])[0].astype(mx.float32)
    expected = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[
        mx.arange(len(ids) - 1), mx.array(ids[1:])
    ]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == text and logprobs.token_logprobs[0] is None
    assert logprobs.token_logprobs[1:] == pytest.approx(expected.tolist(), abs=2e-3)
    # the 2 most likely tokens, and the prompt's own where it is neither (OpenAI: up to logprobs + 1)
    for token, logprob, top in zip(
        logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:], strict=True
    ):
        assert len(top) in (2, 3) and top[token] == pytest.approx(logprob), (token, top)
    # "Paris" after "The capital of France is" is the model's own first choice
    paris = logprobs.tokens.index(" Paris")
    assert max(logprobs.top_logprobs[paris], key=logprobs.top_logprobs[paris].get) == " Paris"


def test_a_worker_that_dies_is_started_again_and_the_stack_serves_on(up):
    proc, url, _, _ = up
    workers = service_pids(proc.pid, "expert")
    os.kill(workers[0], signal.SIGKILL)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    deadline = time.monotonic() + 120
    while True:  # 503 while core sees the worker missing, then served again
        try:
            reply = client.chat.completions.create(
                model="smollm2-135m-moe8", messages=QUESTION, temperature=0, max_tokens=16
            )
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
    assert "Paris" in reply.choices[0].message.content
    assert proc.poll() is None and workers[0] not in children_of(proc.pid)


def test_a_core_that_dies_is_started_again_and_the_gateway_serves_on(up):
    """kill -9 core: clients get clean errors (503, or the stream cut), up starts core again, and
    the same gateway serves again without a restart of its own."""
    proc, url, _, _ = up
    core = service_pids(proc.pid, "core")[0]
    gateway = service_pids(proc.pid, "gateway")
    os.kill(core, signal.SIGKILL)
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    deadline, statuses = time.monotonic() + 180, set()
    while True:
        try:
            reply = client.chat.completions.create(
                model="smollm2-135m-moe8", messages=QUESTION, temperature=0, max_tokens=16
            )
            break
        except openai.APIStatusError as error:
            statuses.add(error.status_code)
        except openai.APIConnectionError:
            statuses.add("connection")
        assert time.monotonic() < deadline and proc.poll() is None, statuses
        time.sleep(0.5)
    assert "Paris" in reply.choices[0].message.content
    assert statuses <= {503}, statuses  # the gateway stayed up and said why
    assert service_pids(proc.pid, "gateway") == gateway and core not in children_of(proc.pid)


def test_a_second_up_in_the_same_workdir_is_refused_and_the_first_serves_on(up):
    proc, url, workdir, _ = up
    second = run_cli("up", "--port", str(free_port()), "--workdir", str(workdir), timeout=120)
    assert second.returncode != 0 and "another moe-mesh up is running" in second.stderr
    assert all((workdir / name).exists() for name in ("core.sock", "expert-0.sock", "cluster.toml"))
    client = openai.OpenAI(base_url=url, api_key="unused")
    reply = client.chat.completions.create(
        model="smollm2-135m-moe8", messages=QUESTION, temperature=0, max_tokens=16
    )
    assert "Paris" in reply.choices[0].message.content


def test_sigterm_stops_everything_and_removes_sockets(up):
    proc, _, workdir, _ = up
    children = children_of(proc.pid)
    assert len(children) == 4  # 2 workers, core, gateway
    assert list(workdir.glob("*.sock"))
    assert len(list(workdir.glob("*.sock.frames"))) == 2  # the workers' same-host data path
    # core and both workers poll their frame reads only if each of the three has a core
    expected = str(round(spin_for(3) * 1e6))
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children]
    polling = [c[c.index(b"--frame-spin-us") + 1].decode() for c in commands if b"--frame-spin-us" in c]
    assert polling == [expected] * 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in children if alive(pid)], "orphan processes left behind"
    assert not list(workdir.glob("*.sock*"))
    # the gateway went first, so core refused new calls at once rather than after a drain
    draining = [line for line in (workdir / "core.log").read_text().splitlines() if '"draining"' in line]
    assert len(draining) == 1 and json.loads(draining[0])["drain_s"] == 0, draining


def test_without_a_workdir_progress_shows_and_the_logs_outlive_the_run(up):
    cache = up[3]  # the demo model is built there already
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.ops.cli",
            "--log-format",
            "console",
            "up",
            "--experts",
            "1",
            "--port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "MOE_MESH_CACHE": str(cache)},
    )
    try:
        wait_serving(proc)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    for line in ("[expert-0] weights read", "[expert-0] serving", "[core] weights read", "[core] serving"):
        assert line in err, err
    logs = Path(err.split("(logs in ")[1].split(")")[0])
    assert logs.parent == cache / "logs" and f"logs are in {logs}" in err
    assert sorted(p.name for p in logs.iterdir()) == ["core.log", "expert-0.log", "gateway.log"]
    assert '"stage": "serving"' in (logs / "core.log").read_text()  # the services' logs are JSON
    assert not list(logs.glob("*.sock*"))  # sockets lived elsewhere and are gone


def test_ctrl_c_lets_a_streamed_answer_finish(up):
    """Ctrl-C stops the gateway, then core, then the workers, each once the one before is gone: an
    answer being streamed finishes whole, since the workers its core needs serve until core exits."""
    cache = up[3]
    proc, url = start_up(cache, short_dir("mm-up-stop-"), "--experts", "1")
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=QUESTION,
            temperature=0,
            max_tokens=48,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        first = next(chunks)
        proc.send_signal(signal.SIGINT)
        rest = list(chunks)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    finished = [
        c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason
    ]
    assert finished == ["length"]
