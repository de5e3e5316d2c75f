"""The answer extractor's world, faked: a VLMEvalKit checkout holding copies of its prompt builders
(vlmeval/dataset/utils/), and an OpenAI-compatible judge on 127.0.0.1 that answers and counts requests."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, for `import parvl`


FAKE_VLMEVALKIT = {
    "multiple_choice.py": """
def build_prompt(question, options, prediction):
    tmpl = 'MCQ-EXTRACT Q:{} O:{} A:{} ->'
    return tmpl.format(question, options, prediction)
def build_prompt_cn(question, options, prediction):
    tmpl = 'CN {} {} {}'
    return tmpl
def build_prompt_wemath(question, options, prediction):
    tmpl = 'MCQ-EXTRACT WEMATH Q:{} O:{} A:{}'
    question = question.replace('FORMAT-RULE', '')
    return tmpl
""",
    "logicvista.py": """
def build_prompt_logicvista(line):
    tmpl = 'LOGIC Q:{} A:{}'
    return tmpl
""",
    "wemath.py": "",
    "mathv.py": """
def get_gpt4_ICE():
    example_1 = "V1"
    return [example_1]
def build_mathv_gpt4_prompt(line):
    task_description = "MATHV "
    return task_description
""",
    "mathvista.py": """
def get_gpt4_ICE():
    example_1 = "EX1"
    example_2 = "EX2"
    return [example_1, example_2]
def build_mathvista_gpt4_prompt(line):
    task_description = "MATH-EXTRACT "
    return task_description
""",
}


class StubJudge(BaseHTTPRequestHandler):
    """Answers chat completions on the loopback address: option B for option prompts, 14 for maths; with a
    `key` set, only requests that carry it as a bearer token (401 otherwise)."""

    requests: list = []
    key: str | None = None

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if (
            StubJudge.key is not None
            and self.headers.get("Authorization") != f"Bearer {StubJudge.key}"
        ):
            self.send_error(401, "Unauthorized")
            return
        StubJudge.requests.append(body)
        prompt = body["messages"][0]["content"]
        if prompt.startswith("LOGIC"):  # first try not letters only: the extractor must retry
            reply = "AC" if body["temperature"] > 0 else "A and C"
        elif prompt.startswith("MATHV"):
            reply = "0.6"
        else:
            reply = "B" if prompt.startswith("MCQ-EXTRACT") else "14"
        data = json.dumps(
            {"choices": [{"message": {"role": "assistant", "content": reply}}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def fake_vlmevalkit(folder: Path) -> Path:
    """A VLMEvalKit checkout holding only the extraction prompts judge.py reads (FAKE_VLMEVALKIT)."""
    kit = folder / "vlmeval" / "dataset" / "utils"
    kit.mkdir(parents=True, exist_ok=True)
    for name, text in FAKE_VLMEVALKIT.items():
        (kit / name).write_text(text)
    return folder


@contextlib.contextmanager
def judge_server(key: str | None = None, max_requests: int = 500, seconds: float = 300):
    """A small OpenAI-compatible server (StubJudge) on 127.0.0.1 for the answer extractor, its base URL yielded:
    it answers at most `max_requests` requests and stops by itself after `seconds`, or when the block ends; with
    `key`, only requests carrying it."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubJudge)
    server.timeout = 0.2  # handle_request returns to the loop that checks the bounds
    stop, start, StubJudge.key = threading.Event(), time.monotonic(), key
    count = len(StubJudge.requests)

    def serve():
        while (
            not stop.is_set()
            and time.monotonic() - start < seconds
            and len(StubJudge.requests) - count < max_requests
        ):
            server.handle_request()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/v1"
    finally:
        stop.set()
        thread.join()
        server.server_close()
        StubJudge.key = None
