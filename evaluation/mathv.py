"""MathVision's answer check, VLMEvalKit's `vlmeval/dataset/utils/mathv.py` is_equal (ParVL, Appendix
A.3): equal as text, else as numbers within 1e-6, else as LaTeX through latex2sympy2_extended (or
latex2sympy2), as mathv.py imports them, under its 30 s limit. Upstream eval()s the reply and the
parser's output; here a small arithmetic evaluator reads them, so no code from a reply ever runs.
scoring.py's MathVision scorer calls mathv_equal."""

from __future__ import annotations

import ast
import math
import operator
import signal
import sys
import threading
from contextlib import contextmanager

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def arithmetic(text: str):
    """The value of a plain arithmetic expression ("3/5", "-2**0.5", "1e-3"), else None. Replaces
    upstream's eval() of model output: only numbers and + - * / // % ** are evaluated."""

    def ev(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float, complex):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            # no 10^4000-size numbers
            if isinstance(node.op, ast.Pow) and (
                abs(right) > 1000 or (abs(left) > 1 and abs(right) * math.log10(abs(left)) > 4000)
            ):
                raise ValueError("power too large")
            return _OPS[type(node.op)](left, right)
        raise ValueError("not arithmetic")

    try:
        return ev(ast.parse(text.strip(), mode="eval").body)
    except (
        SyntaxError,
        ValueError,
        TypeError,
        ZeroDivisionError,
        OverflowError,
        MemoryError,
        RecursionError,
    ):
        return None


def mathv_equal(answer, truth) -> bool:
    """mathv.py is_equal: equal after lower/strip, or both arithmetic with |a - b| < 1e-6, or both
    LaTeX (latex_equal). Not reproduced: upstream's eval() of the reply "a" (any case) reads is_equal's
    own local variable a, so that reply equals every numeric answer there."""
    a, t = str(answer).lower().strip(), str(truth).lower().strip()
    if a == t:
        return True
    x, y = arithmetic(t), arithmetic(a)
    try:
        if x is not None and y is not None and abs(x - y) < 1e-6:
            return True
    except (TypeError, OverflowError):  # a huge integer against a float: not within 1e-6 either
        pass
    return latex_equal(t, a)


_LATEX: list = []  # latex_parser() once imported, or None when neither package is installed
LATEX_SECONDS = (
    30  # mathv.py's @timeout_decorator.timeout(30) on is_equal: a reply that takes longer is wrong
)


@contextmanager
def time_limit(seconds: float):
    """Raise TimeoutError inside after `seconds` (SIGALRM, as timeout_decorator does; the main thread
    only, elsewhere no limit)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum, frame):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def latex_parser():
    """latex2sympy as mathv.py imports it: latex2sympy2_extended's (VLMEvalKit's requirement), else
    latex2sympy2's; None, said in one line, when neither is installed. The two differ on an equation:
    latex2sympy2_extended reads "x=5" as Eq(x, 5), whose text is not a value (upstream's eval raises
    NameError, so the reply is wrong), latex2sympy2 as its right-hand side 5 (the reply is right)."""
    try:
        from latex2sympy2_extended import latex2sympy

        return latex2sympy
    except ImportError:
        pass
    try:
        from latex2sympy2 import latex2sympy

        return latex2sympy
    except ImportError:
        print(
            "note: latex2sympy2_extended is not installed: MathVision's LaTeX answers are compared as text and "
            "numbers only, where VLMEvalKit also parses them (pip install latex2sympy2_extended)",
            file=sys.stderr,
        )
        return None


def latex_equal(truth: str, answer: str) -> bool:
    """is_equal's last step: both parsed by latex2sympy; equal if the values of the two expressions'
    text are within 1e-6 (upstream eval()s that text, here the arithmetic evaluator reads it: a text
    that is not arithmetic, such as sqrt(2), fails there as eval's NameError does, and upstream's
    except then skips the rest), else if the expressions differ by less than 1e-6."""
    if not _LATEX:
        _LATEX.append(latex_parser())
    if _LATEX[0] is None:
        return False
    try:
        with time_limit(LATEX_SECONDS):
            ta, aa = _LATEX[0](truth), _LATEX[0](answer)
            x, y = arithmetic(str(ta)), arithmetic(str(aa))
            if x is None or y is None:
                return False
            return abs(x - y) < 1e-6 or bool(abs(ta - aa) < 1e-6)
    except (
        Exception
    ):  # the parser's errors on text that is not LaTeX, the time limit (upstream: a bare except)
        return False
