"""The CPU benchmark scripts run end to end in their smallest form, so they do not rot between the
runs that use them: bench/cpu_compare.py --tiny (flare's CPU attention against torch's, two
cells, one iteration each) writes its JSON with every field the results schema names, and
bench/plot_dp.py turns a training result file into its table, and bench/train_results.py reads a
data-parallel run's layout (ZeRO stage, accumulation) from flare-train's own lines; the GPU
benchmark bench/model_shapes.py keeps a sane shape table, refuses unknown models and passes by
name, and redraws its ratio table from a saved result. The numbers are not checked: they
are measurements, not tests. cpu_compare needs torch (its peer), which CI does not install (PyPI's
torch wheels are the CUDA builds); scripts/gpu-check.sh runs these tests with torch."""

import itertools
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")


def run(script, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, os.path.join(BENCH, script), *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_cpu_compare_tiny_writes_the_schema(tmp_path):
    pytest.importorskip("torch")
    done = run("cpu_compare.py", "--out", str(tmp_path), "--tiny", "--threads", "1")
    assert done.returncode == 0, done.stderr
    (path,) = tmp_path.glob("cpu_compare-*.json")
    result = json.loads(path.read_text())
    assert {"card", "date", "commit", "software", "threads", "rows", "ratios"} <= result.keys()
    assert {r["impl"] for r in result["rows"]} == {"flare", "torch-cpu"}
    for row in result["rows"]:
        assert {"impl", "pass", "dtype", "b", "s_q", "s_k", "h", "h_kv", "d", "causal", "ms", "gflops",
                "threads", "peak_mem_bytes"} <= row.keys()
        assert row["ms"] > 0 and row["threads"] == 1
    assert len(result["ratios"]) == len(result["rows"]) // 2


def test_plot_dp_table_from_a_result_file(tmp_path):
    rows = [{"impl": "flare-train", "model": "gpt2", "gpus": 1, "seq": 1024, "batch_per_gpu": 8,
             "tokens_per_s": 1000.0, "mfu": 0.4, "step_ms": 10.0, "peak_mem_bytes": 2**30},
            {"impl": "flare-train", "model": "gpt2", "gpus": 2, "dp": 2, "cp": 1, "seq": 1024,
             "batch_per_gpu": 8, "tokens_per_s": 1900.0, "mfu": 0.38, "step_ms": 10.5, "fwd_ms": 3.0,
             "bwd_ms": 6.0, "comm_ms": 5.0, "comm_exposed_ms": 0.5, "comm_gbps": 90.0},
            {"impl": "torch-ddp-compile", "model": "gpt2", "gpus": 2, "seq": 1024, "batch_per_gpu": 8,
             "tokens_per_s": 1500.0},
            {"impl": "flare-train", "model": "gpt2", "gpus": 4, "seq": 1024, "batch_per_gpu": 8,
             "error": "timed out"}]
    src = tmp_path / "train.json"
    src.write_text(json.dumps({"card": "test card", "rows": rows}))
    table = tmp_path / "table.md"
    done = run("plot_dp.py", str(src), "--table", str(table))
    assert done.returncode == 0, done.stderr
    lines = table.read_text().splitlines()
    assert len(lines) == 2 + 3  # header, rule, the three rows that ran
    assert any("1,900" in line and "2 × 1" in line for line in lines)


def test_train_results_reads_the_zero_stage_and_accumulation(tmp_path):
    # flare-train's own lines for a 4-rank ZeRO-2 run with 2 micro-batches per step.
    stdout = tmp_path / "run.log"
    stdout.write_text(
        "run: device cuda (test card), batch 2 x seq 1024 x accum 2 x 4 GPUs = 16384 tokens/step, 8 steps "
        "from step 0, lr 3.00e-04, recompute off, gradients fp32, estimated memory 40 GiB per GPU\n"
        "data parallel: 4 ranks (mpirun launch), ZeRO-2 (master weights, AdamW state and gradients sharded)\n"
        "throughput: median of steps 2-3: 400.0 ms/step, 40960 tokens/s, MFU 40.0%, peak device memory\n")
    log = tmp_path / "run.jsonl"
    log.write_text("".join(json.dumps({"step": s, "dp": 4, "fwd_ms": 100.0 + s, "memory_bytes": 2**35}) + "\n"
                           for s in (1, 2, 3)))
    out = tmp_path / "out"
    done = run("train_results.py", "--out", str(out), "--card", "test card",
               "--flare", f"llama2-7b:2:1024:{stdout}:{log}")
    assert done.returncode == 0, done.stderr
    (path,) = out.glob("train-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert (row["gpus"], row["dp"], row["cp"], row["zero"], row["grad_accum"]) == (4, 4, 1, 2, 2)
    assert row["gradients"] == "fp32"
    assert row["fwd_ms"] == 103.0  # the median over steps 2-3 only

    table = tmp_path / "table.md"
    done = run("plot_dp.py", str(path), "--table", str(table))
    assert done.returncode == 0, done.stderr
    assert "| 4 × 1, ZeRO-2 | 1024 | 2 × 2 accum |" in table.read_text()


def test_train_results_compares_memory_by_one_measure(tmp_path):
    # flare-train's peak is device memory in use; the peer's row carries both its allocated peak
    # and its device memory in use: the ratio must take the second, and say so.
    stdout = tmp_path / "run.log"
    stdout.write_text("throughput: median of steps 2-3: 100.0 ms/step, 1000 tokens/s, MFU 40.0%\n")
    log = tmp_path / "run.jsonl"
    log.write_text(json.dumps({"step": 2, "memory_bytes": 60 * 2**30}) + "\n")
    torch_row = {"impl": "torch-compile", "model": "gpt2", "gpus": 1, "seq": 1024, "batch_per_gpu": 4,
                 "tokens_per_s": 800.0, "step_ms": 125.0, "peak_mem_bytes": 40 * 2**30,
                 "device_in_use_bytes": 50 * 2**30}
    peer = tmp_path / "torch.json"
    peer.write_text(json.dumps({"card": "test card", "rows": [torch_row]}))
    old_peer = tmp_path / "torch_old.json"  # a row from before device_in_use_bytes was recorded
    old_peer.write_text(json.dumps({"card": "test card", "rows": [dict(torch_row, device_in_use_bytes=None)]}))
    for source, ratio, like in ((peer, 1.2, True), (old_peer, 1.5, False)):
        out = tmp_path / f"out_{source.stem}"
        done = run("train_results.py", "--out", str(out), "--flare", f"gpt2:4:1024:{stdout}:{log}",
                   "--torch", str(source))
        assert done.returncode == 0, done.stderr
        (path,) = out.glob("train-*.json")
        (entry,) = [c for c in json.loads(path.read_text())["comparison"] if "peak_mem_ratio" in c]
        assert entry["peak_mem_ratio"] == pytest.approx(ratio)
        assert entry["peak_mem_ratio_basis"].startswith("device memory in use") == like
        assert ("allocated peak" in done.stdout) != like


RESULTS = os.path.join(BENCH, "results")


@pytest.mark.parametrize("script,result", [
    ("plot_decode.py", "2026-11-28-h100-2fbe81e/decode.json"),
    ("plot_block_sparse.py", "2026-11-28-h100-ea1ae10/block-sparse.json"),
])
def test_plot_scripts_draw_the_committed_results(tmp_path, script, result):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "chart.png"
    done = run(script, "--out", str(chart), os.path.join(RESULTS, result))
    assert done.returncode == 0, done.stderr
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- bench/model_shapes.py: its shape table, its argument checks and its table, without a GPU ----

@pytest.fixture
def model_shapes():
    sys.path.insert(0, BENCH)
    try:
        import model_shapes
        yield model_shapes
    finally:
        sys.path.remove(BENCH)


def test_model_shapes_table_is_sane(model_shapes):
    names = [m.name for m in model_shapes.MODELS]
    assert len(names) == len(set(names))
    for m in model_shapes.MODELS:
        assert m.h % m.h_kv == 0, m
        assert m.d % 8 == 0 and 8 <= m.d <= 256, m
        assert list(m.seqlens) == sorted(set(m.seqlens)) and m.seqlens[0] > 0, m
        assert m.causals and set(m.causals) <= {True, False} and m.causals[0] is True, m
        for s in m.seqlens:
            b = model_shapes.batch_for(s)
            assert b >= 1 and abs(b * s - model_shapes.TOKENS) <= s / 2, (m.name, s, b)
    # What the grid is for: every power of two 512-8k, lengths no tile divides, GQA, head dims
    # of real models, causal everywhere and a few non-causal.
    seqlens = {s for m in model_shapes.MODELS for s in m.seqlens}
    assert {512, 1024, 2048, 4096, 8192} <= seqlens and {1000, 3000} <= seqlens
    assert {64, 80, 96, 128, 192} <= {m.d for m in model_shapes.MODELS}
    assert any(m.h_kv < m.h for m in model_shapes.MODELS)
    assert 0 < sum(False in m.causals for m in model_shapes.MODELS) < len(names)
    assert model_shapes.batch_for(3000) == 5 and model_shapes.batch_for(8192) == 2
    quick = list(model_shapes.cases(model_shapes.MODELS, quick=True))
    assert len(quick) == len(names) < len(list(model_shapes.cases(model_shapes.MODELS)))


@pytest.mark.parametrize("flag,value", [("--models", "gpt2,gpt5"), ("--passes", "fwd,fwdbwd")])
def test_model_shapes_rejects_unknown_names(flag, value):
    # --table-only: were the name let through, this would fail reading the file, not start a run.
    done = run("model_shapes.py", flag, value, "--table-only", "unused.json")
    assert done.returncode == 2
    bad = value.split(",")[1]
    assert f"{flag}: unknown" in done.stderr and repr(bad) in done.stderr, done.stderr


def test_model_shapes_table_only_ratios_and_cells_below_the_bar(tmp_path):
    def row(impl, s, causal, pass_, tflops, error=None):
        r = {"impl": impl, "model": "llama3-8b", "pass": pass_, "dtype": "bf16", "b": 16384 // s,
             "s_q": s, "s_k": s, "h": 32, "h_kv": 8, "d": 128, "causal": causal,
             "ms": None if tflops is None else 1.0, "tflops": tflops}
        return dict(r, error=error) if error else r
    rows = [row("flare", 1000, True, "fwd", 120.0), row("torch-cudnn", 1000, True, "fwd", 100.0),
            row("torch-flash", 1000, True, "fwd", 60.0),
            # exactly at the bar: not below it
            row("flare", 2048, True, "fwd", 110.0), row("torch-cudnn", 2048, True, "fwd", 100.0),
            row("torch-flash", 2048, True, "fwd", 100.0),
            row("flare", 3000, False, "fwd", 105.0), row("torch-cudnn", 3000, False, "fwd", 150.0),
            row("torch-flash", 3000, False, "fwd", None, "No available kernel"),
            row("flare", 3000, True, "bwd", 90.0), row("torch-cudnn", 3000, True, "bwd", 100.0),
            row("torch-flash", 3000, True, "bwd", 45.0)]
    src = tmp_path / "shapes.json"
    src.write_text(json.dumps({"card": "test card", "rows": rows}))
    done = run("model_shapes.py", "--table-only", str(src))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    cells = [line.split() for line in lines if line.startswith("llama3-8b")]
    assert [(c[4], c[5], c[6], c[-2], c[-1]) for c in cells] == [
        ("1000", "1", "fwd", "1.20", "2.00"), ("2048", "1", "fwd", "1.10", "1.10"),
        ("3000", "0", "fwd", "0.70", "-"), ("3000", "1", "bwd", "0.90", "2.00")]
    assert "fwd: flare / cuDNN: median 1.10, min 0.70 over 3 cells" in lines
    assert "fwd: flare / flash: median 1.55, min 1.10 over 2 cells" in lines
    assert "bwd: flare / cuDNN: median 0.90, min 0.90 over 1 cells" in lines

    def below(pass_):  # ("<pass>: N of M", [the indented cells listed under that line])
        i = next(i for i, line in enumerate(lines)
                 if line.startswith(f"{pass_}: ") and "below 1.10x cuDNN" in line)
        listed = itertools.takewhile(lambda x: x.startswith("  "), lines[i + 1:])
        return lines[i].split(" cells")[0], [x.strip() for x in listed]
    assert below("fwd") == ("fwd: 1 of 3", ["llama3-8b s=3000 non-causal 0.70x"])
    assert below("bwd") == ("bwd: 1 of 1", ["llama3-8b s=3000 causal 0.90x"])


def test_ncu_kernel_table_groups_by_name_per_step(tmp_path):
    # ncu's raw CSV: a header row, a units row, then one row per kernel launch (other lines are ncu's
    # own messages); times in ns with thousands separators.
    lines = [
        "==PROF== Connected to process 1",
        '"ID","Kernel Name","gpu__time_duration.sum"',
        '"","","ns"',
        '"0","gemm_a(int, float*)","1,000,000"',
        '"1","norm(float const*)","250,000"',
        '"2","gemm_a(int, float*)","3,000,000"',
        '"3","norm(float const*)","250,000"',
    ]
    path = tmp_path / "run.csv"
    path.write_text("\n".join(lines) + "\n")
    done = run("ncu_kernel_table.py", str(path), "--steps", "2", "--title", "t")
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == "t"
    assert out[1] == "sum of kernel times per step: 2.2 ms"
    assert out[3].split() == ["2.00", "1", "gemm_a"]
    assert out[4].split() == ["0.25", "1", "norm"]
