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
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"--judge-url {url!r}: not an http(s) URL (an OpenAI-compatible base URL, as http://127.0.0.1:8000/v1)"
    if not model:
        return f"--judge-url needs --judge-model, the model name sent to it (the paper's: {PAPER_JUDGE})"
    if not vlmevalkit:
        return "--judge-url needs --vlmevalkit, a VLMEvalKit checkout whose extraction prompts are sent"
    if not key_env or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key_env):
        return f"--judge-key-env {key_env!r}: not the name of an environment variable"
    return None


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
            with urllib.request.urlopen(req, timeout=seconds) as r:
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
        self.cache = {c["key"]: c["reply"] for c in read_jsonl(cache)}
        self.calls, self.benchmark = 0, benchmark
        utils = Path(vlmevalkit) / JUDGE_READS[0]
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
                        f"judge {self.url}: a reply of more than {MAX_REPLY:,} bytes, where an answer "
                        f"is a few; is --judge-url a chat completions endpoint? nothing of it cached"
                    )
                reply = json.loads(reply)["choices"][0]["message"]["content"]
            except (
                urllib.error.URLError,
                OSError,
                KeyError,
                IndexError,
                TypeError,
                json.JSONDecodeError,
            ) as e:
                raise DataError(f"judge {self.url}: request failed: {e}") from None
            except RecursionError:  # Python's JSON reader recurses once per level
                raise DataError(
                    f"judge {self.url}: the reply is nested deeper than Python's JSON reader goes"
                ) from None
            self.cache[key], self.calls = reply, self.calls + 1
            with open(self.cache_path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"key": key, "reply": reply}, ensure_ascii=False) + "\n")
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
