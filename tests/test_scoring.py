"""The scorers (evaluation/scoring.py, evaluation/mathv.py) on hand-worked cases, each the edge a VLMEvalKit
rule exists for: VQA normalisation and consensus (vqa_eval.py), ChartQA's relaxed accuracy, DocVQA's ANLS,
OCRBench's hits, option extraction (matching_util.py can_infer), MMMU's split, MathVista, MathVision,
LogicVista, WeMath's strict score; then the LLM answer extractor (evaluation/judge.py), VLMEvalKit's
prompts sent to a loopback stub through `evaluate.py score --judge-url`."""

import json
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import pytest
from commands import main_out
from inputs import png_b64, write_tsv
from judge_fakes import StubJudge, fake_vlmevalkit, judge_server

from evaluation import mathv as M
from evaluation import scoring as S

# -- VQA normalisation and consensus (vqa_eval.py) -----------------------------------------------------


def test_vqa_normalisation_articles_punctuation_numbers_contractions():
    # article dropped, number word, final period
    assert S.normalize_vqa("The Two dogs.") == "2 dogs"
    assert S.normalize_vqa("an apple\tand\nA pear") == "apple and pear"
    assert S.normalize_vqa("dont stop") == "don't stop"
    assert (
        S.normalize_vqa("couldnt've") == "couldn't've"
        and S.normalize_vqa("couldn'tve") == "couldn't've"
    )
    assert S.normalize_vqa("somebody'd") == "somebodyd"  # upstream's reversed entry, kept
    # a mark touching a space is deleted, one inside a word becomes a space
    assert S.normalize_vqa("hello, world") == "hello world"
    assert S.normalize_vqa("well-known") == "well known"
    # a digit,digit comma anywhere deletes every mark instead
    assert S.normalize_vqa("1,000 well-known") == "1000 wellknown"
    assert S.normalize_vqa("3.5 m.") == "3.5 m"  # periods between digits stay
    assert S.normalize_vqa("None") == "0"
    assert S.normalize_vqa("ten eleven") == "10 eleven"  # the number-word table ends at ten


def test_strip_punctuation_removes_at_most_32_lone_periods():
    # upstream passes re.UNICODE (= 32) as re.sub's count: 32 lone periods go, a 33rd stays
    assert S.strip_punctuation("." * 32) == ""
    assert S.strip_punctuation("." * 33) == "."


def test_vqa_consensus_eq_a2():
    ten = ["2"] * 3 + ["3"] * 7
    # 3 references agree: those 3 see 2 matches among the others (2/3), the other 7 see 3 (1)
    assert S.vqa_consensus("two", ten) == pytest.approx((3 * 2 / 3 + 7) / 10)
    two = ["cat"] * 2 + ["dog"] * 8
    assert S.vqa_consensus("the cat", two) == pytest.approx((2 * 1 / 3 + 8 * 2 / 3) / 10)
    assert S.vqa_consensus("dog!", two) == 1.0
    assert S.vqa_consensus("bird", two) == 0.0
    # either side of the cap, 3 matches among the 9 others: 4 matching references of 10 -> each
    # matching one sees 3 others (3/3 = 1), each other one sees 4 (capped at 1): exactly 1.0
    assert S.vqa_consensus("2", ["2"] * 4 + ["3"] * 6) == 1.0
    # 1 matching reference: it sees 0 others (0), the 9 others see 1 (1/3): 9 * (1/3) / 10 = 0.3
    assert S.vqa_consensus("2", ["2"] + ["3"] * 9) == pytest.approx(0.3)
    # all 10 match: each sees 9 others, 9/3 = 3 capped at 1
    assert S.vqa_consensus("2", ["2"] * 10) == 1.0


# -- ChartQA relaxed accuracy, DocVQA ANLS, OCRBench hits ----------------------------------------------


def test_relaxed_accuracy_five_percent_inclusive():
    assert S.relaxed_correct("200", "210")  # exactly 5 %: kept (<=)
    assert S.relaxed_correct("200", "190")
    assert not S.relaxed_correct("200", "210.5")  # 5.25 %
    assert not S.relaxed_correct("200", "189.9")
    assert S.relaxed_correct("200", "209.9")  # 9.9 / 200 = 4.95 %: inside
    assert not S.relaxed_correct("200", "210.1")  # 10.1 / 200 = 5.05 %: outside
    assert S.relaxed_correct("50%", "0.51")  # the percent target is 0.5; 0.01 / 0.5 = 2 %
    assert not S.relaxed_correct("50%", "0.54")  # 0.04 / 0.5 = 8 %
    assert S.relaxed_correct("12%", "0.124")  # the percent target is 0.12; 3.3 % off
    assert not S.relaxed_correct("0", "0.0")  # a zero target needs the exact string
    assert S.relaxed_correct("Yes", "yes") and not S.relaxed_correct("Yes", "yes.")
    rows = [{"index": "1", "answer": "['100', 'hundred']"}, {"index": "2", "answer": "7"}]
    s = S.score("ChartQA_TEST", rows, {"1": " Hundred ", "2": "7.4"})
    assert s.value == 50.0 and [x["hit"] for x in s.per_row] == [1.0, 0.0]  # 7.4 is 5.7 % off


def test_anls_threshold_keeps_one_half():
    assert S.anls("hallo", ["hello"]) == pytest.approx(0.8)
    assert S.anls("abxy", ["abcd"]) == 0.5  # similarity exactly 0.5 is kept
    assert S.anls("axyz", ["abcd"]) == 0.0  # 0.25 < 0.5
    assert S.anls("AB c", ["ab"]) == 0.5  # lowercased; 2 edits over max length 4
    assert S.anls("  ab ", ["ab"]) == 1.0  # stripped before the distance
    assert S.anls("abxy", ["zzzz", "abcd"]) == 0.5  # the closest answer counts
    gt = "abcdefghijklmnopqrst"  # 20 letters; digits match none of them, so each one is one edit
    # 11 of 20 replaced: similarity 1 - 11/20 = 0.45 < 0.5 -> 0
    assert S.anls("abcdefghi" + "0" * 11, [gt]) == 0.0
    # 9 of 20 replaced: similarity 1 - 9/20 = 0.55 >= 0.5 -> kept as 0.55
    assert S.anls("abcdefghijk" + "0" * 9, [gt]) == pytest.approx(0.55)
    # the length is the raw string's: "a   b" -> "a b" is 1 edit from "ab", over max(2, 5) = 5 -> 0.8
    # (over the collapsed length 3 it would be 0.667)
    assert S.anls("a   b", ["ab"]) == pytest.approx(0.8)
    # ... and of the upper-cased strings: "aaaß".upper() = "AAASS" (5), "aaas" is 1 edit away -> 0.8
    assert S.anls("aaas", ["aaaß"]) == pytest.approx(0.8)
    s = S.score(
        "DocVQA_VAL",
        [
            {"index": "0", "answer": "['hello']"},
            {"index": "1", "answer": "['abcd']"},
            {"index": "2", "answer": f"['{gt}']"},
            {"index": "3", "answer": f"['{gt}']"},
        ],
        {"0": "hallo", "1": "axyz", "2": "abcdefghi" + "0" * 11, "3": "abcdefghijk" + "0" * 9},
    )
    assert s.value == pytest.approx(33.75)  # 100 * (0.8 + 0 + 0 + 0.55) / 4


def test_ocrbench_hits_and_handwritten_maths():
    rows = [
        {"index": "0", "answer": "['Hello']", "category": "Regular Text Recognition"},
        {
            "index": "1",
            "answer": "['x^2 + 1']",
            "category": "Handwritten Mathematical Expression Recognition",
        },
        {"index": "2", "answer": "['x^2 + 1']", "category": "Scene Text-centric VQA"},
        {"index": "3", "answer": "['a', 'STOP']", "category": "Scene Text-centric VQA"},
    ]
    s = S.score(
        "OCRBench", rows, {"0": "It says hello world", "1": "x^2+1", "2": "x^2+1", "3": "stop sign"}
    )
    assert [x["hit"] for x in s.per_row] == [True, True, False, True]
    assert s.value == 75.0  # 100 * hits / n (hits / 10 on the full 1,000 rows)
    hw = "Handwritten Mathematical Expression Recognition"
    assert not S.ocrbench_hit("X^2+1", ["x^2 + 1"], hw)  # no lowercasing for handwritten maths
    # spaces kept elsewhere
    assert S.ocrbench_hit("X^2+1", ["x^2 + 1"], "Regular Text Recognition") is False
    assert S.ocrbench_hit("X^2 + 1 it is", ["x^2 + 1"], "Regular Text Recognition")


# -- option extraction (matching_util.py can_infer) ----------------------------------------------------


CHOICES = {"A": "cat", "B": "dog", "C": "bird", "D": "fish"}


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("B", "B"),
        ("(C)", "C"),
        ("The answer is D.", "D"),
        ("answer is b", "B"),
        ("A and B", None),  # two letters: ambiguous
        ("AB", None),  # a multi-letter token is no option
        ("A cat sits on the mat in the picture", None),  # a leading article "A" is not an answer
        ("It is a dog", "B"),  # by option text
        ("cat or dog", None),  # two option texts
        ("Z", "Z"),
        ("Cannot determine the answer", "Z"),
        # a lone letter must be among the last 4 words (index > len(words) - 5)
        ("B is my choice", "B"),  # 4 words, B at index 0 > 4 - 5
        ("B is my final choice", None),  # 5 words, index 0 is not > 5 - 5
        ("The answer is B, not A", "B"),  # two letters: "answer is X" decides
        # option text: the reply may be at most 2 x the options' total length (3+3+4+4 = 14 -> 28)
        ("the one on the left is a dog", "B"),  # 28 characters
        ("the one on the left is a dog.", None),  # 29 characters
    ],
)
def test_can_infer(reply, expected):
    assert S.can_infer(reply, dict(CHOICES)) == expected


def test_can_infer_answer_is_only_abcd():
    five = dict(CHOICES, E="cow")
    assert S.can_infer("The answer is D, not A", five) == "D"
    assert S.can_infer("The answer is E, not A", five) is None  # upstream's pattern is [ABCD] only


def test_mmmu_validation_split_open_questions_and_unresolved():
    rows = [
        {"index": "1", "split": "validation", "answer": "B", "A": "cat", "B": "dog"},
        {"index": "2", "split": "validation", "answer": "42", "A": None},  # open question
        {"index": "3", "split": "validation", "answer": "A", "A": "cat", "B": "dog"},
        {"index": "4", "split": "dev", "answer": "A", "A": "cat", "B": "dog"},
    ]
    preds = {"1": "B", "2": "42", "3": "A or B, hard to say", "4": "A"}
    s = S.score("MMMU_DEV_VAL", rows, preds)
    assert s.n == 3  # the dev row is not scored
    assert [x["hit"] for x in s.per_row] == [True, True, False]
    assert s.unresolved == 1 and s.value == pytest.approx(200 / 3)


# -- MathVista, MathVision, LogicVista -----------------------------------------------------------------


def test_mathvista_post_check():
    mc = {
        "index": "0",
        "question_type": "multi_choice",
        "answer_type": "text",
        "choices": "['3/11', '8/11']",
        "answer": "8/11",
        "answer_option": "B",
    }
    integer = {
        "index": "1",
        "question_type": "free_form",
        "answer_type": "integer",
        "choices": None,
        "answer": "14",
    }
    flt = {
        "index": "2",
        "question_type": "free_form",
        "answer_type": "float",
        "choices": None,
        "answer": "1.5",
    }
    text = {
        "index": "3",
        "question_type": "free_form",
        "answer_type": "list",
        "choices": None,
        "answer": "[1, 2]",
    }
    assert S.mathvista_check(mc, "(B) 8/11") == (True, "B")
    assert S.mathvista_check(mc, "(A)") == (False, "A")
    assert S.mathvista_check(integer, " 14\n") == (True, 14)
    assert S.mathvista_check(integer, "14.0") == (False, None)  # int() refuses: needs the extractor
    assert S.mathvista_check(flt, "1.50") == (True, 1.5)
    # float() compared exactly: no tolerance
    assert S.mathvista_check(flt, "1.5000001") == (False, 1.5000001)
    assert S.mathvista_check(integer, "15") == (False, 15)
    # upstream never matches lists without a judge
    assert S.mathvista_check(text, "[1, 2]") == (False, None)
    s = S.score(
        "MathVista_MINI",
        [mc, integer, flt, text],
        {"0": "A", "1": "14.0", "2": "1.5", "3": "[1, 2]"},
    )
    assert [x["hit"] for x in s.per_row] == [False, False, True, False]
    assert s.unresolved == 2  # 14.0 and the list; a wrong letter is still an extraction


def test_mathvista_needs_its_answer_option_column(tmp_path, capsys):
    """Issue 37, item 7: MathVista's multiple-choice rows are scored against `answer_option`; a TSV without that
    column scored every such row wrong, silently (100 here would have been 0). It is a required column: one
    line naming it, exit 1, nothing written."""
    row = {
        "index": "0",
        "question": "Which?",
        "question_type": "multi_choice",
        "answer_type": "text",
        "choices": "['3/11', '8/11']",
        "answer": "8/11",
        "answer_option": "B",
        "image": png_b64(8, 8, 0),
    }
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"index": "0", "prediction": "(B) 8/11"}) + "\n")
    argv = [
        "score",
        "--benchmark",
        "MathVista_MINI",
        "--predictions",
        preds,
        "--out",
        tmp_path / "s.json",
    ]
    rc, out, _ = main_out(capsys, *argv, "--data", write_tsv(tmp_path / "full.tsv", [row]))
    assert rc == 0 and json.loads(out.splitlines()[-1])["score"] == 100.0
    (tmp_path / "s.json").unlink()
    no_option = write_tsv(
        tmp_path / "no_option.tsv", [{k: v for k, v in row.items() if k != "answer_option"}]
    )
    rc, out, err = main_out(capsys, *argv, "--data", no_option)
    assert (
        rc == 1
        and out == ""
        and err.count("\n") == 1
        and "missing required column(s) answer_option" in err
    )
    assert not (tmp_path / "s.json").exists()


def test_mathvision_equivalence_1e6_and_no_eval():
    free = {"index": "0", "choices": "[]", "answer": "3/5"}
    assert S.mathvision_check(free, "0.6")[0]
    assert S.mathvision_check(free, "0.6000001")[0]  # |a - b| = 1e-7 < 1e-6
    assert not S.mathvision_check(free, "0.601")[0]
    assert S.mathvision_check(free, "0.6000005")[0]  # 5e-7 < 1e-6
    assert not S.mathvision_check(free, "0.600002")[0]  # 2e-6 >= 1e-6
    # |a - b| = 1e-6 exactly: not < 1e-6
    assert M.mathv_equal("9e-7", "0") and not M.mathv_equal("1e-6", "0")
    # lower / strip
    assert S.mathvision_check({"index": "1", "choices": "[]", "answer": "A"}, " a ")[0]
    assert M.arithmetic("__import__('os').getcwd()") is None and M.arithmetic("9**9**9") is None
    # the power caps: an exponent up to 1000, and exponent * log10|base| up to 4000 (both inclusive)
    assert M.arithmetic("2**1000") == 2**1000 and M.arithmetic("2**1001") is None
    assert M.arithmetic("100000**800") == 10**4000  # 800 * log10(1e5) = 4000: allowed
    assert M.arithmetic("100000**801") is None  # 801 * 5 = 4005 > 4000
    assert not M.mathv_equal("9**900", "1.5")  # a huge integer against a float: no OverflowError
    mc = {"index": "2", "choices": "['1', '2', '3']", "answer": "C"}
    assert S.mathvision_check(mc, "The answer is (C)") == (True, "C")
    s = S.score("MathVision_MINI", [free, mc], {"0": "The answer is 0.6", "2": "C"})
    # a sentence is not 0.6
    assert [x["hit"] for x in s.per_row] == [False, True] and s.unresolved == 1


def test_mathvision_latex_answers_through_latex2sympy(monkeypatch, capsys):
    """is_equal's LaTeX step (latex2sympy2, the optional extra VLMEvalKit uses): fractions and powers
    on either side equal their values; a value whose text is not arithmetic (sqrt(2)) fails, as
    upstream's eval does; nothing of the reply is ever run. Without the package: one line, and LaTeX
    counts only as text."""
    monkeypatch.setattr(M, "_LATEX", [])
    assert M.mathv_equal("0.5", r"\frac{1}{2}") and M.mathv_equal(r"\dfrac{3}{4}", "0.75")
    assert M.mathv_equal("8", "2^{3}") and M.mathv_equal(r"2^{-1}", r"\frac{2}{4}")
    assert not M.mathv_equal("0.6", r"\frac{1}{2}") and not M.mathv_equal("1.41421356", r"\sqrt{2}")
    assert not M.mathv_equal(r"\frac{1}{3}", r"\frac{1}{2}") and not M.mathv_equal(
        "__import__('os')", r"\frac{1}{2}"
    )
    free = {"index": "0", "choices": "[]", "answer": r"\frac{3}{5}"}
    assert S.score("MathVision_MINI", [free], {"0": "0.6"}).per_row[0]["hit"]
    slow = lambda text: time.sleep(5)  # noqa: E731  a parse that does not end: wrong after the time limit, as upstream
    monkeypatch.setattr(M, "_LATEX", [slow])
    monkeypatch.setattr(M, "LATEX_SECONDS", 0.2)
    t0 = time.perf_counter()
    assert not M.mathv_equal("0.5", r"\frac{1}{2}") and time.perf_counter() - t0 < 2
    monkeypatch.setattr(M, "_LATEX", [])
    # as if not installed: its import raises ImportError
    monkeypatch.setitem(sys.modules, "latex2sympy2", None)
    monkeypatch.setitem(sys.modules, "latex2sympy2_extended", None)
    assert not M.mathv_equal("0.5", r"\frac{1}{2}") and not M.mathv_equal("0.5", r"\frac{1}{2}")
    assert capsys.readouterr().err.count("latex2sympy2_extended is not installed") == 1  # said once


class Equation:
    """What latex2sympy2_extended returns for "x=5": an Eq, printed Eq(x, 5), which is not a number."""

    def __str__(self):
        return "Eq(x, 5)"

    def __sub__(self, other):
        raise TypeError("an equation has no difference")

    __rsub__ = __sub__


def test_mathvision_equation_reply_is_scored_as_vlmevalkit_scores_it(monkeypatch, capsys):
    """mathv.py imports latex2sympy2_extended (VLMEvalKit's requirement) first and latex2sympy2 only
    without it. On the reply "x=5" against the answer 5 they differ: latex2sympy2_extended gives
    Eq(x, 5), whose text upstream's eval cannot read (NameError: is_equal is False, the row wrong);
    latex2sympy2 gives the right-hand side 5 (right). Both installed: the extended one decides."""
    extended = types.ModuleType("latex2sympy2_extended")
    extended.latex2sympy = lambda text: Equation() if "=" in text else int(text)
    plain = types.ModuleType("latex2sympy2")
    plain.latex2sympy = lambda text: int(text.split("=")[-1])
    monkeypatch.setitem(sys.modules, "latex2sympy2", plain)
    monkeypatch.setitem(sys.modules, "latex2sympy2_extended", extended)
    monkeypatch.setattr(M, "_LATEX", [])
    free = {"index": "0", "choices": "[]", "answer": "5"}
    assert S.mathvision_check(free, "x=5") == (False, "x=5") and S.mathvision_check(free, "5")[0]
    # only latex2sympy2: upstream's fallback
    monkeypatch.setitem(sys.modules, "latex2sympy2_extended", None)
    monkeypatch.setattr(M, "_LATEX", [])
    assert S.mathvision_check(free, "x=5") == (True, "x=5")
    assert "not installed" not in capsys.readouterr().err


def test_mathvision_equation_with_the_real_parser(monkeypatch):
    """The same with latex2sympy2_extended itself (requirements-dev.txt): "x=5" is not 5, 1/2 is 0.5."""
    pytest.importorskip("latex2sympy2_extended")
    monkeypatch.setattr(M, "_LATEX", [])
    assert not M.mathv_equal("x=5", "5") and M.mathv_equal("0.5", r"\frac{1}{2}")


def test_logicvista_letter_sets():
    row = {"index": "0", "answer": "A, C"}
    assert S.logicvista_check(row, "CA") == (True, "CA")  # order does not matter
    assert S.logicvista_check(row, "A") == (False, "A")  # all and only the reference letters
    assert S.logicvista_check(row, "ACD") == (False, "ACD")
    # not letters only: the judge would retry
    assert S.logicvista_check(row, "A, C") == (False, None)
    # capitals only, as the judge is told to reply
    assert S.logicvista_check(row, "ca") == (False, None)
    assert S.logicvista_check({"answer": "B"}, " B\n") == (True, "B")
    s = S.score(
        "LogicVista", [row, {"index": "1", "answer": "B"}], {"0": "The answer is A and C", "1": "B"}
    )
    assert s.value == 50.0 and s.unresolved == 1


# -- WeMath strict score (Eq. A1) ----------------------------------------------------------------------


def test_wemath_strict_score_mixed_groups():
    def group(gid, steps, hits):
        keys = [f"{steps}steps_{i}" for i in range(1, steps + 1)] + [f"{steps}steps_multi"]
        return [
            (
                {"index": f"{gid}-{k}", "ID": gid, "key": k, "answer": "A"},
                "<Answer>: <A>" if h else "Answer: B",
            )
            for k, h in zip(keys, hits)
        ]

    cases = (
        group("g1", 2, [1, 1, 1])
        + group("g2", 2, [1, 1, 0])
        + group("g3", 2, [1, 0, 1])
        + group("g4", 2, [0, 0, 0])
        + group("g5", 3, [1, 1, 1, 1])
        + group("g6", 3, [1, 1, 1, 0])
    )
    rows, preds = [r for r, _ in cases], {r["index"]: p for r, p in cases}
    s = S.score("WeMath", rows, preds)
    # CM: g1, g5; IG: g2, g6; RM (multi right, a step wrong: no credit): g3; IK: g4
    assert (s.extra["CM"], s.extra["IG"], s.extra["RM"], s.extra["IK"], s.extra["problems"]) == (
        2,
        2,
        1,
        1,
        6,
    )
    assert s.value == pytest.approx(50.0)  # 100 * (2 CM + 0.5 * 2 IG) / 6 = 300 / 6
    # VLMEvalKit's strict formula over its 525 groups: 100 * (525 - 0.5 * 2 IG - 1 RM - 1 IK) / 525 = 52200 / 525
    assert s.extra["vlmevalkit_strict"] == pytest.approx(99.4285714, abs=1e-6)
    only_ig = group("h1", 2, [1, 1, 0])  # one IG group alone: 0.5 of a problem -> 50.0
    assert (
        S.score("WeMath", [r for r, _ in only_ig], {r["index"]: p for r, p in only_ig}).value
        == 50.0
    )
    assert S.wemath_answer("thinking... <Answer>: <B>") == "B"
    assert S.wemath_answer("the answer is B") is None  # only the capitalised marker splits
    assert S.wemath_answer("Answer: Z") is None
    # letters A-H only
    assert S.wemath_answer("Answer: H") == "H" and S.wemath_answer("Answer: I") is None


# -- the LLM answer extractor --------------------------------------------------------------------------


def test_judge_extracts_only_unresolved_rows_and_caches(tmp_path, capsys):
    fake_vlmevalkit(tmp_path / "VLMEvalKit")
    img = png_b64(8, 8, 0)
    tsv = write_tsv(
        tmp_path / "m.tsv",
        [
            {
                "index": "1",
                "question": "Pet?",
                "A": "cat",
                "B": "dog",
                "answer": "B",
                "split": "validation",
                "image": img,
            },
            {
                "index": "2",
                "question": "Pet?",
                "A": "cat",
                "B": "dog",
                "answer": "A",
                "split": "validation",
                "image": img,
            },
        ],
    )
    preds = tmp_path / "p.jsonl"
    preds.write_text(
        json.dumps({"index": "1", "prediction": "the animal that barks"})
        + "\n"
        + json.dumps({"index": "2", "prediction": "A"})
        + "\n"
    )
    with judge_server() as url:
        argv = [
            "score",
            "--benchmark",
            "MMMU_DEV_VAL",
            "--data",
            tsv,
            "--predictions",
            preds,
            "--judge-url",
            url,
            "--judge-model",
            "stub",
            "--vlmevalkit",
            tmp_path / "VLMEvalKit",
        ]
        rc, out, _ = main_out(capsys, *argv)
        first = json.loads(out.splitlines()[-1])
        # only row 1 needed it
        assert rc == 0 and first["score"] == 100.0 and first["judge_calls"] == 1
        sent = StubJudge.requests[-1]["messages"][0]["content"]
        assert (
            sent
            == "MCQ-EXTRACT Q:Pet? O:There are several options: \nA. cat\nB. dog\n A:the animal that barks ->"
        )
        rc, _, _ = main_out(
            capsys, "score", "--benchmark", "MMMU_DEV_VAL", "--data", tsv, "--predictions", preds
        )
    # without a judge row 1 is unresolved; with the (now stopped) judge the cache answers: no request
    rc, out, _ = main_out(capsys, *argv)
    again = json.loads(out.splitlines()[-1])
    assert rc == 0 and again["score"] == 100.0 and again["judge_calls"] == 0
    # MathVista: a numeric reply that int() refuses goes to the extractor, whose "14" is then checked
    mv = write_tsv(
        tmp_path / "mv.tsv",
        [
            {
                "index": "0",
                "question": "Q?",
                "question_type": "free_form",
                "answer_type": "integer",
                "choices": "",
                "answer_option": "",
                "answer": "14",
                "image": img,
            }
        ],
    )
    (tmp_path / "mv.jsonl").write_text(
        json.dumps({"index": "0", "prediction": "It is fourteen"}) + "\n"
    )
    with judge_server() as url:
        rc, out, _ = main_out(
            capsys,
            "score",
            "--benchmark",
            "MathVista_MINI",
            "--data",
            mv,
            "--predictions",
            tmp_path / "mv.jsonl",
            "--judge-url",
            url,
            "--judge-model",
            "stub",
            "--vlmevalkit",
            tmp_path / "VLMEvalKit",
        )
    assert rc == 0 and json.loads(out.splitlines()[-1])["score"] == 100.0
    assert StubJudge.requests[-1]["messages"][0]["content"] == (
        "MATH-EXTRACT EX1\nEX2\nQ?\nModel respone: It is fourteenExtracted answer:"
    )
    assert (
        StubJudge.requests[-1]["max_tokens"] == 128 and StubJudge.requests[-1]["temperature"] == 0.0
    )


def test_a_judge_reply_past_its_bound_is_one_line_and_not_cached(tmp_path, capsys, monkeypatch):
    """Issue 38, item 9: a judge that replied 100 MB a request filled a 1.2 GB cache silently. A reply is read
    up to judge.MAX_REPLY bytes (here lowered to 1 KiB, the stub sends 4 KiB): past it, one line naming the
    judge, exit 1, nothing cached."""
    from evaluation import judge

    fake_vlmevalkit(tmp_path / "VLMEvalKit")
    tsv = write_tsv(
        tmp_path / "m.tsv",
        [
            {
                "index": "1",
                "question": "Pet?",
                "A": "cat",
                "B": "dog",
                "answer": "B",
                "split": "validation",
                "image": png_b64(8, 8, 0),
            }
        ],
    )
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"index": "1", "prediction": "the animal that barks"}) + "\n")

    class Flood(StubJudge):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"choices": [{"message": {"content": "B" * 4096}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    monkeypatch.setattr(judge, "MAX_REPLY", 1024)
    server = HTTPServer(("127.0.0.1", 0), Flood)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, cache = f"http://127.0.0.1:{server.server_port}/v1", tmp_path / "cache.jsonl"
    try:
        rc, _, err = main_out(
            capsys,
            "score",
            "--benchmark",
            "MMMU_DEV_VAL",
            "--data",
            tsv,
            "--predictions",
            preds,
            "--judge-url",
            url,
            "--judge-model",
            "stub",
            "--vlmevalkit",
            tmp_path / "VLMEvalKit",
            "--judge-cache",
            cache,
        )
    finally:
        server.shutdown()
        server.server_close()
    assert rc == 1 and err.strip().splitlines() == [
        f"error: judge {url}: a reply of more than 1,024 bytes, where an answer is a few; is --judge-url a chat "
        f"completions endpoint? nothing of it cached"
    ], err
    assert not cache.exists() or cache.read_text() == ""


def test_judge_wemath_mathvision_logicvista(tmp_path, capsys):
    fake_vlmevalkit(tmp_path / "VLMEvalKit")
    img = png_b64(8, 8, 0)
    cases = {  # benchmark -> (rows, predictions, expected score)
        "WeMath": (
            [
                {
                    "index": "1",
                    "question": "Angle? FORMAT-RULE",
                    "A": "30",
                    "B": "60",
                    "answer": "B",
                    "key": "2steps_1",
                    "ID": "g",
                },
                {
                    "index": "2",
                    "question": "Side?",
                    "A": "1",
                    "B": "2",
                    "answer": "A",
                    "key": "2steps_2",
                    "ID": "g",
                },
                {
                    "index": "3",
                    "question": "Area?",
                    "A": "3",
                    "B": "4",
                    "answer": "A",
                    "key": "2steps_multi",
                    "ID": "g",
                },
            ],
            {"1": "sixty degrees", "2": "A", "3": "A"},
            100.0,
        ),  # all three right with the extractor: CM
        "MathVision_MINI": (
            [{"index": "1", "question": "Ratio?", "choices": "[]", "answer": "3/5"}],
            {"1": "about three fifths"},
            100.0,
        ),
        "LogicVista": (
            [{"index": "1", "question": "Which?", "answer": "A, C"}],
            {"1": "I pick A and C"},
            100.0,
        ),
    }
    with judge_server() as url:
        for bench, (rows, preds, expected) in cases.items():
            tsv = write_tsv(tmp_path / f"{bench}.tsv", [r | {"image": img} for r in rows])
            pj = tmp_path / f"{bench}.jsonl"
            pj.write_text(
                "".join(json.dumps({"index": k, "prediction": v}) + "\n" for k, v in preds.items())
            )
            plain = main_out(
                capsys, "score", "--benchmark", bench, "--data", tsv, "--predictions", pj
            )[1]
            rc, out, _ = main_out(
                capsys,
                "score",
                "--benchmark",
                bench,
                "--data",
                tsv,
                "--predictions",
                pj,
                "--judge-url",
                url,
                "--judge-model",
                "stub",
                "--vlmevalkit",
                tmp_path / "VLMEvalKit",
            )
            assert rc == 0 and json.loads(out.splitlines()[-1])["score"] == expected, bench
            # the extractor made the difference
            assert json.loads(plain.splitlines()[-1])["score"] < expected, bench
    sent = [r["messages"][0]["content"] for r in StubJudge.requests]
    # WeMath: only the unresolved row is sent, with its template and the format rule removed
    assert (
        "MCQ-EXTRACT WEMATH Q:Angle?  O:There are several options: \nA. 30\nB. 60\n A:sixty degrees"
        in sent
    )
    assert "MATHV V1\nRatio?\nModel respone: about three fifthsExtracted answer:" in sent
    assert sent.count("LOGIC Q:Which? A:I pick A and C") == 2  # retried at temperature 0.5


def test_the_extractor_key_comes_from_the_environment_only(tmp_path, capsys, monkeypatch):
    """Issue 37, item 1: the endpoint's API key is read from an environment variable (--judge-key-env, by default
    OPENAI_API_KEY) and sent as a bearer token, never a flag: a server that wants it refuses a request without
    it (one line naming the judge, exit 1) and answers one with it; the key shows in no output and no file."""
    fake_vlmevalkit(tmp_path / "VLMEvalKit")
    tsv = write_tsv(
        tmp_path / "l.tsv",
        [{"index": "1", "question": "Which?", "answer": "A, C", "image": png_b64(8, 8, 0)}],
    )
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"index": "1", "prediction": "I pick A and C"}) + "\n")
    key = "sk-test-0123456789abcdef"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with judge_server(key=key) as url:
        argv = [
            "score",
            "--benchmark",
            "LogicVista",
            "--data",
            tsv,
            "--predictions",
            preds,
            "--judge-url",
            url,
            "--judge-model",
            "stub",
            "--vlmevalkit",
            tmp_path / "VLMEvalKit",
            "--out",
            tmp_path / "s.json",
        ]
        rc, out, err = main_out(capsys, *argv)
        assert (
            rc == 1
            and out == ""
            and err.count("\n") == 1
            and "HTTP 401 Unauthorized" in err  # the provider's status in one line (issue 46)
        )
        monkeypatch.setenv("MY_JUDGE_KEY", key)
        rc, out, err = main_out(capsys, *argv, "--judge-key-env", "MY_JUDGE_KEY")
        assert rc == 0 and json.loads(out.splitlines()[-1])["score"] == 100.0, err
        monkeypatch.setenv("OPENAI_API_KEY", key)  # the default variable
        (tmp_path / "p.jsonl.judge-stub.jsonl").unlink()  # no cached reply: ask again
        rc, out, err = main_out(capsys, *argv)
        assert rc == 0 and json.loads(out.splitlines()[-1])["judge_calls"] == 2, err
    assert key not in out + err and not [
        f for f in tmp_path.rglob("*") if f.is_file() and key in f.read_text()
    ]


class SlowJudge(BaseHTTPRequestHandler):
    """A judge that answers well-formed JSON a byte every 0.2 s (3 s in all), or, for the model "deep", a reply
    nested 200,000 deep."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reply = json.dumps({"choices": [{"message": {"content": "B"}}]})
        data = ("[" * 200_000 + "]" * 200_000 if body["model"] == "deep" else reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body["model"] == "deep":
            self.wfile.write(data)
            return
        step = max(1, len(data) // 15)
        # urllib's per-read timeout never fires: each read gets bytes
        for k in range(0, len(data), step):
            self.wfile.write(data[k : k + step])
            self.wfile.flush()
            time.sleep(0.2)

    def log_message(self, *args):
        pass


def test_judge_request_is_bounded_as_a_whole_and_a_deep_reply_is_one_line(
    tmp_path, capsys, monkeypatch
):
    """A judge that sends its reply a few bytes every 0.2 s never timed out (urllib's timeout is per read): the
    whole request is bounded (judge.REQUEST_SECONDS, here 1 s; item 14). A reply nested 200,000 deep was a
    RecursionError traceback (item 15). Each: one line naming the judge, exit 1, nothing cached."""
    from evaluation import judge

    fake_vlmevalkit(tmp_path / "VLMEvalKit")
    tsv = write_tsv(
        tmp_path / "m.tsv",
        [
            {
                "index": "1",
                "question": "Pet?",
                "A": "cat",
                "B": "dog",
                "answer": "B",
                "split": "validation",
                "image": png_b64(8, 8, 0),
            }
        ],
    )
    preds = tmp_path / "p.jsonl"
    preds.write_text(json.dumps({"index": "1", "prediction": "the animal that barks"}) + "\n")
    monkeypatch.setattr(judge, "REQUEST_SECONDS", 1, raising=False)
    # the slow reply goes on while the next is asked
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowJudge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/v1"
    try:
        for model, why in (
            ("slow", "request failed: no whole reply within 1 s"),
            ("deep", "the reply is nested deeper than Python's JSON reader goes"),
        ):
            t0 = time.monotonic()
            rc, out, err = main_out(
                capsys,
                "score",
                "--benchmark",
                "MMMU_DEV_VAL",
                "--data",
                tsv,
                "--predictions",
                preds,
                "--judge-url",
                url,
                "--judge-model",
                model,
                "--vlmevalkit",
                tmp_path / "VLMEvalKit",
            )
            assert (
                rc == 1 and out == "" and err.strip().splitlines() == [f"error: judge {url}: {why}"]
            ), err
            assert time.monotonic() - t0 < 2.5  # the slow reply takes 3 s to send
            assert not (tmp_path / f"p.jsonl.judge-{model}.jsonl").exists()
    finally:
        server.shutdown()
        server.server_close()
