"""How much of a KernelBench level the built-in coder solves, verified by the local worker.

``python -m bench.kernelbench --kernelbench-dir DIR --level 1 [--only 23,47] [--json]``

For every problem ``DIR/level<N>/<id>_<name>.py`` of a KernelBench checkout
(https://github.com/ScalingIntelligence/KernelBench, ``KernelBench/level<N>``):

1. **reduce its sizes**: the module-level integer literals that size its tensors
   (``batch_size = 4096``, ``height = width = 128``; not kernel sizes, strides,
   paddings, dilations, groups, dims or eps) are halved, largest first, until the
   inputs and parameters of one ``Model`` hold at most ``--max-elements`` elements
   (default 2**15, so Triton's CPU interpreter finishes in seconds). The rewritten
   source is the task, so names derived from the sizes (``bias_shape =
   (out_channels, 1, 1)``) follow them;
2. **lower** it with the built-in coder in its sandbox (:meth:`Sandbox.lower`, as the
   generator does, with the backend's launch parameters, ``launch_defaults``);
3. **verify** the candidate with :class:`services.worker.verifier.Verifier` on the
   ``cpu`` backend (or ``--backend cuda``): correctness over ``--trials`` seeds, the op
   audit, the ghost replay and a second input size, as a worker does.

Prints a table of families (pass / total, and the medians of the passing problems'
``traffic_ratio`` and ``modeled_speedup``), the refused operators by count, every
passing problem's ``traffic_ratio`` and ``modeled_speedup`` (from the verdict's counted
traffic, ``VerifyResult.traffic``: bytes moved over the minimal bytes, and the modeled
eager time over the candidate's; cpu backend only) and the total with the overall
medians; ``--json`` prints one JSON object per problem instead (``problem``,
``family``, ``status``: ``passed`` / ``refused`` / ``failed``, ``op``, ``error``,
``seconds``, ``traffic_ratio``, ``modeled_speedup``, ...), then one ``{"medians":
...}`` object (per family and ``overall``). Both time models are printed: the tile
model's speedup (``tile_speedup``, L2, occupancy and tile shape) beside the roofline's
(``modeled_speedup``). ``--limit N`` runs the first N problems only.

The GPU line, ``--backend cuda``: each problem at its own sizes (no reduction),
verified and timed in ``profile`` mode (eager PyTorch, ``torch.compile`` and the
candidate), and, where it holds at most ``--model-max-elements`` elements, verified on
``cpu`` as well for both models' times; prints per problem the measured times, both
speedups, ``peak_fraction`` and the modeled times beside the measured one, and per
family ``fast_1``, the geomean speedups, the median peak fraction and the model's
error (:func:`gpu_summary`). ``--measurements FILE`` prints that report from rows
saved with ``--json`` instead of running.

The facts line, ``--facts``: each problem is lowered at its own sizes for each GPU
family of ``--facts-families`` (default ``sm_90`` and ``gfx942``: the H100's and the
MI300X's autotune lists, services/generator/launch_configs.py) and verified on ``cpu``
at the reduced sizes given as shape overrides, so the compile check builds every
autotune config of every launch, the dry run at the task's own sizes included, for
that family's GPU (``h100``, ``mi300x``) with the real compiler
(services/worker/gpu_facts.py). Per problem and family it prints the kernels, the
autotune lists without a config that compiles without spilling (the acceptance: none),
and per family of problems the medians of the chosen configs' registers, spill bytes
and occupancy (resident warps over the arch's limit). The chosen config of a kernel is
the first of its list, in the table's order, that compiles, fits and does not spill
(the sources' lists lead with their strongest entries; an autotuner on a GPU times
them all), else the one that spills least.
Nothing of the checkout is copied anywhere but the verifier's scratch directories.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import math
import os
import re
import statistics
import sys
import time
import types
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import msgspec

# Module-level names that are not tensor extents: halving them changes the operator,
# not its size (the same substrings the worker's second-size rule leaves alone, plus
# reduction dims and a few KernelBench spellings).
_NOT_EXTENTS = ("kernel", "stride", "pad", "dilation", "group", "class", "head", "axis",
                "seed", "eps", "reduce", "scale", "margin", "factor", "value", "min", "max",
                "momentum", "alpha", "beta", "slope")
DEFAULT_MAX_ELEMENTS = 1 << 15


@dataclass
class Row:
    """One problem's outcome."""

    problem: str
    family: str
    status: str  # passed | refused | failed
    op: str = ""
    error: str = ""
    seconds: float = 0.0
    sizes: str = ""
    traffic_ratio: float | None = None
    modeled_speedup: float | None = None  # the roofline's (the verdict's modeled_speedup)
    tile_speedup: float | None = None
    tile_time_us: float | None = None
    roofline_time_us: float | None = None
    # Measured on a GPU (--backend cuda, mode profile), microseconds.
    eager_us: float | None = None
    compile_us: float | None = None
    kernel_us: float | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    peak_fraction: float | None = None
    # --facts: per compile family (sm_90, gfx942), :func:`compile_summary` of its verdict.
    facts: dict[str, dict[str, Any]] | None = None


def family(level: int, name: str) -> str:
    """A problem's family from its file name (KernelBench names say what they compute)."""
    n = name.lower()
    if level >= 2:
        if "convtranspose" in n or "conv_transpose" in n:
            return "conv_transpose+epilogue"
        if "conv" in n:
            return "conv+epilogue"
        if any(k in n for k in ("gemm", "matmul", "bmm", "linear")):
            return "gemm+epilogue"
        if any(k in n for k in ("rnn", "lstm", "gru")):
            return "recurrent"
        return "other"
    table = [
        ("conv", "convolution"),
        ("pool", "pooling"),
        ("cum", "scan"),
        ("loss", "loss"),
        ("attention", "attention"),
        ("norm", "normalization"),
        ("softmax", "softmax"),
        ("matmul", "matmul"),
        ("matrix", "matmul"),
        ("reduction", "reduction"),
        ("argm", "reduction"),
    ]
    for key, fam in table:
        if key in n:
            return fam
    return "elementwise"


def _is_extent(name: str) -> bool:
    return not any(part in name.lower() for part in _NOT_EXTENTS)


def _int_value(node: ast.expr) -> int | None:
    """The value of an integer constant expression (``2048 * 2``), else None."""
    if not all(isinstance(n, ast.Constant | ast.BinOp | ast.operator | ast.UnaryOp
                          | ast.unaryop) for n in ast.walk(node)):
        return None
    try:
        value = eval(compile(ast.Expression(node), "<size>", "eval"), {"__builtins__": {}})
    except Exception:  # noqa: BLE001 - not a plain number
        return None
    return value if type(value) is int else None


def _size_literals(tree: ast.Module) -> dict[str, ast.Constant]:
    """Module-level ``name = <int>`` (``a = b = <int>``, ``n = 2048 * 2``, ``shape =
    (4096,)``, ``layer_sizes = [400, 800]``, ``depth, height, width = 16, 32, 32``)
    literals that look like extents, folded to constants in ``tree``."""
    found: dict[str, ast.Constant] = {}
    for stmt in tree.body:
        if not isinstance(stmt, ast.Assign):
            continue
        if (len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Tuple)
                and isinstance(stmt.value, ast.Tuple)
                and len(stmt.targets[0].elts) == len(stmt.value.elts)):
            # depth, height, width = 16, 32, 32: each name its own literal
            for target, item in zip(stmt.targets[0].elts, stmt.value.elts, strict=True):
                value = _int_value(item)
                if (isinstance(target, ast.Name) and _is_extent(target.id)
                        and value is not None and value >= 2):
                    constant = ast.Constant(value)
                    stmt.value.elts[stmt.value.elts.index(item)] = constant
                    found[target.id] = constant
            continue
        names = [t.id for t in stmt.targets if isinstance(t, ast.Name)]
        if not names or not all(_is_extent(n) for n in names):
            continue
        items = (stmt.value.elts if isinstance(stmt.value, ast.Tuple | ast.List)
                 else [stmt.value])
        for index, item in enumerate(items):
            value = _int_value(item)
            if value is None or value < 2:
                continue
            constant = ast.Constant(value)
            if isinstance(stmt.value, ast.Tuple | ast.List):
                stmt.value.elts[index] = constant
                found[f"{names[0]}[{index}]"] = constant
            else:
                stmt.value = constant
                found[names[0]] = constant
    return found


def _elements(source: str) -> int:
    """Elements of one Model's inputs and parameters, counted on the meta device, where
    its forward runs too (so a size whose halving breaks the Model, an input channel
    count its first convolution fixes or an image too small for its pooling, raises)."""
    import torch

    module = types.ModuleType("kernelbench_task")
    exec(compile(source, "<task>", "exec"), module.__dict__)
    with torch.device("meta"):
        model = module.Model(*module.get_init_inputs())
        inputs = module.get_inputs()
        with torch.no_grad():
            model(*inputs)
    total = sum(x.numel() for x in inputs if isinstance(x, torch.Tensor))
    return total + sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for b in model.buffers())


def reduce_sizes(source: str, max_elements: int = DEFAULT_MAX_ELEMENTS) -> tuple[str, str]:
    """The task source with its size literals halved until it fits ``max_elements``.

    Returns:
        (the rewritten source, a ``name=value, ...`` summary of the sizes used).

    Raises:
        ValueError: the task does not run.
    """
    tree = ast.parse(source)
    literals = _size_literals(tree)
    frozen: set[int] = set()
    last: tuple[ast.Constant, int] | None = None
    for _ in range(400):
        text = ast.unparse(tree)
        try:
            count = _elements(text)
        except Exception as exc:  # noqa: BLE001 - a task the last halving broke
            if last is None:
                raise ValueError(f"the task does not run: {type(exc).__name__}: {exc}") from exc
            # e.g. channels no longer divisible by groups: keep that size, halve others
            last[0].value = last[1]
            frozen.add(id(last[0]))
            last = None
            continue
        if count <= max_elements:
            sizes = ", ".join(f"{n}={c.value}" for n, c in literals.items())
            return text, sizes
        shrinkable = [c for c in literals.values() if c.value > 2 and id(c) not in frozen]
        if not shrinkable:
            break
        biggest = max(shrinkable, key=lambda c: c.value)
        last = (biggest, biggest.value)
        biggest.value = max(2, biggest.value // 2)
    # Over budget even at its smallest (e.g. a convolution's weights): lower it anyway;
    # a refusal costs nothing and a kernel is verified at these sizes.
    text = ast.unparse(tree)
    sizes = ", ".join(f"{n}={c.value}" for n, c in literals.items())
    return text, sizes + f" (over {max_elements} elements)"


_OP = re.compile(r"cannot lower (?:graph node )?(aten\.[\w.]+|\S+)")


def refused_op(message: str) -> str:
    """The operator (or reason) a refusal names, e.g. ``aten.mm.default``."""
    match = _OP.search(message)
    if match:
        return match.group(1).rstrip(",;:")
    return message.split(";")[0][:80]


def _problems(args: argparse.Namespace) -> list[Path]:
    """The level's problem files, in id order, narrowed by ``--only`` and ``--limit``."""
    level_dir = Path(args.kernelbench_dir) / f"level{args.level}"
    if not level_dir.is_dir():
        raise SystemExit(f"no {level_dir}: give --kernelbench-dir the directory that holds "
                         "level1/, level2/, ... (KernelBench's KernelBench/ folder)")
    problems = sorted(level_dir.glob("*.py"), key=lambda p: int(p.name.split("_")[0]))
    if args.only:
        wanted = {int(x) for x in args.only.split(",")}
        problems = [p for p in problems if int(p.name.split("_")[0]) in wanted]
    if args.limit:
        problems = problems[:args.limit]
    return problems


async def run(args: argparse.Namespace) -> list[Row]:
    from services.common.verify_client import build_request
    from services.generator.coders.base import launch_defaults, lowering_sandbox
    from services.generator.coders.lowering_role import lower_in_sandbox
    from services.generator.lowering.errors import LoweringError
    from services.worker.verifier import Verifier

    problems = _problems(args)
    gpu = args.backend == "cuda"
    # Per process: two runs at once (level 1 beside level 2) must not share, and then
    # remove, one scratch directory.
    sandbox = lowering_sandbox(f"kernelbench-{os.getpid()}")
    verifier = Verifier(args.backend, worker_id=f"kernelbench-{os.getpid()}")
    # On a GPU the replayer counts nothing: the model's time comes from a cpu
    # verification of the same candidate at the same sizes, where it is small enough.
    modeler = Verifier("cpu", worker_id=f"kernelbench-model-{os.getpid()}") \
        if gpu and args.model_max_elements else None
    await asyncio.to_thread(sandbox.start)
    await asyncio.to_thread(verifier.start)
    if modeler is not None:
        await asyncio.to_thread(modeler.start)
    rows: list[Row] = []
    try:
        for path in problems:
            started = time.monotonic()
            row = Row(path.stem, family(args.level, path.stem), "failed")
            try:
                if gpu:  # the problem's own sizes
                    task = path.read_text()
                    row.sizes = "own"
                else:
                    task, row.sizes = await asyncio.to_thread(
                        reduce_sizes, path.read_text(), args.max_elements)
                code = await lower_in_sandbox(sandbox, task, {}, launch_defaults(args.backend),
                                              timeout_s=args.timeout,
                                              label=f"kb{path.stem.split('_')[0]}")
            except LoweringError as exc:
                row.status, row.op, row.error = "refused", refused_op(str(exc)), str(exc)
            except ValueError as exc:
                row.error = str(exc)
            else:
                request = build_request(
                    request_id=f"kb-{args.level}-{path.stem.split('_')[0]}", job_id="kernelbench",
                    candidate_id="c0", op_name=path.stem[:60], task_desc=task, code=code,
                    backend=args.backend, arch=args.arch, trials=args.trials,
                    timeout_s=args.timeout, mode="profile" if gpu else "verify")
                result = await verifier.verify(request, device=args.device)
                if result.passed:
                    row.status = "passed"
                    measured(row, result)
                    counted = result
                    if modeler is not None and await asyncio.to_thread(
                            _elements, task) <= args.model_max_elements:
                        counted = await modeler.verify(
                            msgspec.structs.replace(request, backend="cpu", mode="verify",
                                                    request_id=request.request_id + "-m"),
                            device="0")
                    modeled(row, counted)
                else:
                    row.error = f"{result.stage}: {result.error}"[:500]
            row.seconds = round(time.monotonic() - started, 1)
            rows.append(row)
            if not args.json:
                print(f"{row.status:8} {row.seconds:6.1f}s {row.problem}"
                      + (f"  [{row.op or row.error[:120]}]" if row.status != "passed" else ""),
                      file=sys.stderr, flush=True)
    finally:
        verifier.close()
        if modeler is not None:
            modeler.close()
        sandbox.close()
    return rows


# The GPU each compile family's facts are read for (services/worker/targets.py).
FACTS_TARGETS = {"sm_80": "a100", "sm_89": "l40s", "sm_90": "h100", "gfx90a": "mi250",
                 "gfx942": "mi300x"}


def _module_sizes(source: str) -> dict[str, Any]:
    """The module-level names of a task assigned an int or a tuple or list of ints,
    after running its module (what :func:`_elements` runs too: the bench's own
    KernelBench checkout, not a candidate)."""
    import torch  # noqa: F401 - the task's module imports it

    module = types.ModuleType("kernelbench_task")
    exec(compile(source, "<task>", "exec"), module.__dict__)
    names = {t.id for stmt in ast.parse(source).body if isinstance(stmt, ast.Assign)
             for target in stmt.targets
             for t in (target.elts if isinstance(target, ast.Tuple) else [target])
             if isinstance(t, ast.Name)}
    out: dict[str, Any] = {}
    for name in names:
        value = module.__dict__.get(name)
        if type(value) is int:
            out[name] = value
        elif isinstance(value, tuple | list) and all(type(v) is int for v in value):
            out[name] = list(value)
    return out


def size_overrides(source: str, reduced: str) -> dict[str, Any]:
    """The shape overrides that turn ``source``'s module-level sizes into ``reduced``'s
    (from :func:`reduce_sizes`): every module-level int, or tuple or list of ints, whose
    value differs once both modules ran, the names derived from the sizes included
    (``bias_shape = (out_channels, 1, 1)``: a worker rebinds names after the module
    ran, so a derived name keeps its old value unless overridden too); a tuple or list
    as the whole list."""
    old, new = _module_sizes(source), _module_sizes(reduced)
    return {name: value for name, value in new.items() if old.get(name) != value}


def _where_order(where: str) -> int:
    """The autotune config's number in a compile fact's ``where`` (0 when none)."""
    match = re.search(r", config (\d+)", where)
    return int(match.group(1)) if match else 0


def compile_summary(compile_facts: list[Any], target: str) -> dict[str, Any]:
    """One verdict's compile facts (``VerifyResult.compile_facts``) on ``target`` (a
    targets.py name), per kernel: ``kernels``, ``no_clean`` (kernels none of whose
    configs compiles, fits and does not spill: what the acceptance allows none of),
    ``failed`` (kernels with no config that compiled), and the chosen configs'
    ``registers``, ``spill_bytes`` and ``occupancy`` (resident warps over the arch's
    limit, 0-1), lists in kernel order. The chosen config is the first clean one in
    table order, else the one that spills least."""
    by_kernel: dict[str, list[Any]] = {}
    for fact in compile_facts:
        if fact.target == target:
            by_kernel.setdefault(fact.kernel, []).append(fact)
    out: dict[str, Any] = {"kernels": len(by_kernel), "no_clean": [], "failed": [],
                           "registers": [], "spill_bytes": [], "occupancy": []}
    for kernel, rows in sorted(by_kernel.items()):
        rows.sort(key=lambda f: _where_order(f.where))
        built = [f for f in rows if f.ok]
        clean = [f for f in built if f.spill_bytes == 0]
        if not built:
            out["failed"].append(kernel)
            out["no_clean"].append(kernel)
            continue
        if not clean:
            out["no_clean"].append(kernel)
        chosen = clean[0] if clean else min(built, key=lambda f: f.spill_bytes)
        out["registers"].append(chosen.registers)
        out["spill_bytes"].append(chosen.spill_bytes)
        out["occupancy"].append(round(chosen.occupancy_warps / chosen.max_warps, 4)
                                if chosen.max_warps else None)
    return out


async def run_facts(args: argparse.Namespace) -> list[Row]:
    """The ``--facts`` line (see the module's docstring): rows whose ``facts`` hold
    :func:`compile_summary` per family; ``status`` is ``passed`` when every family's
    kernels compiled with a clean config, ``failed`` otherwise (``error`` says which),
    ``refused`` when the built-in coder does not lower the problem."""
    from services.common.verify_client import build_request
    from services.generator.coders.base import launch_defaults, lowering_sandbox
    from services.generator.coders.lowering_role import lower_in_sandbox
    from services.generator.lowering.errors import LoweringError
    from services.worker.verifier import Verifier

    problems = _problems(args)
    families = [f.strip() for f in args.facts_families.split(",") if f.strip()]
    unknown = [f for f in families if f not in FACTS_TARGETS]
    if unknown:
        raise SystemExit(f"unknown --facts-families {unknown}: choose from "
                         f"{', '.join(FACTS_TARGETS)}")
    sandbox = lowering_sandbox(f"kernelbench-facts-{os.getpid()}")
    verifier = Verifier("cpu", worker_id=f"kernelbench-facts-{os.getpid()}",
                        compile_extra_targets="none")
    await asyncio.to_thread(sandbox.start)
    await asyncio.to_thread(verifier.start)
    rows: list[Row] = []
    try:
        for path in problems:
            started = time.monotonic()
            number = path.stem.split("_")[0]
            row = Row(path.stem, family(args.level, path.stem), "passed", facts={})
            own = path.read_text()
            try:
                reduced, row.sizes = await asyncio.to_thread(reduce_sizes, own,
                                                             args.max_elements)
                overrides = size_overrides(own, reduced)
                for fam in families:
                    target = FACTS_TARGETS[fam]
                    code = await lower_in_sandbox(
                        sandbox, own, {}, launch_defaults("cuda", fam),
                        timeout_s=args.timeout, label=f"kbf{number}{fam}")
                    result = await verifier.verify(build_request(
                        request_id=f"kbf-{args.level}-{number}-{fam}", job_id="kernelbench",
                        candidate_id="c0", op_name=path.stem[:60], task_desc=own, code=code,
                        backend="cpu", arch=target, trials=1, timeout_s=args.timeout,
                        shape_overrides=overrides, allow_unchecked=True), device="0")
                    summary = compile_summary(result.compile_facts or [], target)
                    row.facts[fam] = summary
                    problem = (f"{fam}: {result.stage}: {result.error}"[:300]
                               if not summary["kernels"] else
                               f"{fam}: no clean config for {summary['no_clean']}"
                               if summary["no_clean"] else "")
                    if problem:
                        row.status = "failed"
                        row.error = "; ".join(filter(None, [row.error, problem]))
            except LoweringError as exc:
                row.status, row.op, row.error = "refused", refused_op(str(exc)), str(exc)
            except ValueError as exc:
                row.status, row.error = "failed", str(exc)
            row.seconds = round(time.monotonic() - started, 1)
            rows.append(row)
            if args.json:  # as it comes: a long run interrupted keeps its rows
                print(json.dumps(asdict(row)), flush=True)
            else:
                print(f"{row.status:8} {row.seconds:6.1f}s {row.problem}"
                      + (f"  [{row.op or row.error[:160]}]" if row.error else ""),
                      file=sys.stderr, flush=True)
    finally:
        verifier.close()
        sandbox.close()
    return rows


def facts_summary(rows: list[Row]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per family of problems (and ``overall``) and per compile family: ``problems``
    with facts, ``kernels``, ``no_clean`` (autotune lists with no config that compiles
    without spilling), ``failed`` (kernels that compiled in no config), and the
    medians of the chosen configs' ``registers``, ``spill_bytes`` and ``occupancy``."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        if row.facts:
            groups.setdefault(row.family, []).append(row)
    groups = dict(sorted(groups.items()))
    groups["overall"] = [r for g in groups.values() for r in g]
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, group in groups.items():
        fams = sorted({f for r in group for f in (r.facts or {})})
        out[name] = {}
        for fam in fams:
            parts = [r.facts[fam] for r in group if fam in (r.facts or {})]
            flat = {k: [v for p in parts for v in p[k] if v is not None]
                    for k in ("registers", "spill_bytes", "occupancy")}
            out[name][fam] = {
                "problems": len(parts), "kernels": sum(p["kernels"] for p in parts),
                "no_clean": sum(len(p["no_clean"]) for p in parts),
                "failed": sum(len(p["failed"]) for p in parts),
                **{f"median_{k}": _median([float(v) for v in vs]) for k, vs in flat.items()}}
    return out


def facts_table(rows: list[Row]) -> str:
    """The ``--facts`` report as text: per family of problems and compile family, the
    problems and kernels with facts, the lists without a clean config, the kernels that
    compiled nowhere, and the chosen configs' median registers, spill bytes and
    occupancy; then each problem whose lists lack a clean config."""
    lines = [f"{'family':24} {'target':7} {'problems':>8} {'kernels':>7} {'no clean':>8} "
             f"{'failed':>6} {'regs':>6} {'spill B':>7} {'occupancy':>9}"]
    for name, per in facts_summary(rows).items():
        for fam, s in per.items():
            lines.append(f"{name[:24]:24} {fam:7} {s['problems']:>8} {s['kernels']:>7} "
                         f"{s['no_clean']:>8} {s['failed']:>6} "
                         f"{_num(s['median_registers']):>6} {_num(s['median_spill_bytes']):>7} "
                         f"{_num(s['median_occupancy']):>9}")
    bad = [r for r in rows if r.status != "passed"]
    if bad:
        lines += ["", "refused, failed, or an autotune list without a clean config:"]
        lines += [f"  {r.problem}: {r.status}: {(r.op or r.error)[:160]}" for r in bad]
    return "\n".join(lines)


def measured(row: Row, result: Any) -> None:
    """A GPU verdict's measured times and speedups into ``row`` (``mode="profile"``)."""
    row.eager_us, row.kernel_us = result.base_time_us, result.gen_time_us
    row.compile_us = result.compile_time_us
    row.speedup_eager = result.speedup_eager if result.speedup_eager is not None \
        else result.speedup
    row.speedup_compile, row.peak_fraction = result.speedup_compile, result.peak_fraction


def modeled(row: Row, result: Any) -> None:
    """A cpu verdict's counted traffic and both models into ``row``."""
    t = result.traffic
    if result.passed and t is not None:
        row.traffic_ratio, row.modeled_speedup = t.traffic_ratio, t.modeled_speedup
        row.tile_speedup = t.tile_speedup
        row.tile_time_us, row.roofline_time_us = t.tile_time_us, t.modeled_time_us


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def medians(rows: list[Row]) -> dict[str, dict[str, float | None]]:
    """Median ``traffic_ratio``, ``modeled_speedup`` (the roofline) and
    ``tile_speedup`` (the tile model) of the passing problems, per family and
    ``overall`` (None where no passing problem has counted traffic)."""
    passed = [row for row in rows if row.status == "passed"]
    groups = {fam: [r for r in passed if r.family == fam]
              for fam in sorted({r.family for r in passed})}
    groups["overall"] = passed
    return {name: {"traffic_ratio": _median([r.traffic_ratio for r in group]),
                   "modeled_speedup": _median([r.modeled_speedup for r in group]),
                   "tile_speedup": _median([r.tile_speedup for r in group])}
            for name, group in groups.items()}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: list[Row]) -> str:
    """Families (pass / total, median traffic ratio and modeled speedup), refused
    operators by count, each passing problem's traffic, and the total, as text."""
    fams: dict[str, list[int]] = {}
    for row in rows:
        counts = fams.setdefault(row.family, [0, 0])
        counts[0] += row.status == "passed"
        counts[1] += 1
    med = medians(rows)
    none = {"traffic_ratio": None, "modeled_speedup": None, "tile_speedup": None}
    lines = [f"{'family':28} pass / total  median traffic_ratio  median modeled_speedup "
             "(tile model / roofline)"]
    lines += [f"{fam:28} {p:4} / {t:<5} {_num(med.get(fam, none)['traffic_ratio']):>20}  "
              f"{_num(med.get(fam, none)['tile_speedup']):>14} / "
              f"{_num(med.get(fam, none)['modeled_speedup'])}"
              for fam, (p, t) in sorted(fams.items())]
    passing = [row for row in rows if row.status == "passed"]
    if passing:
        lines += ["", f"{'passed':48} traffic_ratio  tile_speedup  roofline_speedup"]
        lines += [f"  {row.problem[:46]:46} {_num(row.traffic_ratio):>13}  "
                  f"{_num(row.tile_speedup):>12}  {_num(row.modeled_speedup):>16}"
                  for row in passing]
    refused = Counter(row.op for row in rows if row.status == "refused")
    if refused:
        lines += ["", "refused operators (count):"]
        lines += [f"  {count:3}  {op}" for op, count in refused.most_common()]
    failed = [row for row in rows if row.status == "failed"]
    if failed:
        lines += ["", "lowered but failed verification:"]
        lines += [f"  {row.problem}: {row.error[:150]}" for row in failed]
    passed = sum(row.status == "passed" for row in rows)
    overall = med["overall"]
    lines += ["", f"total: {passed} / {len(rows)} passed; median traffic_ratio "
              f"{_num(overall['traffic_ratio'])}, median modeled_speedup "
              f"{_num(overall['tile_speedup'])} (tile model) / "
              f"{_num(overall['modeled_speedup'])} (roofline)"]
    return "\n".join(lines)


def _geomean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None and v > 0]
    if not present:
        return None
    return round(math.exp(sum(math.log(v) for v in present) / len(present)), 4)


def gpu_summary(rows: list[Row]) -> dict[str, dict[str, float | int | None]]:
    """Per family and ``overall``, of GPU-measured rows: ``problems``, ``passed``,
    ``fast_1`` (the share of all its problems that passed and ran faster than both
    eager PyTorch and ``torch.compile``, i.e. than max(eager, compile) in speed: as
    KernelBench's ``fast_p`` at p = 1; a problem whose compile time is missing counts
    against eager alone), the geomeans of ``speedup_eager`` and ``speedup_compile`` over
    the passing problems, the median ``peak_fraction``, and the model's error: the
    geomean of modeled / measured kernel time (``model_ratio``, 1 is exact) and the
    median of ``|log2(modeled / measured)|`` (``model_error_log2``), for the tile model
    and the roofline (``roofline_ratio``)."""
    groups: dict[str, list[Row]] = {}
    for row in rows:
        groups.setdefault(row.family, []).append(row)
    groups = dict(sorted(groups.items()))
    groups["overall"] = list(rows)
    out: dict[str, dict[str, float | int | None]] = {}
    for name, group in groups.items():
        passed = [r for r in group if r.status == "passed"]
        fast = [r for r in passed if r.speedup_eager is not None and r.speedup_eager > 1
                and (r.speedup_compile is None or r.speedup_compile > 1)]
        ratios = [r.tile_time_us / r.kernel_us for r in passed
                  if r.tile_time_us and r.kernel_us]
        roof = [r.roofline_time_us / r.kernel_us for r in passed
                if r.roofline_time_us and r.kernel_us]
        out[name] = {
            "problems": len(group), "passed": len(passed),
            "fast_1": round(len(fast) / len(group), 4) if group else None,
            "geomean_speedup_eager": _geomean([r.speedup_eager for r in passed]),
            "geomean_speedup_compile": _geomean([r.speedup_compile for r in passed]),
            "median_peak_fraction": _median([r.peak_fraction for r in passed]),
            "model_ratio": _geomean(ratios),
            "model_error_log2": _median([abs(math.log2(v)) for v in ratios]),
            "roofline_ratio": _geomean(roof),
            "modeled": len(ratios)}
    return out


def gpu_table(rows: list[Row]) -> str:
    """The GPU line as text: each problem's measured times (eager, torch.compile, the
    kernel), speedups, peak fraction and modeled times beside the measured one, then
    per family and overall: pass / total, fast_1, geomean speedups, median peak
    fraction and the model's error."""
    lines = [f"{'problem':40} {'eager us':>9} {'compile us':>10} {'kernel us':>9} "
             f"{'x eager':>7} {'x compile':>9} {'peak':>5} {'tile us':>9} {'roof us':>9}"]
    for r in rows:
        if r.status != "passed":
            lines.append(f"{r.problem[:40]:40} {r.status}: {(r.op or r.error)[:80]}")
            continue
        lines.append(f"{r.problem[:40]:40} {_num(r.eager_us):>9} {_num(r.compile_us):>10} "
                     f"{_num(r.kernel_us):>9} {_num(r.speedup_eager):>7} "
                     f"{_num(r.speedup_compile):>9} {_num(r.peak_fraction):>5} "
                     f"{_num(r.tile_time_us):>9} {_num(r.roofline_time_us):>9}")
    lines += ["", f"{'family':28} {'pass':>9} {'fast_1':>7} {'geo x eager':>11} "
              f"{'geo x compile':>13} {'med peak':>8} {'tile/meas':>9} {'|log2|':>6} "
              f"{'roof/meas':>9}"]
    for name, s in gpu_summary(rows).items():
        lines.append(f"{name:28} {s['passed']:>4} / {s['problems']:<3} {_num(s['fast_1']):>7} "
                     f"{_num(s['geomean_speedup_eager']):>11} "
                     f"{_num(s['geomean_speedup_compile']):>13} "
                     f"{_num(s['median_peak_fraction']):>8} {_num(s['model_ratio']):>9} "
                     f"{_num(s['model_error_log2']):>6} {_num(s['roofline_ratio']):>9}")
    return "\n".join(lines)


def read_rows(path: str) -> list[Row]:
    """Rows from a file of JSON lines (what ``--json`` prints; a ``{"medians": ...}``,
    ``{"gpu": ...}`` or ``{"facts_summary": ...}`` line is skipped). Raises ValueError
    naming a line that is not a row."""
    names = {f.name for f in fields(Row)}
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON: {exc}") from None
        if not isinstance(item, dict) or {"medians", "gpu", "facts_summary"} & set(item):
            continue
        unknown = set(item) - names
        if unknown or not {"problem", "family", "status"} <= set(item):
            raise ValueError(f"{path}:{number}: not a row (unknown {sorted(unknown)} or "
                             "missing problem/family/status)")
        rows.append(Row(**item))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernelbench-dir", default=os.environ.get("KERNELBENCH_DIR", ""),
                        help="KernelBench's problem directory (holds level1/, level2/, ...; "
                        "default: $KERNELBENCH_DIR)")
    parser.add_argument("--level", type=int, choices=(1, 2, 3, 4))
    parser.add_argument("--only", default="", help="comma-separated problem ids, e.g. 1,23,47")
    parser.add_argument("--limit", type=int, default=0,
                        help="the first N problems of the level only (0: all)")
    parser.add_argument("--arch", default="",
                        help="the GPU modeled (cpu) or run (cuda): a target of "
                        "services/worker/targets.py (default: h100 on cpu, h200 on cuda)")
    parser.add_argument("--device", default="0", help="the cuda device index (cuda)")
    parser.add_argument("--model-max-elements", type=int, default=1 << 22,
                        help="cuda: also count a passing problem on cpu for the models when "
                        "its inputs and parameters hold at most this many elements (0: "
                        "never)")
    parser.add_argument("--measurements", default="",
                        help="print the report of rows saved with --json (no run)")
    parser.add_argument("--max-elements", type=int, default=DEFAULT_MAX_ELEMENTS,
                        help="input + parameter elements of one reduced problem")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per lowering and per verification")
    parser.add_argument("--json", action="store_true", help="one JSON object per problem")
    parser.add_argument("--facts", action="store_true",
                        help="the GPU compiler's facts of every autotune config (registers, "
                        "spills, occupancy) per family, for --facts-families; no GPU needed")
    parser.add_argument("--facts-families", default="sm_90,gfx942",
                        help="compile families for --facts, comma-separated "
                        f"({', '.join(FACTS_TARGETS)})")
    args = parser.parse_args(argv)
    from services.common.logging import configure_logging

    # The verifier's log lines go to stderr, warnings and worse only: stdout is the
    # report (--json: one object per line).
    configure_logging("bench", "warning", "console")
    if args.facts:
        if args.level is None or not args.kernelbench_dir:
            parser.error("--facts needs --level and --kernelbench-dir (or $KERNELBENCH_DIR)")
        rows = asyncio.run(run_facts(args))
        if args.json:  # the rows were printed as they came
            print(json.dumps({"facts_summary": facts_summary(rows)}))
        else:
            print(facts_table(rows))
        return 0
    if args.measurements:
        try:
            rows = read_rows(args.measurements)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
        gpu = any(r.kernel_us is not None for r in rows)
    else:
        if args.level is None or not args.kernelbench_dir:
            parser.error("--level and --kernelbench-dir (or $KERNELBENCH_DIR) are required "
                         "unless --measurements is given")
        args.arch = args.arch or ("h100" if args.backend == "cpu" else "h200")
        rows = asyncio.run(run(args))
        gpu = args.backend == "cuda"
    if args.json:
        for row in rows:
            print(json.dumps(asdict(row)))
        print(json.dumps({"gpu": gpu_summary(rows)} if gpu else {"medians": medians(rows)}))
    else:
        print(gpu_table(rows) if gpu else table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
