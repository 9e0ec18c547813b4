"""services/common/task_source.py: one message per mistake in a task or its shape
overrides, and every door (gateway, generator, SDK, CLI) says that same message."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from litestar.exceptions import ClientException, ValidationException

from services.common.task_source import (
    TaskError,
    check_shape_overrides,
    check_task,
    parse_shape,
    unknown_overrides_message,
)
from tests.helpers import RELU_KERNEL, RELU_TASK

ROOT = Path(__file__).resolve().parents[2]

# (task, overrides) -> the one message, for each mistake.
MISTAKES = {
    "syntax": ("import torch\n\nclass Model(:\n    pass\n", {},
               "the task is not valid Python: line 3: invalid syntax"),
    "nul_byte": ("x = 1\0\n", {},
                 "the task is not valid Python: source code string cannot contain null bytes"),
    "missing": ("x = 1\ndef get_inputs():\n    return []\n", {},
                "the task must define class Model, get_inputs() and get_init_inputs() "
                "(KernelBench format); missing: Model, get_init_inputs"),
    "unknown_override": (RELU_TASK, {"batch": 4},
                         "shape_overrides name 'batch', which the task does not assign at "
                         "top level; it assigns: batch_size, dim"),
    "unknown_overrides": (RELU_TASK, {"batch": 4, "dim": 8, "width": 2},
                          "shape_overrides names 'batch', 'width', which the task does not "
                          "assign at top level; it assigns: batch_size, dim"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_has_one_message(mistake):
    task, overrides, message = MISTAKES[mistake]
    with pytest.raises(TaskError) as caught:
        check_task(task, overrides)
    assert str(caught.value) == message
    assert caught.value.field == ("shape_overrides" if "override" in mistake else "task_desc")


def test_a_good_task_and_known_overrides_pass():
    check_task(RELU_TASK, {"batch_size": 4, "dim": 8})
    check_task(RELU_TASK)
    # Source that does not parse is check_task_source's to refuse, not the overrides'.
    check_shape_overrides("class Model(:\n", {"batch": 4})
    assert unknown_overrides_message(["n"], []) == (
        "shape_overrides name 'n', which the task does not assign at top level; "
        "it assigns: (none)")


@pytest.mark.parametrize(("item", "words"), [
    ("batch_size", "expected NAME=VALUE"),
    ("=3", "expected NAME=VALUE"),
    ("scale=(0.5, 2.0)", "tuple of ints"),
    ("batch_size=1000000000000", "<= 2147483647"),
])
def test_parse_shape_refuses_with_the_reason(item, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        parse_shape(item)


@pytest.mark.parametrize("mistake", ["syntax", "missing", "unknown_override"])
def test_the_gateway_and_the_sdk_say_the_same(mistake):
    from services.gateway.inputs import check_task as gateway_check
    from services.sdk.task import Task
    from services.sdk.workers import WorkerManager

    task, overrides, message = MISTAKES[mistake]
    with pytest.raises((ClientException, ValidationException)) as refused:
        gateway_check(task, overrides)
    assert refused.value.detail == message

    class _Worker:
        arch = "x86_64"
        in_flight = 0

    manager = WorkerManager()
    manager.add(_Worker(), "cpu", "x86_64", 1)
    _, passed, info = asyncio.run(Task("relu", task, shape_overrides=overrides,
                                       worker_manager=manager).run())
    assert not passed and info["error"] == message
    if mistake == "unknown_override":
        from services.sdk.workers import build_request

        with pytest.raises(ValueError) as caught:
            build_request(task, RELU_KERNEL, "relu", backend="cpu", arch="x86_64",
                          shape_overrides=overrides)
        assert str(caught.value) == message


def test_the_cli_says_the_same_after_the_file_name(tmp_path):
    import subprocess

    task, overrides, message = MISTAKES["unknown_override"]
    path = tmp_path / "relu.py"
    path.write_text(task)
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "run", str(path), "--shape", "batch=4"],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"{path}: {message}" in proc.stderr
