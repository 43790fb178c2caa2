"""The PyTorch reference of flare's training models (bench/torch_models.py), on the CPU.

What it pins: the presets and the flat layout agree with src/train/core/model_config.cpp (numbers
printed by parameter_count(), parameter_layout().total and model_flops_per_token() of that file);
the modules hold exactly the layout's tensors; RoPE's LLaMA-3 scaling and rotation against direct
formulas; grouped-query attention through enable_gqa against repeated K/V heads; the loss's
handling of ignored targets and vocabulary padding; autograd against central differences on tiny
models; flare's shard order; and the round trips of the safetensors export names and the flat
buffer. Skipped where torch is not installed.
"""

import json
import math
import os
import random
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import torch_models as tm  # noqa: E402

# (parameter_count, parameter_layout().total, model_flops_per_token(c, 1024)) as printed by
# src/train/core/model_config.cpp for each preset.
CPP_PRESETS = {
    "gpt2": (124439808, 124475904, 797815296.0),
    "gpt2-medium": (354823168, 354871296, 2271713280.0),
    "gpt2-large": (774030080, 774090240, 4915822080.0),
    "gpt2-xl": (1557611200, 1557686400, 9801686400.0),
    "gpt3-125m": (125226240, 125262336, 797815296.0),
    "gpt3-350m": (355871744, 355919872, 2271713280.0),
    "gpt3-760m": (760300032, 760372224, 4766524416.0),
    "gpt3-1.3b": (1315723264, 1315819520, 8167305216.0),
    "gpt3-2.7b": (2651553280, 2651673600, 16374758400.0),
    "llama2-7b": (6738415616, 6738415616, 40447770624.0),
    "llama3-8b": (8030261248, 8030261248, 45833256960.0),
    "llama3.2-1b": (1235814400, 1235814400, 7615807488.0),
    "llama3.2-3b": (3212749824, 3212749824, 19803930624.0),
    "gpt-tiny": (123392, 128768, 1491456.0),
    "llama-tiny": (112448, 123200, 1344000.0),
}


def seeded():
    """A fresh seed per test, printed on failure (FLARE_TEST_SEED replays one)."""
    env = os.environ.get("FLARE_TEST_SEED")
    return int(env) if env else random.SystemRandom().randrange(2**31)


def tiny_model(name, dtype=torch.float64, seed=0):
    model = tm.FlareModel(tm.model_preset(name)).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # every tensor non-trivial, so no gradient path is hidden
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=dtype))
    return model


def tokens_and_targets(config, batch, seq, seed):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    targets[0, 1] = -1
    targets[-1, -1] = -1
    return tokens, targets


def test_presets_match_model_config_cpp():
    assert list(tm.PRESETS) == list(CPP_PRESETS)
    for name, (count, total, flops) in CPP_PRESETS.items():
        c = tm.model_preset(name)
        assert tm.parameter_count(c) == count, name
        assert tm.parameter_layout(c).total == total, name
        assert tm.model_flops_per_token(c, 1024) == pytest.approx(flops, rel=1e-12), name


@pytest.mark.parametrize("name", list(CPP_PRESETS))
def test_modules_hold_exactly_the_layout(name):
    # Built on the meta device: shapes without memory, so the 8B presets cost nothing.
    c = tm.model_preset(name)
    with torch.device("meta"):
        model = tm.FlareModel(c, rope_len=8, init=False)
    tm.check_state_matches_layout(model)
    layout = tm.parameter_layout(c)
    offsets = [p.offset for p in layout.params]
    assert all(o % tm.PARAM_ALIGNMENT == 0 for o in offsets)
    assert offsets == sorted(offsets)
    ends = [p.offset + p.numel for p in layout.params]
    assert all(e <= o for e, o in zip(ends, offsets[1:]))  # no overlap
    assert layout.total % tm.PARAM_ALIGNMENT == 0 and layout.total >= ends[-1]


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_forward_shapes_and_dtypes(name):
    model = tiny_model(name, torch.float32)
    c = model.c
    tokens, targets = tokens_and_targets(c, 3, 17, 1)
    logits = model(tokens)
    assert logits.shape == (3, 17, c.padded_vocab) and logits.dtype == torch.float32
    loss = model(tokens, targets)
    assert loss.shape == () and torch.isfinite(loss)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens).dtype == torch.bfloat16
        assert model(tokens, targets).dtype == torch.float32  # the loss stays fp32


def test_loss_ignores_minus_one_and_padding_columns():
    seed = seeded()
    c = tm.model_preset("gpt-tiny")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, c.padded_vocab, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, c.vocab_size, (2, 5), generator=gen)
    targets[1, 2] = -1
    loss = tm.classifier_loss(logits, targets, c.vocab_size)
    # Direct: -log softmax over the first vocab_size columns, mean over the 9 valid rows.
    total, valid = 0.0, 0
    for b in range(2):
        for t in range(5):
            if targets[b, t] < 0:
                continue
            row = logits[b, t, :c.vocab_size]
            total += float(torch.logsumexp(row, 0) - row[targets[b, t]])
            valid += 1
    assert valid == 9
    assert float(loss) == pytest.approx(total / valid, rel=1e-12), f"seed {seed}"
    poisoned = logits.clone()
    poisoned[..., c.vocab_size:] = 1e4  # padding columns are not classes
    poisoned[1, 2] = float("nan")       # an ignored row takes no part
    assert float(tm.classifier_loss(poisoned, targets, c.vocab_size)) == float(loss)


def direct_llama3_inv_freq(head_dim, theta, factor, low, high, original):
    """LLaMA-3's scaling written over frequencies instead of wavelengths: a frequency f (radians
    per position) keeps its value when a period is shorter than original/high positions, is
    divided by factor when longer than original/low, and between them is mixed with weight
    s = (original·f/(2π) - low)/(high - low) on the unscaled value."""
    out = []
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2 * i / head_dim)
        cycles = original * f / (2 * math.pi)  # periods of f within the original context
        if cycles > high:
            out.append(f)
        elif cycles < low:
            out.append(f / factor)
        else:
            s = (cycles - low) / (high - low)
            out.append(s * f + (1 - s) * f / factor)
    return np.array(out)


@pytest.mark.parametrize("name", ["llama3.2-1b", "llama3.2-3b"])
def test_rope_llama3_scaling_against_direct_formula(name):
    c = tm.model_preset(name)
    s = c.rope_scaling
    got = tm.rope_inv_freq(c.head_dim, c.rope_theta, s)
    want = direct_llama3_inv_freq(c.head_dim, c.rope_theta, s.factor, s.low_freq_factor,
                                  s.high_freq_factor, s.original_max_position)
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
    unscaled = tm.rope_inv_freq(c.head_dim, c.rope_theta, tm.RopeScaling())
    assert got[0] == unscaled[0] == 1.0           # the fastest pair is kept
    assert got[-1] == unscaled[-1] / s.factor      # the slowest is slowed by factor
    band = (got != unscaled) & (got != unscaled / s.factor)
    assert band.any()                              # and the presets do hit the mixed band
    cos, sin = tm.rope_table(4096, c.head_dim, c.rope_theta, s)
    for p in (0, 1, 977, 4095):
        for i in (0, 5, c.head_dim // 2 - 1):
            assert float(cos[p, i]) == np.float32(math.cos(p * want[i]))
            assert float(sin[p, i]) == np.float32(math.sin(p * want[i]))


def test_rope_rotates_pairs_half_a_head_apart():
    seed = seeded()
    gen = torch.Generator().manual_seed(seed)
    B, H, T, D = 2, 3, 7, 16
    x = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)
    cos, sin = tm.rope_table(T, D, 1e4, tm.RopeScaling())
    got = tm.apply_rope(x, cos.double(), sin.double())
    # The pair (x[i], x[i + D/2]) as the complex number x[i] + j·x[i + D/2], times
    # cos + j·sin = e^(j·angle).
    z = torch.complex(x[..., :D // 2], x[..., D // 2:]) * torch.complex(cos.double(), sin.double())
    want = torch.cat((z.real, z.imag), dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")


def test_gqa_equals_repeated_kv_heads():
    seed = seeded()
    c = tm.model_preset("llama-tiny")
    c.n_head, c.n_kv_head = 8, 2  # 4 query heads per K/V head
    c.d_model = c.n_head * c.head_dim
    torch.manual_seed(seed)
    attn = tm.Attention(c).double()
    x = torch.randn(2, 11, c.d_model, dtype=torch.float64)
    cos, sin = tm.rope_table(11, c.head_dim, c.rope_theta, c.rope_scaling)
    rope = (cos.double(), sin.double())
    got = attn(x, rope)
    # The same attention with K and V copied out to n_head heads: query head h reads kv head
    # h // (n_head / n_kv_head), and softmax written out with the causal mask.
    B, T = 2, 11
    q, k, v = attn.qkv(x).split([c.n_head * c.head_dim, c.n_kv_head * c.head_dim,
                                 c.n_kv_head * c.head_dim], dim=-1)
    q = tm.apply_rope(q.view(B, T, c.n_head, c.head_dim).transpose(1, 2), *rope)
    k = tm.apply_rope(k.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2), *rope)
    v = v.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)
    group = c.n_head // c.n_kv_head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(c.head_dim)
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.softmax(scores, dim=-1) @ v
    want = attn.out(y.transpose(1, 2).reshape(B, T, -1))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"seed {seed}")


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_gradient_against_central_differences(name):
    # fp64, step h: the central difference's error is h²/6·|L'''| (truncation) plus
    # ~eps64·|L|/h (rounding). With |L| ≈ 6 and third derivatives of order 10 along one weight,
    # h = 1e-5 gives about 2e-9 + 1.3e-10; 1e-7 leaves a 40x margin and stays far below the
    # gradients' own size (1e-4 .. 1e-1), so a wrong or missing gradient path fails.
    seed = seeded()
    model = tiny_model(name, seed=seed % 1000)
    c = model.c
    tokens, targets = tokens_and_targets(c, 2, 9, seed)
    loss = model(tokens, targets)
    loss.backward()
    gen = np.random.default_rng(seed)
    h = 1e-5
    used_rows = set(tokens.flatten().tolist())
    for pname, p in model.named_parameters():
        flat, grad = p.data.view(-1), p.grad.view(-1)
        picks = list(gen.integers(0, flat.numel(), 3))
        if pname in ("embed.weight",):  # rows the batch reads, or every pick would be 0
            row = sorted(used_rows)[int(gen.integers(len(used_rows)))]
            picks.append(row * c.d_model + int(gen.integers(c.d_model)))
        for i in picks:
            old = float(flat[i])
            with torch.no_grad():
                flat[i] = old + h
                up = float(model(tokens, targets))
                flat[i] = old - h
                down = float(model(tokens, targets))
                flat[i] = old
            fd = (up - down) / (2 * h)
            assert abs(float(grad[i]) - fd) <= 1e-7, f"{pname}[{i}]: {float(grad[i])} vs {fd}, seed {seed}"
    # The padding rows of the embedding/head get no gradient.
    head = model.head_weight().grad if c.tied_embeddings else model.head.weight.grad
    assert float(head[c.vocab_size:].abs().max()) == 0.0


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_safetensors_export_round_trip(name, tmp_path):
    seed = seeded()
    model = tiny_model(name, torch.float32, seed=seed % 1000)
    c = model.c
    state = {n: p.detach() for n, p in model.named_parameters()}
    exported = tm.to_export(c, state)
    path = str(tmp_path / "model.safetensors")
    tm.save_safetensors(path, exported, {"format": "pt", "flare_model": c.name})
    raw = open(path, "rb").read()
    assert int.from_bytes(raw[:8], "little") % 8 == 0  # data section 8-byte aligned
    loaded, meta = tm.load_safetensors(path)
    assert meta["flare_model"] == c.name
    assert list(loaded) == [t.name for t in tm.export_tensors(c)]  # file order = export order
    back = tm.from_export(c, loaded)
    for n, t in state.items():
        rows = c.vocab_size if n in ("embed.weight", "head.weight") else t.shape[0]
        assert torch.equal(back[n][:rows], t[:rows]), n
        assert float(back[n][rows:].abs().sum()) == 0.0  # padding rows are not exported
    # A model loads it by the export names.
    fresh = tm.FlareModel(c)
    tm.load_weights(fresh, path)
    for n, p in fresh.named_parameters():
        rows = c.vocab_size if n in ("embed.weight", "head.weight") else p.shape[0]
        assert torch.equal(p.detach()[:rows], state[n][:rows]), n
    with pytest.raises(KeyError, match="is missing"):
        tm.from_export(c, {k: v for k, v in loaded.items() if "ln_f" not in k and "model.norm" not in k})


def test_export_names_follow_nanogpt_and_hugging_face():
    llama = {t.name: (t.source, t.row_begin, t.rows) for t in tm.export_tensors(tm.model_preset("llama-tiny"))}
    # llama-tiny: 4 q heads and 2 k/v heads of 16, SwiGLU width 128, untied head.
    assert llama["model.layers.1.self_attn.q_proj.weight"] == ("layers.1.attn.qkv.weight", 0, 64)
    assert llama["model.layers.1.self_attn.k_proj.weight"] == ("layers.1.attn.qkv.weight", 64, 32)
    assert llama["model.layers.1.self_attn.v_proj.weight"] == ("layers.1.attn.qkv.weight", 96, 32)
    assert llama["model.layers.0.mlp.gate_proj.weight"] == ("layers.0.mlp.gate_up.weight", 0, 128)
    assert llama["model.layers.0.mlp.up_proj.weight"] == ("layers.0.mlp.gate_up.weight", 128, 128)
    assert llama["lm_head.weight"] == ("head.weight", 0, 300)
    assert llama["model.embed_tokens.weight"] == ("embed.weight", 0, 300)
    assert len(llama) == 2 + 2 * 9 + 1
    gpt = {t.name: (t.source, t.row_begin, t.rows) for t in tm.export_tensors(tm.model_preset("gpt-tiny"))}
    assert gpt["transformer.h.0.attn.c_attn.weight"] == ("layers.0.attn.qkv.weight", 0, 192)
    assert gpt["transformer.ln_f.bias"] == ("final_norm.bias", 0, 64)
    assert "lm_head.weight" not in gpt  # tied
    assert len(gpt) == 2 + 2 * 12 + 2


def test_config_json_vocab_pads_like_the_cli():
    # flare-train --vocab 50257 on a LLaMA preset pads to 50304 rows; the JSON config must agree.
    config = tm.config_from_json({"preset": "llama-tiny", "vocab_size": 50257})
    assert (config.vocab_size, config.padded_vocab) == (50257, 50304)
    given = tm.config_from_json({"preset": "llama-tiny", "vocab_size": 300, "padded_vocab": 512})
    assert given.padded_vocab == 512


def test_flat_buffer_round_trip(tmp_path):
    # d_model 40: 40-element norms and biases leave gaps before the next 64-aligned tensor.
    config = tm.config_from_json({"preset": "gpt-tiny", "d_model": 40, "n_head": 5, "n_kv_head": 5,
                                  "head_dim": 8, "ffn_hidden": 160})
    model = tm.FlareModel(config)
    flat = tm.flat_from_model(model)
    layout = tm.parameter_layout(model.c)
    assert flat.numel() == layout.total
    gaps = torch.ones(layout.total, dtype=torch.bool)
    for p in layout.params:
        gaps[p.offset:p.offset + p.numel] = False
    assert gaps.any() and float(flat[gaps].abs().max()) == 0.0
    path = str(tmp_path / "weights.bin")
    tm.write_flat_bin(path, flat)
    assert os.path.getsize(path) == 4 * layout.total
    fresh = tm.FlareModel(model.c)
    tm.load_weights(fresh, path)
    for (n, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), n
    with pytest.raises(ValueError, match="layout"):
        tm.load_flat(fresh, flat[:-1])


def write_shard(path, tokens):
    header = np.zeros(256, dtype="<i4")
    header[:3] = (tm.SHARD_MAGIC, 1, len(tokens))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


# First window-start tokens of each batch of flare's DataLoader (data/loader.cpp) over the shards
# of loader_shards() with seed 7, batch 2, seq 4: two epochs of four batches, then one more.
CPP_LOADER_FIRST_TOKENS = [208, 200, 100, 8, 200, 212, 104, 8, 0]


def loader_shards(tmp_path):
    # Token value = 100·shard + index, so a window names where it came from.
    sizes = [13, 9, 17]
    for s, n in enumerate(sizes):
        write_shard(str(tmp_path / f"s_{s}.bin"), [100 * s + i for i in range(n)])
    return str(tmp_path / "s_*.bin")


def test_loader_covers_each_epoch_once(tmp_path):
    pattern = loader_shards(tmp_path)
    loader = tm.ShardLoader(pattern, 2, 4, 1000, seed=7)
    # windows: (13-1)//4 + (9-1)//4 + (17-1)//4 = 3 + 2 + 4 = 9; batches of 2 -> 4 per epoch.
    assert loader.batches_per_epoch == 4
    starts = []
    for _ in range(4):
        x, y = loader.next_batch()
        assert np.array_equal(x[:, 1:], y[:, :-1])
        assert np.all(y[:, -1] == x[:, -1] + 1)  # targets are the next token of the same shard
        starts += list(x[:, 0])
    assert len(set(starts)) == 8 and all(s % 4 == 0 for s in (v % 100 for v in starts))
    again = tm.ShardLoader(pattern, 2, 4, 1000, seed=7)
    assert np.array_equal(again.next_batch()[0], tm.ShardLoader(pattern, 2, 4, 1000, seed=7).next_batch()[0])
    if CPP_LOADER_FIRST_TOKENS is not None:
        loader = tm.ShardLoader(pattern, 2, 4, 1000, seed=7)
        firsts = [int(loader.next_batch()[0][0, 0]) for _ in range(len(CPP_LOADER_FIRST_TOKENS))]
        assert firsts == CPP_LOADER_FIRST_TOKENS


def test_schedule_matches_schedule_cpp():
    # warm-up climbs from lr/warmup, reaches lr at step warmup-1, the cosine ends at min_lr.
    f = lambda s: tm.learning_rate(s, 6e-4, 6e-5, 10, 101)  # noqa: E731
    assert f(0) == pytest.approx(6e-5) and f(9) == pytest.approx(6e-4)
    assert f(10) == pytest.approx(6e-4) and f(100) == pytest.approx(6e-5) and f(500) == pytest.approx(6e-5)
    assert f(55) == pytest.approx(6e-5 + 0.5 * (6e-4 - 6e-5))
    assert tm.learning_rate(4, 1.0, 0.1, 5, 5) == 1.0  # no decay steps: the peak to the end


# Elements of flare-train's initial weights for gpt-tiny, seed 1337, as init_parameters()
# (src/train/loop/init.cpp) writes them: offsets 0..3 and 12345 in embed.weight (std 0.02), 24583
# in pos_embed.weight (std 0.01, from offset 24576).
CPP_INIT_GPT_TINY_1337 = {0: -0.0029651618096977472, 1: 0.00833622645586729,
                          2: -0.023231495171785355, 3: -0.010514670051634312,
                          12345: -0.04148602485656738, 24583: -0.00013238287647254765}


def test_flare_init_matches_init_cpp():
    c = tm.model_preset("gpt-tiny")
    flat = tm.flare_init_flat(c, 1337).numpy()
    for offset, value in CPP_INIT_GPT_TINY_1337.items():
        assert flat[offset] == np.float32(value), offset
    layout = tm.parameter_layout(c)
    for p in layout.params:
        w = flat[p.offset:p.offset + p.numel]
        if p.init_ones:
            assert np.all(w == 1.0), p.name
        elif p.init_std == 0.0:
            assert np.all(w == 0.0), p.name
        else:  # the sample's spread is the layout's std (5 sigma of the estimate's error)
            assert abs(float(w.std()) / p.init_std - 1) < 5 / math.sqrt(2 * p.numel), p.name
    assert not np.array_equal(flat, tm.flare_init_flat(c, 1338).numpy())


@pytest.mark.skipif(not os.environ.get("FLARE_TRAIN_BIN"),
                    reason="set FLARE_TRAIN_BIN to a flare-train binary to compare loss curves")
@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_loss_curve_matches_flare_train_cpu(name, tmp_path):
    # flare-train --device cpu (fp32) against train_torch.py --cpu from flare's own initial weights
    # (flare:SEED), the same shards in the same order, the same schedule and AdamW. Rule as
    # docs/architecture.md's tolerance rule: max over steps |flare - fp64| <= 2 · max over steps
    # |torch fp32 - fp64| plus fp32's rounding at the loss's size (training steps, validation passes
    # and grad norms alike).
    import subprocess
    import train_torch
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    data = str(tmp_path / "data")
    subprocess.run([sys.executable, os.path.join(root, "scripts", "prepare_data.py"), "--tiny",
                    "--out", data], check=True, capture_output=True)
    flare_log = str(tmp_path / "flare.jsonl")
    steps = "12"
    subprocess.run([os.environ["FLARE_TRAIN_BIN"], "--model", name, "--data", data, "--device", "cpu",
                    "--steps", steps, "--batch", "2", "--seq", "32", "--eval-every", "6",
                    "--sample", "0", "--ckpt-dir", str(tmp_path / "ckpt"), "--log", flare_log],
                   check=True, capture_output=True)
    logs = {}
    for precision in ("fp32", "fp64"):
        out = str(tmp_path / f"torch-{precision}.json")
        assert train_torch.main(["--cpu", "--precision", precision, "--case", f"{name}:2:32",
                                 "--data", os.path.join(data, "*_train_*.bin"),
                                 "--val-data", os.path.join(data, "*_val_*.bin"),
                                 "--train-steps", steps, "--eval-every", "6", "--log", out]) == 0
        logs[precision] = json.load(open(out))["steps"]
    flare = [json.loads(line) for line in open(flare_log)]
    assert [e["step"] for e in flare] == [e["step"] for e in logs["fp64"]]
    for key in ("loss", "val_loss", "grad_norm"):
        rows = [(f[key], a[key], b[key]) for f, a, b in zip(flare, logs["fp32"], logs["fp64"])
                if key in f]
        assert rows, key
        flare_err = max(abs(f - ref) for f, _, ref in rows)
        naive_err = max(abs(t - ref) for _, t, ref in rows)
        bound = 2 * naive_err + 2.0 ** -24 * max(abs(ref) for *_, ref in rows)
        assert flare_err <= bound, f"{name} {key}: flare {flare_err:.3e} > bound {bound:.3e}"
