"""evaluate.py score's optional LLM answer extractor (--judge-url): VLMEvalKit's extraction prompts,
read (parsed, not run) from a VLMEvalKit checkout, sent to an OpenAI-compatible endpoint for exactly
the rows VLMEvalKit would send to its judge; replies cached beside the predictions. The paper (Appendix
A.3): "Unresolved cases, and all LogicVista cases, use gpt-4o-2024-11-20 as a fixed answer extractor".

The endpoint's API key is read from an environment variable (--judge-key-env, OPENAI_API_KEY by default)
and sent as a bearer token: never a flag, so it shows in no command line (ps, a study's log) and no file."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from evaluation.scoring import can_infer, mmmu_choices
from evaluation.tsv import DataError, options, read_jsonl
from shell.files import regular_file

_CJK = re.compile("[\u4e00-\u9fa5]")  # smp/misc.py cn_string
# bytes of one reply: an extracted answer is a few bytes, a whole chat completion a few KiB
MAX_REPLY = 2**20
REQUEST_SECONDS = 120  # one request, whole: connection, headers and reply (urllib's timeout bounds each read alone)
# A.3's five with an extractor
JUDGED = ("MMMU_DEV_VAL", "MathVista_MINI", "MathVision_MINI", "LogicVista", "WeMath")
PAPER_JUDGE = "gpt-4o-2024-11-20"  # Appendix A.3's fixed answer extractor
# the one part of a VLMEvalKit checkout the extractor reads (its prompts), so that an --out elsewhere in the
# checkout is no overlap (shell.flags.output_is_input)
JUDGE_READS = ("vlmeval/dataset/utils",)
KEY_ENV = "OPENAI_API_KEY"  # where the key is read from by default: the variable OpenAI's own clients read


def judge_flags_problem(
    url: str | None, model: str | None, vlmevalkit: str | None, key_env: str | None
) -> str | None:
    """The answer extractor's flags that cannot work together, as one line naming the flag, or None: a URL
    that is not an http(s) one, --judge-url without --judge-model or --vlmevalkit, or those without it.
    A flag error (exit 2), found before anything runs: `evaluate.py score` and `study.py` share it."""
    if not url:
        given = [f for f, v in (("--judge-model", model), ("--vlmevalkit", vlmevalkit)) if v]
        return f"{given[0]} is the answer extractor's and needs --judge-url" if given else None
    # a pasted URL with a space or a line break: http.client would raise it as a traceback
    if any(c.isspace() or ord(c) < 32 for c in url):
        return (
            f"--judge-url {shown(url)!r}: holds a space or a control character; give the URL alone"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--judge-url {shown(url)!r}: not an http(s) URL (an OpenAI-compatible base URL, as http://127.0.0.1:8000/v1)"
    if parts.username is not None or parts.password is not None:  # never printed, never sent
        return (
            f"--judge-url {shown(url)!r}: carries a user name or password; give the URL without them and "
            f"the key in --judge-key-env's variable"
        )
    if not model:
        return f"--judge-url needs --judge-model, the model name sent to it (the paper's: {PAPER_JUDGE})"
    if not vlmevalkit:
        return "--judge-url needs --vlmevalkit, a VLMEvalKit checkout whose extraction prompts are sent"
    if not key_env or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
        return f"--judge-key-env {key_env!r}: not the name of an environment variable"
    return None


def shown(url: str) -> str:
    """A URL as a message may print it: a user name or password in it replaced by ***."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


# the VLMEvalKit file each judged benchmark's prompts are read from (vlmeval/dataset/utils/): inputs of its score
PROMPT_FILES = {
    "MMMU_DEV_VAL": "multiple_choice.py",
    "WeMath": "multiple_choice.py",
    "MathVista_MINI": "mathvista.py",
    "MathVision_MINI": "mathv.py",
    "LogicVista": "logicvista.py",
}


def prompt_file(vlmevalkit: Path, benchmark: str) -> Path | None:
    """The VLMEvalKit source the answer extractor's prompts for `benchmark` come from (None: not judged); a
    study makes a score again when it changes."""
    name = PROMPT_FILES.get(benchmark)
    return Path(vlmevalkit) / JUDGE_READS[0] / name if name else None


def load_cache(path: Path) -> dict[str, str]:
    """The reply cache, as an output is read back: a link at its path is refused (never followed, nor appended
    through); a last line torn by a kill mid-append is cut off the file (its request is asked again) rather than
    appended onto; an entry whose reply is not text (null, a list, NaN) is dropped and asked again."""
    if path.is_symlink():
        raise DataError(
            f"{path}: a link to {os.readlink(path)}, not the reply cache; remove it (the cache is never "
            f"written through a link)"
        )
    if path.exists():
        data = regular_file(path).read_bytes()  # a FIFO would block the read
        if data and not data.endswith(b"\n"):
            with open(path, "r+b") as f:
                f.truncate(data.rfind(b"\n") + 1)
    return {
        c["key"]: c["reply"]
        for c in read_jsonl(path)
        if isinstance(c, dict) and isinstance(c.get("key"), str) and isinstance(c.get("reply"), str)
    }


class NoRedirect(urllib.request.HTTPRedirectHandler):
    """No redirect is followed: urllib would send the Authorization header (the API key) on to whatever origin
    the endpoint names, and turn the POST into a GET. The 3xx comes back as an HTTPError, said in one line."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


OPENER = urllib.request.build_opener(NoRedirect)


def http_error(url: str, e: urllib.error.HTTPError) -> str:
    """An HTTP error reply in one line: a redirect with where it points (not followed), else the provider's
    own message when its body carries one ({"error": {"message": ...}})."""
    if 300 <= e.code < 400:
        where = urllib.parse.urlsplit(e.headers.get("Location") or "")
        return (
            f"judge {shown(url)}: redirected (HTTP {e.code}) to {where.scheme}://{where.hostname}, not "
            f"followed (the API key would go with it); give the endpoint's own URL as --judge-url"
        )
    try:
        said = error_text(json.loads(e.read(MAX_REPLY)))
    except (OSError, ValueError, RecursionError):
        said = None
    return f"judge {shown(url)}: HTTP {e.code} {e.reason}" + (f": {said}" if said else "")


def error_text(reply) -> str | None:
    """The provider's message in an OpenAI-style error body ({"error": {"message": ...}} or {"error": "..."}),
    or None for a body that is no error."""
    if not isinstance(reply, dict) or "error" not in reply:
        return None
    err = reply["error"]
    return " ".join(str(err.get("message", err) if isinstance(err, dict) else err).split())[:300]


def upstream_strings(path: Path, function: str) -> dict[str, str]:
    """String constants assigned inside `function` of a VLMEvalKit source file, by variable name,
    plus the first argument of its .replace(...) calls under "replace:<k>", read with ast (the
    file is parsed, never run)."""
    try:
        # a FIFO would block the read
        tree = ast.parse(regular_file(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError) as e:
        raise DataError(f"{path}: cannot read VLMEvalKit source: {e}") from None
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            found, k = {}, 0
            for sub in ast.walk(node):
                if (
                    isinstance(sub, ast.Assign)
                    and isinstance(sub.value, ast.Constant)
                    and isinstance(sub.value.value, str)
                ):
                    found.update(
                        {t.id: sub.value.value for t in sub.targets if isinstance(t, ast.Name)}
                    )
                if (
                    isinstance(sub, ast.Call)
                    and isinstance(sub.func, ast.Attribute)
                    and sub.func.attr == "replace"
                    and sub.args
                    and isinstance(sub.args[0], ast.Constant)
                ):
                    found[f"replace:{k}"], k = sub.args[0].value, k + 1
            return found
    raise DataError(f"{path}: has no function {function} (is this a VLMEvalKit checkout?)")


def post(url: str, body: dict, seconds: float | None = None, headers: dict | None = None) -> bytes:
    """The reply to `body` POSTed as JSON to `url`, the whole request within `seconds` (REQUEST_SECONDS): urllib's
    timeout bounds each read alone, so a server that sends a byte every 2 s never timed out. The request runs in a
    thread this one waits for; one that outlives the bound is left behind (a daemon), the command ending with its
    line. At most MAX_REPLY + 1 bytes are read. A failure is urllib's exception, or a TimeoutError (an OSError)."""
    seconds = REQUEST_SECONDS if seconds is None else seconds
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    got: dict = {}

    def fetch() -> None:
        try:
            with OPENER.open(req, timeout=seconds) as r:
                got["reply"] = r.read(MAX_REPLY + 1)  # no more than that is read, nor cached
        except Exception as e:  # handed to the waiting thread, which raises it
            got["error"] = e

    worker = threading.Thread(target=fetch, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no whole reply within {seconds:g} s")
    if "error" in got:
        raise got["error"]
    return got["reply"]


class Judge:
    """An OpenAI-compatible chat endpoint used the way VLMEvalKit uses its judge, with every reply
    cached in a JSONL file (keyed by model, prompt, temperature and attempt), so a rerun is free."""

    def __init__(
        self,
        url: str,
        model: str,
        cache: Path,
        vlmevalkit: Path,
        benchmark: str,
        key_env: str = KEY_ENV,
    ):
        self.url, self.model, self.cache_path = url.rstrip("/"), model, cache
        # unset or empty: no key sent (a local server needs none)
        self.key = os.environ.get(key_env) or None
        self.cache = load_cache(cache)
        self.calls, self.benchmark = 0, benchmark
        utils = Path(vlmevalkit) / JUDGE_READS[0]  # prompt_file's
        if benchmark in ("MMMU_DEV_VAL", "WeMath"):  # multiple_choice.py extract_answer_from_item
            name = "build_prompt_wemath" if benchmark == "WeMath" else "build_prompt"
            self.mcq = upstream_strings(utils / "multiple_choice.py", name)
            self.mcq_cn = upstream_strings(utils / "multiple_choice.py", "build_prompt_cn")["tmpl"]
        # build_mathvista_gpt4_prompt, get_gpt4_ICE
        elif benchmark in ("MathVista_MINI", "MathVision_MINI"):
            f = utils / ("mathvista.py" if benchmark == "MathVista_MINI" else "mathv.py")
            task = upstream_strings(
                f,
                "build_mathvista_gpt4_prompt"
                if benchmark == "MathVista_MINI"
                else "build_mathv_gpt4_prompt",
            )
            ice = upstream_strings(f, "get_gpt4_ICE")
            self.math = (
                task["task_description"],
                [ice[k] for k in sorted(ice) if k.startswith("example_")],
            )
        elif benchmark == "LogicVista":
            self.logic = upstream_strings(utils / "logicvista.py", "build_prompt_logicvista")[
                "tmpl"
            ]

    def ask(
        self, prompt: str, temperature: float = 0.0, attempt: int = 0, max_tokens: int | None = None
    ) -> str:
        key = hashlib.sha256(
            json.dumps([self.model, prompt, temperature, attempt]).encode()
        ).hexdigest()
        if key not in self.cache:
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": temperature,
            }
            if max_tokens:
                body["max_tokens"] = max_tokens
            headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
            try:
                reply = post(self.url + "/chat/completions", body, headers=headers)
                if len(reply) > MAX_REPLY:
                    raise DataError(
                        f"judge {shown(self.url)}: a reply of more than {MAX_REPLY:,} bytes, where an answer "
                        f"is a few; is --judge-url a chat completions endpoint? nothing of it cached"
                    )
                reply = json.loads(reply)
                # a 200 that carries the provider's error
                if (said := error_text(reply)) is not None:
                    raise DataError(
                        f"judge {shown(self.url)}: the endpoint answered with an error: {said}"
                    )
                reply = reply["choices"][0]["message"]["content"]
                if not isinstance(reply, str):  # null, a list, NaN: no answer, and nothing cached
                    raise DataError(
                        f"judge {shown(self.url)}: a reply whose content is {json.dumps(reply)[:60]}, not "
                        f"text; nothing of it cached"
                    )
            except urllib.error.HTTPError as e:
                raise DataError(http_error(self.url, e)) from None
            except (
                urllib.error.URLError,
                OSError,
                KeyError,
                IndexError,
                TypeError,
                json.JSONDecodeError,
            ) as e:
                raise DataError(f"judge {shown(self.url)}: request failed: {e}") from None
            except RecursionError:  # Python's JSON reader recurses once per level
                raise DataError(
                    f"judge {shown(self.url)}: the reply is nested deeper than Python's JSON reader goes"
                ) from None
            self.cache[key], self.calls = reply, self.calls + 1
            line = json.dumps({"key": key, "reply": reply}, ensure_ascii=False) + "\n"
            # O_NOFOLLOW: a link planted at the path since load_cache is refused, not appended through
            fd = os.open(
                self.cache_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644
            )
            with open(fd, "a", encoding="utf-8") as f:
                f.write(line)
        return self.cache[key]

    def __call__(self, kind: str, row: dict, prediction: str):
        # 3 tries; upstream then draws a random letter, we count the row unresolved
        if kind == "mcq":
            choices = mmmu_choices(row)[0] if self.benchmark == "MMMU_DEV_VAL" else options(row)
            option_str = "There are several options: \n" + "".join(
                f"{c}. {v}\n" for c, v in choices.items()
            )
            question = row["question"] or "nan"
            # its own template, after dropping the answer-format requirement
            if self.benchmark == "WeMath":
                tmpl = self.mcq["tmpl"]
                question = question.replace(self.mcq.get("replace:0", "\0"), "")
            else:  # the Chinese template for a question in Chinese
                tmpl = self.mcq_cn if _CJK.search(question) else self.mcq["tmpl"]
            prompt = tmpl.format(question, option_str, prediction)
            for attempt in range(3):
                got = can_infer(self.ask(prompt, 0.0, attempt), choices)
                if got is not None:
                    return got
            return None
        if kind == "math":  # 5 tries at temperature 0, 0.5, ...; the reply is the extracted answer
            task, examples = self.math
            prompt = task + "".join(e + "\n" for e in examples) + (row["question"] or "nan") + "\n"
            # upstream's spelling and spacing
            prompt += "Model respone: " + prediction + "Extracted answer:"
            for attempt in range(5):
                reply = self.ask(prompt, attempt * 0.5, attempt, max_tokens=128)
                if "Failed to obtain answer via API" not in reply:
                    return reply
            return None
        prompt = self.logic.format(row["question"] or "nan", prediction)  # LogicVista: 5 tries
        for attempt in range(5):
            reply = self.ask(prompt, attempt * 0.5, attempt, max_tokens=128)
            if reply.isupper() and reply.isalpha():
                return reply
        return None
