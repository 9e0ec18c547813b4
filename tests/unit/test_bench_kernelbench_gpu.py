"""bench.kernelbench's GPU line (--backend cuda) without a GPU: its arguments, and its
report from a file of measurements in the format its --json prints (rows a GPU run
would write), not a stand-in for the GPU."""

from __future__ import annotations

import json
import math

import pytest

from bench import kernelbench


def rows() -> list[dict]:
    def row(problem, family, status="passed", **measured):
        return {"problem": problem, "family": family, "status": status, **measured}

    return [
        # Faster than eager and compile: fast_1; modeled at twice its measured time.
        row("1_Conv2d_ReLU", "conv+epilogue", eager_us=100.0, compile_us=80.0,
            kernel_us=50.0, speedup_eager=2.0, speedup_compile=1.6, peak_fraction=0.5,
            tile_time_us=100.0, roofline_time_us=400.0),
        # Faster than eager, slower than torch.compile: not fast_1.
        row("2_Conv2d_Add", "conv+epilogue", eager_us=100.0, compile_us=40.0,
            kernel_us=50.0, speedup_eager=2.0, speedup_compile=0.8, peak_fraction=0.3,
            tile_time_us=25.0, roofline_time_us=100.0),
        # Refused: counts against its family's fast_1, not in the geomeans.
        row("3_Conv2d_Odd", "conv+epilogue", status="refused", op="aten.foo.default"),
        # No torch.compile time (compile failed): judged against eager alone.
        row("4_Gemm_ReLU", "gemm+epilogue", eager_us=30.0, kernel_us=10.0,
            speedup_eager=3.0, peak_fraction=0.8, tile_time_us=10.0),
    ]


@pytest.fixture
def measurements(tmp_path):
    path = tmp_path / "level2.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows())
                    + "\n" + json.dumps({"gpu": {}}) + "\n")
    return path


def test_fast_1_geomeans_peak_and_model_error_per_family(measurements) -> None:
    summary = kernelbench.gpu_summary(kernelbench.read_rows(str(measurements)))
    conv = summary["conv+epilogue"]
    assert (conv["problems"], conv["passed"]) == (3, 2)
    assert conv["fast_1"] == pytest.approx(1 / 3, abs=1e-4)
    assert conv["geomean_speedup_eager"] == pytest.approx(2.0)
    assert conv["geomean_speedup_compile"] == pytest.approx(math.sqrt(1.6 * 0.8), abs=1e-4)
    assert conv["median_peak_fraction"] == pytest.approx(0.4)
    # Modeled / measured: 2 and 0.5: geomean 1, yet one octave off each.
    assert conv["model_ratio"] == pytest.approx(1.0)
    assert conv["model_error_log2"] == pytest.approx(1.0)
    assert conv["roofline_ratio"] == pytest.approx(math.sqrt(8 * 2), abs=1e-4)
    gemm = summary["gemm+epilogue"]
    assert gemm["fast_1"] == 1.0 and gemm["model_error_log2"] == 0.0
    overall = summary["overall"]
    assert (overall["problems"], overall["passed"], overall["fast_1"]) == (4, 3, 0.5)


def test_the_report_prints_problems_families_and_the_model_beside_the_measurement(
        measurements, capsys) -> None:
    assert kernelbench.main(["--measurements", str(measurements)]) == 0
    out = capsys.readouterr().out
    assert "x compile" in out and "tile us" in out and "fast_1" in out
    line = next(x for x in out.splitlines() if x.startswith("1_Conv2d_ReLU"))
    assert line.split() == ["1_Conv2d_ReLU", "100.000", "80.000", "50.000", "2.000",
                            "1.600", "0.500", "100.000", "400.000"]
    assert "refused: aten.foo.default" in out
    family = next(x for x in out.splitlines() if x.startswith("conv+epilogue"))
    assert family.split()[1:6] == ["2", "/", "3", "0.333", "2.000"]
    assert kernelbench.main(["--measurements", str(measurements), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["gpu"]["overall"]["fast_1"] == 0.5


def test_arguments_of_the_gpu_line(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        kernelbench.main(["--backend", "cuda"])  # no level, no directory
    assert "--level and --kernelbench-dir" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"problem": "x", "family": "f", "status": "passed",
                               "kernel_seconds": 1}) + "\n")
    with pytest.raises(SystemExit):
        kernelbench.main(["--measurements", str(bad)])
    assert "bad.jsonl:1: not a row" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        kernelbench.main(["--backend", "rocm", "--level", "1"])
