"""The answer extractor as a remote service that can fail, lie or redirect (issue 46, rule 3): its reply cache read
back as an output, its errors and redirects in one line with the API key kept at its origin, a --judge-url with
credentials or a space, `score --out` onto the cache, and VLMEvalKit's prompt file as an input of a study's score.
The endpoint is a small server on 127.0.0.1 that answers what each test sets."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from commands import run_main
from judge_fakes import fake_vlmevalkit

import evaluate
import study

# -- rule 3: the answer extractor is a remote service that can fail, lie or redirect -------------------------


class Endpoint(BaseHTTPRequestHandler):
    """A chat endpoint on 127.0.0.1 that answers every POST (and GET) with `reply` (status, headers, body), and
    writes down each request's path and Authorization header."""

    reply: tuple = (200, {}, b"")
    seen: list = []

    def answer(self):
        if self.command == "POST":
            self.rfile.read(int(self.headers["Content-Length"]))
        Endpoint.seen.append(
            (self.server.server_port, self.path, self.headers.get("Authorization"))
        )
        status, headers, body = Endpoint.reply
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET = answer

    def log_message(self, *args):
        pass


@pytest.fixture
def endpoint():
    """Two servers (the endpoint and another origin), each answering Endpoint.reply; their base URLs."""
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), Endpoint) for _ in range(2)]
    for s in servers:
        # a quick shutdown
        threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True).start()
    Endpoint.seen = []
    yield [f"http://127.0.0.1:{s.server_port}/v1" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


def content(text) -> bytes:
    return json.dumps({"choices": [{"message": {"content": text}}]}).encode()


def make_judge(tmp_path, url, monkeypatch, cache=None):
    from evaluation.judge import Judge

    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-secret-46")
    kit = fake_vlmevalkit(tmp_path / "kit")
    return Judge(url, "m", cache or tmp_path / "cache.jsonl", kit, "LogicVista", "JUDGE_TEST_KEY")


def test_the_reply_cache_is_read_back_as_an_output(tmp_path, endpoint, monkeypatch):
    """A last line torn by a kill mid-append was appended onto, and every later run failed on it; an entry whose
    reply is not text (null) was cached and raised a traceback on every rerun. Now the torn line is cut off and
    its request asked again, a non-text entry is dropped and asked again, and a non-text reply is one line,
    nothing cached. A link planted at the cache path is refused, never followed."""
    from evaluation.tsv import DataError

    cache = tmp_path / "cache.jsonl"
    good = json.dumps({"key": "k1", "reply": "A"}) + "\n"
    cache.write_text(good + json.dumps({"key": "k2", "reply": None}) + "\n" + '{"key": "k3", "re')
    Endpoint.reply = (200, {}, content("B"))
    judge = make_judge(tmp_path, endpoint[0], monkeypatch, cache)
    assert cache.read_text() == good + json.dumps({"key": "k2", "reply": None}) + "\n"
    assert judge.cache == {"k1": "A"} and judge.ask("Q") == "B"
    assert len(make_judge(tmp_path, endpoint[0], monkeypatch, cache).cache) == 2
    Endpoint.reply = (200, {}, content(None))
    with pytest.raises(
        DataError, match=r"a reply whose content is null, not text; nothing of it cached"
    ):
        judge.ask("another")
    assert len(cache.read_text().splitlines()) == 3
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    with pytest.raises(DataError, match="a link to .*elsewhere.jsonl, not the reply cache"):
        make_judge(tmp_path, endpoint[0], monkeypatch, link)
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_an_endpoint_that_errs_or_redirects_is_one_line_and_gets_no_key_elsewhere(
    tmp_path, endpoint, monkeypatch
):
    """A 200 carrying {"error": ...} hid the provider's message; a redirect to another origin received the API
    key (urllib forwards Authorization). Now the provider's message is the line, and no redirect is followed."""
    from evaluation.tsv import DataError

    judge = make_judge(tmp_path, endpoint[0], monkeypatch)
    Endpoint.reply = (
        200,
        {},
        json.dumps({"error": {"message": "You exceeded your quota"}}).encode(),
    )
    with pytest.raises(DataError, match="answered with an error: You exceeded your quota"):
        judge.ask("Q")
    Endpoint.reply = (429, {}, json.dumps({"error": {"message": "Rate limit reached"}}).encode())
    with pytest.raises(DataError, match="HTTP 429 Too Many Requests: Rate limit reached"):
        judge.ask("Q")
    Endpoint.reply = (302, {"Location": endpoint[1] + "/steal"}, b"")
    with pytest.raises(
        DataError, match=r"redirected \(HTTP 302\) to http://127.0.0.1, not followed"
    ):
        judge.ask("Q")
    assert [port for port, *_ in Endpoint.seen] == [int(endpoint[0].split(":")[2][:-3])] * 3
    assert not cache_lines(tmp_path)


def cache_lines(tmp_path) -> list[str]:
    cache = tmp_path / "cache.jsonl"
    return cache.read_text().splitlines() if cache.exists() else []


@pytest.mark.parametrize(
    "url, line",
    [
        (
            "https://user:hunter2@api.example.com/v1",
            "--judge-url 'https://***@api.example.com/v1': carries a user name or password",
        ),
        ("https://api.example.com/v1 ", "holds a space or a control character; give the URL alone"),
    ],
)
def test_a_judge_url_with_credentials_or_a_space_is_one_line(tmp_path, capsys, url, line):
    """A URL with credentials printed them (and urllib cannot send them); a trailing space in a pasted URL gave a
    traceback. Both are flag errors, and the password is never printed."""
    argv = ["score", "--benchmark", "LogicVista", "--data", "d.tsv", "--predictions", "p.jsonl"]
    argv += ["--judge-url", url, "--judge-model", "m", "--vlmevalkit", "kit"]
    code, err = run_main(capsys, evaluate.main, argv)
    assert code == 2 and len(err) == 1 and line in err[0] and "hunter2" not in err[0], err


def test_score_out_onto_the_reply_cache_is_refused_and_prompts_are_inputs(tmp_path, capsys):
    """`score --out` onto the default cache path replaced the paid-for replies (the path is no flag, so the
    output-is-input rule never saw it): exit 2, the cache untouched. The VLMEvalKit file the prompts are read from
    is an input of a study's score: a changed prompt makes the score again."""
    from commands import parse_flags

    from evaluation.judge import prompt_file
    from evaluation.study_plan import pieces

    pred = tmp_path / "p.jsonl"
    cache = tmp_path / "p.jsonl.judge-m.jsonl"
    cache.write_text('{"key": "k", "reply": "A"}\n')
    argv = ["score", "--benchmark", "LogicVista", "--data", "d.tsv", "--predictions", pred]
    argv += ["--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m", "--vlmevalkit", "kit"]
    code, err = run_main(capsys, evaluate.main, [*argv, "--out", cache])
    assert code == 2 and len(err) == 1, err
    assert err[0].endswith(
        f"error: --out {cache}: would write the answer extractor's reply cache {cache}; an output is never "
        "an input: pick another --out (see --help)"
    ), err
    assert cache.read_text() == '{"key": "k", "reply": "A"}\n'
    c = parse_flags(
        study,
        ["--model", "m", "--data", "d.json", "--tsv", "lmu", "--out", tmp_path / "st"]
        + ["--judge-url", "http://127.0.0.1:9/v1", "--judge-model", "m", "--vlmevalkit", "kit"],
    )
    scores = [p for p in pieces(c) if p.name.startswith("score ") and p.name.endswith("LogicVista")]
    assert scores and all(
        p.inputs["--vlmevalkit's prompts"] == prompt_file(Path("kit"), "LogicVista") for p in scores
    )
