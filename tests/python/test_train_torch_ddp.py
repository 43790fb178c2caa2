"""bench/train_torch.py under torchrun, on the CPU: the data-parallel peer of flare's trainer.

What it pins: the launch environment's rules (alone without WORLD_SIZE or with a world of one,
a clear error for a partial or inconsistent one); the options that only make sense under a
launch or only alone; each rank's batches (random tokens differ between ranks; the shards dealt
as flare's loader deals them, so two ranks of batch 2 read the windows of one process of batch
4); the combination of the ranks' measurements (a step lasts as long as its slowest rank); and
an end-to-end launch of two ranks over gloo, DDP and FSDP2, whose JSON row must say 2 GPUs with
finite numbers that follow from the per-rank ones. Skipped where torch or torch.distributed's
launcher (torchrun) is missing.
"""

import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench")
sys.path.insert(0, BENCH)
import torch_models as tm  # noqa: E402
import train_torch  # noqa: E402

LAUNCH_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


@pytest.fixture
def alone(monkeypatch):
    """No launch in this process's environment, whatever ran pytest."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_launch_from_env():
    assert train_torch.launch_from_env({}) is None
    assert train_torch.launch_from_env({"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}) is None
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    assert train_torch.launch_from_env(env) == train_torch.Launch(rank=3, world=4, local_rank=1)
    bad = [({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK: unset"),
           ({"WORLD_SIZE": "2", "RANK": "0"}, "LOCAL_RANK: unset"),
           ({"WORLD_SIZE": "two", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE: 'two'"),
           ({"WORLD_SIZE": "0", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE: 0 must be >= 1"),
           ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, "RANK: 2 must be in [0, "),
           ({"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK: -1 must be >= 0")]
    for env, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[")):
            train_torch.launch_from_env(env)


def usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        train_torch.parse_args(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_options_alone_and_under_a_launch(alone, capsys):
    args = train_torch.parse_args(["--case", "gpt-tiny:2:32"])
    assert args.launch is None and args.device == 0
    assert train_torch.impl_name(args) == "torch-compile"
    assert "--fsdp: shards over the ranks" in usage_error(["--fsdp"], capsys)
    assert "--cpu: for --log runs or a torchrun launch" in usage_error(["--cpu", "--precision",
                                                                         "fp32"], capsys)
    alone.setenv("WORLD_SIZE", "2")
    alone.setenv("RANK", "1")
    alone.setenv("LOCAL_RANK", "1")
    args = train_torch.parse_args(["--cpu", "--precision", "fp32"])
    assert args.launch == train_torch.Launch(1, 2, 1) and args.device == 1
    assert train_torch.impl_name(args) == "torch-ddp-eager"
    args = train_torch.parse_args(["--fsdp"])
    assert train_torch.impl_name(args) == "torch-fsdp2-compile"
    log_run = ["--log", "x.json", "--data", "x", "--case", "gpt-tiny:2:32"]
    assert "--log: one process only" in usage_error(log_run, capsys)
    assert "--device: under torchrun" in usage_error(["--device", "0"], capsys)
    assert "--cpu: " in usage_error(["--cpu"], capsys)  # bf16 autocast is for the GPU
    alone.delenv("RANK")
    assert "torchrun environment: RANK: unset" in usage_error([], capsys)


def batches(argv, launch, count=3, batch=2, seq=8):
    args = train_torch.parse_args(argv + ["--case", f"gpt-tiny:{batch}:{seq}"])
    args.launch = launch
    config = tm.model_preset("gpt-tiny")
    return train_torch.batches_for(torch, tm, args, config, batch, seq, count, device="cpu")


def test_random_batches_differ_between_ranks(alone):
    alone_batches = batches([], None)
    rank0 = batches([], train_torch.Launch(0, 2, 0))
    rank1 = batches([], train_torch.Launch(1, 2, 1))
    for (x0, y0), (x, y), (x1, _) in zip(alone_batches, rank0, rank1):
        assert torch.equal(x0, x)  # rank 0 draws what one process draws
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
        assert not torch.equal(x, x1)


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (tm.SHARD_MAGIC, 1, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


def test_shards_are_dealt_to_the_ranks(alone, tmp_path):
    # Token value = position in the shard, so each window's first token names it.
    for s, n in enumerate([97, 121]):
        write_shard(str(tmp_path / f"s_{s}.bin"), list(range(n)))
    data = ["--data", str(tmp_path / "s_*.bin")]
    one = batches(data, None, count=5, batch=4, seq=8)
    ranks = [batches(data, train_torch.Launch(r, 2, r), count=5, batch=2, seq=8) for r in (0, 1)]
    for step, (x, _) in enumerate(one):
        together = torch.cat([ranks[0][step][0], ranks[1][step][0]])
        assert not torch.equal(ranks[0][step][0], ranks[1][step][0])
        assert sorted(map(tuple, together.tolist())) == sorted(map(tuple, x.tolist())), step


def test_combine_ranks_takes_the_slowest_rank():
    fast = train_torch.RankStats(10.0, 11.0, 9.0, 1000, 2000, 3000, True, 5.0, 4.0)
    slow = train_torch.RankStats(12.0, 12.5, 8.5, 900, None, 3500, False, 6.0, 3.0)
    both = train_torch.combine_ranks([fast, slow])
    assert both == train_torch.RankStats(12.0, 12.5, 9.0, 1000, None, 3500, False, 5.5, 3.5)
    assert train_torch.combine_ranks([fast]) == fast  # alone: the measurement as it was


def torchrun_available():
    return (torch.distributed.is_available() and torch.distributed.is_gloo_available()
            and importlib.util.find_spec("torch.distributed.run") is not None)


@pytest.mark.skipif(not torchrun_available(), reason="torch.distributed with gloo and torchrun "
                    "(torch.distributed.run) are needed to launch two ranks")
@pytest.mark.parametrize("parallel,model", [("ddp", "gpt-tiny"), ("fsdp2", "llama-tiny")])
def test_two_ranks_on_gloo(parallel, model, tmp_path):
    batch, seq = 2, 32
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "2", os.path.join(BENCH, "train_torch.py"), "--cpu", "--precision", "fp32",
               "--case", f"{model}:{batch}:{seq}", "--warmup", "1", "--steps", "3",
               "--out", str(tmp_path)] + (["--fsdp"] if parallel == "fsdp2" else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("tokens/s") == 1, done.stdout  # rank 0 alone prints
    files = glob.glob(str(tmp_path / "train_torch-*.json"))
    assert [os.path.basename(f).endswith(f"-{parallel}-x2.json") for f in files] == [True], files
    with open(files[0]) as f:
        result = json.load(f)
    assert result["launch"] == {"launcher": "torchrun", "world": 2, "parallel": parallel,
                                "backend": "gloo"}
    [row] = result["rows"]
    assert "error" not in row, row
    assert row["impl"] == f"torch-{parallel}-eager"
    assert (row["model"], row["gpus"], row["batch_per_gpu"], row["seq"]) == (model, 2, batch, seq)
    for key in ("tokens_per_s", "mfu", "step_ms", "step_ms_mean", "step_ms_min",
                "loss_first", "loss_last"):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert len(row["step_ms_per_rank"]) == 2 and len(row["peak_mem_bytes_per_rank"]) == 2
    assert row["step_ms"] == max(row["step_ms_per_rank"])
    assert row["peak_mem_bytes"] == max(row["peak_mem_bytes_per_rank"]) > 0
    assert row["tokens_per_s"] == pytest.approx(2 * batch * seq / (row["step_ms"] / 1e3), rel=1e-12)
    # A first loss near ln(vocab): the model started where it should, on the CPU in fp32.
    assert abs(row["loss_first"] - math.log(300)) < 1.0, row["loss_first"]
