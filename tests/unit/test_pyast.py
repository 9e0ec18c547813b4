"""services.common.pyast.parse: threads that parse at once all get their trees.

CPython 3.11 shares the counter its tree builder checks between threads; a garbage
collection in mid-build that hands the GIL to another parsing thread makes one parse
raise ``SystemError: AST constructor recursion depth mismatch``. The worker saw it
when one device's static check (in a thread) met another device's kernel parse (on
the event loop). A gc callback that yields the GIL makes that switch frequent here.
"""

from __future__ import annotations

import ast
import gc
import threading
import time

import pytest

from services.common.pyast import parse

# Nested expressions (the builder's count goes up and down) in many functions (many
# objects, so many collections).
SOURCE = "x = " + "(" * 40 + "1" + ")" * 40 + "\n" + "\n".join(
    f"def f{i}(a):\n    return [a + {i} for _ in range(3)]" for i in range(400))


@pytest.fixture
def gil_handoffs():
    def yield_gil(phase, info):
        time.sleep(0)
    gc.callbacks.append(yield_gil)
    yield
    gc.callbacks.remove(yield_gil)


def test_threads_parsing_at_once_all_get_their_trees(gil_handoffs) -> None:
    errors: list[BaseException] = []
    trees: list[ast.Module] = []

    def work() -> None:
        for _ in range(8):
            try:
                trees.append(parse(SOURCE))
            except BaseException as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(trees) == 24
    assert all(len(tree.body) == 401 for tree in trees)


def test_a_failed_parse_leaves_the_lock_free() -> None:
    with pytest.raises(SyntaxError):
        parse("def f(:\n")
    with pytest.raises(RecursionError):
        parse("x = " + " + ".join(["1"] * 20_000))  # too deep for the tree builder
    done = threading.Event()
    thread = threading.Thread(target=lambda: (parse("y = 1"), done.set()))
    thread.start()
    thread.join(timeout=10)
    assert done.is_set()


def test_eval_mode_gives_an_expression() -> None:
    tree = parse("{'a': 1}", mode="eval")
    assert isinstance(tree, ast.Expression)
    assert ast.literal_eval(tree) == {"a": 1}
