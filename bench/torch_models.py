"""torch_models.py — the PyTorch reference of flare's GPT and LLaMA models.

The same models as src/train (model_config.h, cpu/model.h), written with torch operators, so that
flare's trainer can be checked against them (train_compare.py: first-step loss, logits and every
gradient) and timed against them (train_torch.py: torch.compile, SDPA's cuDNN backend).

What is mirrored from the C++ side, and where it comes from (keep them in step; the test
tests/python/test_train_reference.py pins parameter counts and layout sizes that
parameter_count() and parameter_layout() of src/train/core/model_config.cpp print):
  PRESETS              all_presets() of model_config.cpp (no C++ command prints them yet;
                       config_from_json() reads the field names of ModelConfig for when one does)
  parameter_layout()   parameter_layout(): names, shapes, 64-element-aligned offsets, weight decay
                       and init of every tensor of the flat buffer
  parameter_count()    parameter_count(): embedding rows count vocab_size, tied head once
  model_flops_per_token()  model_flops_per_token(): 6·N + 6·L·H·Q·T (PaLM's count, causal
                       attention halved), the numerator of MFU
  export_tensors()     export_tensors() of core/safetensors.cpp: nanoGPT names for GPT, Hugging
                       Face LlamaForCausalLM names for LLaMA, fused rows split, padding rows cut
  rope_inv_freq()      rope_table() of cpu/ops.cpp: theta^(-2i/D), LLaMA-3 scaling, in double
  flare_init_flat()    init_parameters() of loop/init.cpp: flare-train's initial weights for a
                       seed (Philox 4x32-10 + Box-Muller per element), so a PyTorch run can start
                       from the very weights flare's run starts from without a file
  ShardLoader          DataLoader of data/loader.cpp: the same windows in the same order

The model (FlareModel) holds its parameters under flare's own names: model.state_dict() has
exactly the keys and shapes of parameter_layout(), with the fused qkv (q heads | k heads | v heads)
and gate_up (gate | up) rows, and the embedding/head at padded_vocab rows. So a flat flare buffer
loads by offset (load_flat) and a gradient compares by name. Each block is pre-norm:
    x = embed(tokens) (+ pos_embed)
    x = x + attn.out(attention(rope(attn.qkv(norm(x)))))
    x = x + mlp(norm(x))          GPT: proj(gelu_tanh(fc(.)))   LLaMA: down(silu(gate) * up)
    logits = final_norm(x) @ head.T    (head = embed when tied), (B, T, padded_vocab)
    loss = mean cross-entropy over the targets that are not -1, over the first vocab_size columns
Attention is F.scaled_dot_product_attention, causal, with enable_gqa for grouped-query attention
(K/V keep n_kv_head heads; nothing is repeated).

Precision: the module computes in the dtype of its parameters (fp32 or fp64) or under the caller's
autocast (bf16). Norm statistics, RoPE and the loss are computed in fp32 (at least) whatever the
input dtype, as flare's kernels do.

Also here: a minimal safetensors reader/writer (the format is an 8-byte length, a JSON header and
raw bytes; no package needed), flare's raw flat fp32 buffer (.bin, layout.total little-endian
floats) in and out, and a mirror of flare's shard loader (data/loader.cpp), so the PyTorch run
sees the batches flare's run sees.
"""

import dataclasses
import glob
import json
import math
import struct

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# ---- configs ------------------------------------------------------------------------------------

PARAM_ALIGNMENT = 64  # kParamAlignment: tensor offsets are multiples of this many elements


def padded_vocab_size(vocab_size):
    """vocab_size rounded up to a multiple of 128 (the embedding/head rows)."""
    return (vocab_size + 127) // 128 * 128


@dataclasses.dataclass
class RopeScaling:
    enabled: bool = False
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass
class ModelConfig:
    """flare::train::ModelConfig, field for field; family is "gpt" or "llama"."""
    family: str = "gpt"
    name: str = "custom"
    vocab_size: int = 50257
    padded_vocab: int = 50304
    n_layer: int = 12
    d_model: int = 768
    n_head: int = 12
    n_kv_head: int = 12
    head_dim: int = 64
    ffn_hidden: int = 3072
    max_seq: int = 1024
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    tied_embeddings: bool = True


def _gpt(name, n_layer, d_model, n_head, head_dim, max_seq, vocab_size=50257):
    return ModelConfig(family="gpt", name=name, vocab_size=vocab_size,
                       padded_vocab=padded_vocab_size(vocab_size), n_layer=n_layer,
                       d_model=d_model, n_head=n_head, n_kv_head=n_head, head_dim=head_dim,
                       ffn_hidden=4 * d_model, max_seq=max_seq, tied_embeddings=True)


def _llama(name, n_layer, d_model, n_head, n_kv_head, head_dim, ffn, vocab, max_seq, theta,
           llama3_scaling, tied):
    scaling = RopeScaling()
    if llama3_scaling:  # rope_type "llama3" of the Llama-3.2 checkpoints
        scaling = RopeScaling(True, 32.0, 1.0, 4.0, 8192)
    return ModelConfig(family="llama", name=name, vocab_size=vocab,
                       padded_vocab=padded_vocab_size(vocab), n_layer=n_layer, d_model=d_model,
                       n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, ffn_hidden=ffn,
                       max_seq=max_seq, rope_theta=theta, rope_scaling=scaling,
                       tied_embeddings=tied)


# all_presets() of src/train/core/model_config.cpp, in its order.
PRESETS = {c.name: c for c in [
    _gpt("gpt2", 12, 768, 12, 64, 1024),
    _gpt("gpt2-medium", 24, 1024, 16, 64, 1024),
    _gpt("gpt2-large", 36, 1280, 20, 64, 1024),
    _gpt("gpt2-xl", 48, 1600, 25, 64, 1024),
    _gpt("gpt3-125m", 12, 768, 12, 64, 2048),
    _gpt("gpt3-350m", 24, 1024, 16, 64, 2048),
    _gpt("gpt3-760m", 24, 1536, 16, 96, 2048),
    _gpt("gpt3-1.3b", 24, 2048, 16, 128, 2048),
    _gpt("gpt3-2.7b", 32, 2560, 32, 80, 2048),
    _llama("llama2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 4096, 1e4, False, False),
    _llama("llama3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192, 5e5, False, False),
    _llama("llama3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, 131072, 5e5, True, True),
    _llama("llama3.2-3b", 28, 3072, 24, 8, 128, 8192, 128256, 131072, 5e5, True, True),
    _gpt("gpt-tiny", 2, 64, 4, 16, 64, vocab_size=300),
    _llama("llama-tiny", 2, 64, 4, 2, 16, 128, 300, 64, 1e4, False, False),
]}


def model_preset(name):
    """A copy of the named preset; ValueError naming the known ones otherwise."""
    if name not in PRESETS:
        raise ValueError(f"model: unknown preset '{name}' (known: {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name],
                               rope_scaling=dataclasses.replace(PRESETS[name].rope_scaling))


def config_from_json(obj):
    """A ModelConfig from a dict with ModelConfig's field names (what a C++ --print-config would
    print): a "preset" or "name" naming a preset is the base, other fields override it. A
    vocab_size without a padded_vocab gets padded_vocab_size(vocab_size), as flare-train's --vocab
    does, so a preset with another vocabulary is one field."""
    base = obj.get("preset", obj.get("name"))
    config = model_preset(base) if base in PRESETS else ModelConfig()
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    for key, value in obj.items():
        if key == "rope_scaling":
            config.rope_scaling = RopeScaling(**value)
        elif key in fields:
            setattr(config, key, value)
        elif key != "preset":
            raise ValueError(f"config: unknown field '{key}' (ModelConfig has {sorted(fields)})")
    if "vocab_size" in obj and "padded_vocab" not in obj:
        config.padded_vocab = padded_vocab_size(config.vocab_size)
    validate_config(config)
    return config


def validate_config(c):
    """The shape rules the reference relies on (validate_model_config has the full list)."""
    if c.family not in ("gpt", "llama"):
        raise ValueError(f"family: '{c.family}' must be 'gpt' or 'llama'")
    if c.padded_vocab < c.vocab_size or c.padded_vocab % 128:
        raise ValueError(f"padded_vocab: {c.padded_vocab} must be a multiple of 128 and >= "
                         f"vocab_size = {c.vocab_size}")
    if c.n_head % c.n_kv_head:
        raise ValueError(f"n_kv_head: {c.n_kv_head} must divide n_head = {c.n_head}")
    if c.head_dim % 2:
        raise ValueError(f"head_dim: {c.head_dim} must be even (RoPE pairs)")
    if c.family == "gpt" and (c.n_kv_head != c.n_head or c.n_head * c.head_dim != c.d_model):
        raise ValueError("gpt family: n_kv_head must equal n_head and n_head*head_dim d_model")


# ---- the flat parameter layout (model_config.cpp parameter_layout) -------------------------------

@dataclasses.dataclass
class ParamSpec:
    name: str
    shape: tuple
    offset: int
    numel: int
    weight_decay: bool
    init_std: float
    init_ones: bool


@dataclasses.dataclass
class ParameterLayout:
    params: list
    total: int

    def find(self, name):
        return next((p for p in self.params if p.name == name), None)


def _round_up(x, m):
    return (x + m - 1) // m * m


def parameter_layout(c):
    gpt = c.family == "gpt"
    std = 0.02
    residual_std = 0.02 / math.sqrt(2.0 * c.n_layer)  # GPT-2's scaled init of residual writes
    d = c.d_model
    q_width = c.n_head * c.head_dim
    qkv_rows = (c.n_head + 2 * c.n_kv_head) * c.head_dim
    params = []
    total = 0

    def add(name, shape, init_std, decay, ones):
        nonlocal total
        numel = math.prod(shape)
        offset = _round_up(total, PARAM_ALIGNMENT)
        params.append(ParamSpec(name, tuple(shape), offset, numel, decay, init_std, ones))
        total = offset + numel

    def add_norm(prefix):
        add(prefix + ".weight", (d,), 0.0, False, True)
        if gpt:
            add(prefix + ".bias", (d,), 0.0, False, False)

    def add_linear(prefix, out, inp, init_std):
        add(prefix + ".weight", (out, inp), init_std, True, False)
        if gpt:
            add(prefix + ".bias", (out,), 0.0, False, False)

    add("embed.weight", (c.padded_vocab, d), std, False, False)
    if gpt:
        add("pos_embed.weight", (c.max_seq, d), 0.01, False, False)
    for i in range(c.n_layer):
        layer = f"layers.{i}"
        add_norm(layer + ".attn_norm")
        add_linear(layer + ".attn.qkv", qkv_rows, d, std)
        add_linear(layer + ".attn.out", d, q_width, residual_std)
        add_norm(layer + ".mlp_norm")
        if gpt:
            add_linear(layer + ".mlp.fc", c.ffn_hidden, d, std)
            add_linear(layer + ".mlp.proj", d, c.ffn_hidden, residual_std)
        else:
            add_linear(layer + ".mlp.gate_up", 2 * c.ffn_hidden, d, std)
            add_linear(layer + ".mlp.down", d, c.ffn_hidden, residual_std)
    add_norm("final_norm")
    if not c.tied_embeddings:
        add("head.weight", (c.padded_vocab, d), std, True, False)
    return ParameterLayout(params, _round_up(total, PARAM_ALIGNMENT))


def parameter_count(c):
    """Trainable parameters as published: padding rows out, a tied head once, no gaps."""
    vocab_tensors = 1 if c.tied_embeddings else 2
    n = sum(p.numel for p in parameter_layout(c).params)
    return n - vocab_tensors * (c.padded_vocab - c.vocab_size) * c.d_model


def model_flops_per_token(c, seq):
    """model_flops_per_token() of model_config.cpp: 6·N + 6·L·H·Q·T, N the matmul weights per
    token (every block's linear layers and the head at vocab_size rows), the attention term
    PaLM's 12·L·H·Q·T halved for the causal mask."""
    d = float(c.d_model)
    q_width = float(c.n_head * c.head_dim)
    qkv_rows = float((c.n_head + 2 * c.n_kv_head) * c.head_dim)
    mlp_matrices = 2.0 if c.family == "gpt" else 3.0
    per_layer = qkv_rows * d + d * q_width + mlp_matrices * d * c.ffn_hidden
    matmul_params = c.n_layer * per_layer + float(c.vocab_size) * d
    causal_attention = 6.0 * c.n_layer * q_width * float(seq)
    return 6.0 * matmul_params + causal_attention


# ---- RoPE (cpu/ops.cpp rope_table) --------------------------------------------------------------

def rope_inv_freq(head_dim, theta, scaling):
    """inv_freq[i] = theta^(-2i/D), i < D/2, with LLaMA-3's scaling, as a float64 numpy array."""
    freqs = []
    for i in range(head_dim // 2):
        f = theta ** (-2.0 * i / head_dim)
        if scaling.enabled:
            original = float(scaling.original_max_position)
            low_freq_wavelen = original / scaling.low_freq_factor
            high_freq_wavelen = original / scaling.high_freq_factor
            wavelen = 2.0 * math.pi / f
            if wavelen > low_freq_wavelen:
                f = f / scaling.factor
            elif wavelen >= high_freq_wavelen:
                smooth = ((original / wavelen - scaling.low_freq_factor) /
                          (scaling.high_freq_factor - scaling.low_freq_factor))
                f = (1.0 - smooth) * f / scaling.factor + smooth * f
        freqs.append(f)
    return np.array(freqs, dtype=np.float64)


def rope_table(seq, head_dim, theta, scaling):
    """cos and sin (seq, head_dim/2), angles p·inv_freq in double, each rounded once to fp32."""
    angles = np.arange(seq, dtype=np.float64)[:, None] * rope_inv_freq(head_dim, theta, scaling)
    return (torch.from_numpy(np.cos(angles).astype(np.float32)),
            torch.from_numpy(np.sin(angles).astype(np.float32)))


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on x (B, H, T, D): pairs (i, i + D/2) turn by angle (t, i). Computed in at
    least fp32 and returned in x's dtype; cos/sin (T, D/2)."""
    half = x.shape[-1] // 2
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    c = cos.to(compute)
    s = sin.to(compute)
    x1, x2 = xc[..., :half], xc[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


# ---- the model ----------------------------------------------------------------------------------

def _compute_dtype(x):
    """The dtype a norm computes in: fp32 for bf16/fp16/fp32 inputs, fp64 for fp64."""
    return torch.promote_types(x.dtype, torch.float32)


class LayerNorm(nn.Module):
    """y = (x - mean) · rstd · weight + bias, biased variance (GPT)."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = eps

    def forward(self, x):
        dt = _compute_dtype(x)
        y = F.layer_norm(x.to(dt), x.shape[-1:], self.weight.to(dt), self.bias.to(dt), self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    """y = x · rstd · weight, rstd = 1/sqrt(mean(x²) + eps) (LLaMA)."""

    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dt = _compute_dtype(x)
        xc = x.to(dt)
        rstd = torch.rsqrt(xc.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (xc * rstd * self.weight.to(dt)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        bias = c.family == "gpt"
        self.c = c
        self.qkv = nn.Linear(c.d_model, (c.n_head + 2 * c.n_kv_head) * c.head_dim, bias=bias)
        self.out = nn.Linear(c.n_head * c.head_dim, c.d_model, bias=bias)

    def forward(self, x, rope):
        c = self.c
        B, T, _ = x.shape
        qkv = self.qkv(x)
        q_width, kv_width = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        q, k, v = qkv.split([q_width, kv_width, kv_width], dim=-1)
        q = q.view(B, T, c.n_head, c.head_dim).transpose(1, 2)     # (B, H, T, D)
        k = k.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)
        if rope is not None:
            cos, sin = rope
            q = apply_rope(q, cos[:T], sin[:T])
            k = apply_rope(k, cos[:T], sin[:T])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=c.n_kv_head != c.n_head)
        return self.out(y.transpose(1, 2).reshape(B, T, q_width))


class GptMlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.fc = nn.Linear(c.d_model, c.ffn_hidden)
        self.proj = nn.Linear(c.ffn_hidden, c.d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class LlamaMlp(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_up = nn.Linear(c.d_model, 2 * c.ffn_hidden, bias=False)
        self.down = nn.Linear(c.ffn_hidden, c.d_model, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # gate rows first, then up rows
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        norm = LayerNorm if c.family == "gpt" else RMSNorm
        self.attn_norm = norm(c.d_model, c.norm_eps)
        self.attn = Attention(c)
        self.mlp_norm = norm(c.d_model, c.norm_eps)
        self.mlp = GptMlp(c) if c.family == "gpt" else LlamaMlp(c)

    def forward(self, x, rope):
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class FlareModel(nn.Module):
    """flare's GPT or LLaMA model; state_dict() keys and shapes are parameter_layout()'s.

    rope_len: rows of the RoPE table (LLaMA), at least the longest sequence run; defaults to
    max_seq capped at 16384 (llama3.2's max_seq 131072 would be a 33 MB table for nothing).
    init: draw the weights as the layout says (off for a model built on the meta device or about
    to be loaded).
    """

    def __init__(self, c, rope_len=None, init=True):
        super().__init__()
        validate_config(c)
        self.c = c
        norm = LayerNorm if c.family == "gpt" else RMSNorm
        self.embed = nn.Embedding(c.padded_vocab, c.d_model)
        if c.family == "gpt":
            self.pos_embed = nn.Embedding(c.max_seq, c.d_model)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.final_norm = norm(c.d_model, c.norm_eps)
        if not c.tied_embeddings:
            self.head = nn.Linear(c.d_model, c.padded_vocab, bias=False)
        if c.family == "llama":
            n = rope_len or min(c.max_seq, 16384)
            cos, sin = rope_table(n, c.head_dim, c.rope_theta, c.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if init:
            init_like_flare(self, torch.Generator().manual_seed(0))

    def head_weight(self):
        return self.embed.weight if self.c.tied_embeddings else self.head.weight

    def forward(self, tokens, targets=None):
        """tokens (B, T) int; returns logits (B, T, padded_vocab) without targets, else the mean
        cross-entropy over targets != -1 (fp32, or fp64 for an fp64 model)."""
        B, T = tokens.shape
        x = self.embed(tokens)
        rope = None
        if self.c.family == "gpt":
            x = x + self.pos_embed.weight[:T]
        else:
            if T > self.rope_cos.shape[0]:
                raise ValueError(f"tokens: seq {T} exceeds the RoPE table's {self.rope_cos.shape[0]}"
                                 " rows (pass rope_len)")
            rope = (self.rope_cos, self.rope_sin)
        for block in self.layers:
            x = block(x, rope)
        logits = F.linear(self.final_norm(x), self.head_weight())
        if targets is None:
            return logits
        return classifier_loss(logits, targets, self.c.vocab_size)


def classifier_loss(logits, targets, vocab_size):
    """Mean cross-entropy over targets != -1; the padding columns (>= vocab_size) are not classes.
    Computed in at least fp32."""
    dt = torch.promote_types(logits.dtype, torch.float32)
    flat = logits[..., :vocab_size].reshape(-1, vocab_size).to(dt)
    return F.cross_entropy(flat, targets.reshape(-1).long(), ignore_index=-1)


@torch.no_grad()
def init_like_flare(model, generator):
    """Each tensor as parameter_layout() says: normal(0, init_std), ones, or zeros. (Same
    distribution as flare's init, not the same numbers: load flare's own weights for that.)"""
    layout = parameter_layout(model.c)
    state = dict(model.named_parameters())
    for spec in layout.params:
        p = state[spec.name]
        if spec.init_ones:
            p.fill_(1.0)
        elif spec.init_std == 0.0:
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * spec.init_std)


_MASK32 = 0xFFFFFFFF


def _philox4x32_10(x, y, z, w, k0, k1):
    """Philox 4x32-10 (src/core/philox.h) over numpy uint64 arrays holding 32-bit words."""
    m0, m1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    w0, w1 = 0x9E3779B9, 0xBB67AE85
    mask, shift = np.uint64(_MASK32), np.uint64(32)
    for _ in range(10):
        p0 = m0 * x  # both factors < 2^32: the uint64 product is exact
        p1 = m1 * z
        x, y, z, w = ((p1 >> shift) ^ y ^ np.uint64(k0), p1 & mask,
                      (p0 >> shift) ^ w ^ np.uint64(k1), p0 & mask)
        k0, k1 = (k0 + w0) & _MASK32, (k1 + w1) & _MASK32
    return x, y, z, w


def flare_standard_normal(seed, index):
    """init.cpp's standard_normal(seed, index) for a numpy int64 array of flat-buffer offsets:
    elements 2k and 2k+1 share one Philox call (counter (k lo, k hi, 0x1417, 0), key = the
    seed's halves) and take the cosine and sine halves of one Box-Muller pair of 53-bit uniforms."""
    index = np.asarray(index, dtype=np.uint64)
    pair = index >> np.uint64(1)
    x, y, z, w = _philox4x32_10(pair & np.uint64(_MASK32), pair >> np.uint64(32),
                                np.full_like(pair, 0x1417), np.zeros_like(pair),
                                seed & _MASK32, (seed >> 32) & _MASK32)
    two53 = 9007199254740992.0
    u1 = (((x << np.uint64(21)) ^ y).astype(np.float64) + 1.0) / two53
    u2 = ((z << np.uint64(21)) ^ w).astype(np.float64) / two53
    radius = np.sqrt(-2.0 * np.log(np.minimum(u1, 1.0)))
    angle = 2.0 * math.pi * u2
    return np.where(index & np.uint64(1), radius * np.sin(angle), radius * np.cos(angle))


def flare_init_flat(c, seed, chunk=1 << 22):
    """flare-train's initial weights for `seed` (loop/init.cpp init_parameters): the flat fp32
    buffer, each element a pure function of (seed, offset). libm and numpy may round log/sin/cos
    differently in the last bit of a double, which can move an fp32 weight by one ulp, rarely."""
    layout = parameter_layout(c)
    flat = np.zeros(layout.total, dtype=np.float32)
    for p in layout.params:
        if p.init_std > 0:
            for begin in range(0, p.numel, chunk):
                idx = np.arange(p.offset + begin, p.offset + min(p.numel, begin + chunk),
                                dtype=np.int64)
                flat[idx] = (p.init_std * flare_standard_normal(seed, idx)).astype(np.float32)
        else:
            flat[p.offset:p.offset + p.numel] = 1.0 if p.init_ones else 0.0
    return torch.from_numpy(flat)


def check_state_matches_layout(model):
    """ValueError unless the parameters are exactly the layout's names and shapes."""
    layout = parameter_layout(model.c)
    have = {n: tuple(p.shape) for n, p in model.named_parameters()}
    want = {p.name: p.shape for p in layout.params}
    if have != want:
        missing = sorted(set(want) - set(have))
        extra = sorted(set(have) - set(want))
        shapes = sorted(n for n in set(want) & set(have) if want[n] != have[n])
        raise ValueError(f"model parameters differ from the layout: missing {missing[:5]}, "
                         f"extra {extra[:5]}, shape {shapes[:5]}")


# ---- flare's flat buffer --------------------------------------------------------------------------

def flat_from_model(model):
    """The parameters as flare's flat fp32 buffer (layout.total floats, gaps zero)."""
    layout = parameter_layout(model.c)
    flat = torch.zeros(layout.total, dtype=torch.float32)
    state = dict(model.named_parameters())
    for spec in layout.params:
        flat[spec.offset:spec.offset + spec.numel] = state[spec.name].detach().reshape(-1).float().cpu()
    return flat


@torch.no_grad()
def load_flat(model, flat):
    """Copies flare's flat buffer (a tensor or numpy array of layout.total floats) into model."""
    layout = parameter_layout(model.c)
    flat = torch.as_tensor(flat)
    if flat.numel() != layout.total:
        raise ValueError(f"flat buffer: {flat.numel()} elements, but model '{model.c.name}' has a "
                         f"layout of {layout.total}")
    state = dict(model.named_parameters())
    for spec in layout.params:
        p = state[spec.name]
        p.copy_(flat[spec.offset:spec.offset + spec.numel].reshape(spec.shape).to(p.dtype))


def write_flat_bin(path, flat):
    """flare's raw flat buffer: layout.total little-endian fp32, no header."""
    np.asarray(flat.numpy() if torch.is_tensor(flat) else flat, dtype="<f4").tofile(path)


def read_flat_bin(path, layout):
    flat = np.fromfile(path, dtype="<f4")
    if flat.size != layout.total:
        raise ValueError(f"{path}: {flat.size} floats, the layout needs {layout.total}")
    return torch.from_numpy(flat)


# ---- export names (core/safetensors.cpp) -----------------------------------------------------------

@dataclasses.dataclass
class ExportTensor:
    """One exported tensor: rows [row_begin, row_begin + rows) of flare tensor `source`."""
    name: str
    source: str
    row_begin: int
    rows: int


def export_tensors(c):
    """The exported tensors of config c, in file order (export_tensors() of safetensors.cpp)."""
    layout = parameter_layout(c)
    out = []

    def whole(src, dst):
        out.append(ExportTensor(dst, src, 0, layout.find(src).shape[0]))

    def with_bias(src, dst):
        whole(src + ".weight", dst + ".weight")
        if c.family == "gpt":
            whole(src + ".bias", dst + ".bias")

    if c.family == "llama":
        q_rows, kv_rows = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
        out.append(ExportTensor("model.embed_tokens.weight", "embed.weight", 0, c.vocab_size))
        for i in range(c.n_layer):
            src, dst = f"layers.{i}.", f"model.layers.{i}."
            whole(src + "attn_norm.weight", dst + "input_layernorm.weight")
            qkv = src + "attn.qkv.weight"
            out.append(ExportTensor(dst + "self_attn.q_proj.weight", qkv, 0, q_rows))
            out.append(ExportTensor(dst + "self_attn.k_proj.weight", qkv, q_rows, kv_rows))
            out.append(ExportTensor(dst + "self_attn.v_proj.weight", qkv, q_rows + kv_rows, kv_rows))
            whole(src + "attn.out.weight", dst + "self_attn.o_proj.weight")
            whole(src + "mlp_norm.weight", dst + "post_attention_layernorm.weight")
            gate_up = src + "mlp.gate_up.weight"
            out.append(ExportTensor(dst + "mlp.gate_proj.weight", gate_up, 0, c.ffn_hidden))
            out.append(ExportTensor(dst + "mlp.up_proj.weight", gate_up, c.ffn_hidden, c.ffn_hidden))
            whole(src + "mlp.down.weight", dst + "mlp.down_proj.weight")
        whole("final_norm.weight", "model.norm.weight")
    else:
        out.append(ExportTensor("transformer.wte.weight", "embed.weight", 0, c.vocab_size))
        whole("pos_embed.weight", "transformer.wpe.weight")
        for i in range(c.n_layer):
            src, dst = f"layers.{i}.", f"transformer.h.{i}."
            with_bias(src + "attn_norm", dst + "ln_1")
            with_bias(src + "attn.qkv", dst + "attn.c_attn")
            with_bias(src + "attn.out", dst + "attn.c_proj")
            with_bias(src + "mlp_norm", dst + "ln_2")
            with_bias(src + "mlp.fc", dst + "mlp.c_fc")
            with_bias(src + "mlp.proj", dst + "mlp.c_proj")
        with_bias("final_norm", "transformer.ln_f")
    if not c.tied_embeddings:
        out.append(ExportTensor("lm_head.weight", "head.weight", 0, c.vocab_size))
    return out


def to_export(c, state):
    """flare-named tensors (a state dict or named gradients) -> {export name: tensor}."""
    return {t.name: state[t.source][t.row_begin:t.row_begin + t.rows]
            for t in export_tensors(c)}


def from_export(c, tensors, dtype=torch.float32):
    """{export name: tensor} -> flare-named tensors at the layout's shapes. Rows an export does not
    carry (the embedding/head padding rows) are zero. KeyError/ValueError name what is wrong."""
    layout = parameter_layout(c)
    state = {p.name: torch.zeros(p.shape, dtype=dtype) for p in layout.params}
    expected = export_tensors(c)
    names = {t.name for t in expected}
    unknown = sorted(set(tensors) - names)
    if unknown:
        raise ValueError(f"export: tensors {unknown[:5]} are not names of model '{c.name}'")
    for t in expected:
        if t.name not in tensors:
            raise KeyError(f"export: tensor '{t.name}' of model '{c.name}' is missing")
        dst = state[t.source][t.row_begin:t.row_begin + t.rows]
        src = tensors[t.name]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"export: '{t.name}' has shape {tuple(src.shape)}, model "
                             f"'{c.name}' needs {tuple(dst.shape)}")
        dst.copy_(src.to(dtype))
    return state


# ---- safetensors (format in src/train/core/safetensors.h) -------------------------------------------

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
              "F16": torch.float16, "I64": torch.int64, "I32": torch.int32}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def save_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} as .safetensors (little-endian, header padded to 8 bytes)."""
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    at = 0
    blobs = []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        if t.dtype not in _ST_NAMES:
            raise ValueError(f"save_safetensors: '{name}' has dtype {t.dtype}, not one of "
                             f"{list(_ST_NAMES)}")
        blob = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(blob)]}
        at += len(blob)
        blobs.append(blob)
    text = json.dumps(header, separators=(",", ":"))
    text += " " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text.encode())
        for blob in blobs:
            f.write(blob)


def load_safetensors(path):
    """({name: tensor}, metadata) of a .safetensors file, after checking that the tensors tile
    the data section exactly."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: {len(raw)} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", raw[:8])
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} runs past the file's {len(raw)} bytes")
    header = json.loads(raw[8:8 + n].decode())
    data = memoryview(raw)[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    spans = []
    for name, info in header.items():
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(f"{path}: '{name}' has dtype {info['dtype']}, not one of {list(_ST_DTYPES)}")
        dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = math.prod(info["shape"])
        if end - begin != count * torch.empty((), dtype=dtype).element_size():
            raise ValueError(f"{path}: '{name}' spans {end - begin} bytes for shape {info['shape']}")
        buf = bytearray(data[begin:end])
        t = torch.frombuffer(buf, dtype=dtype) if count else torch.empty(0, dtype=dtype)
        tensors[name] = t.reshape(info["shape"])
        spans.append((begin, end))
    spans.sort()
    covered = 0
    for begin, end in spans:
        if begin != covered:
            raise ValueError(f"{path}: tensors do not tile the data section (gap or overlap at "
                             f"byte {covered})")
        covered = end
    if covered != len(data):
        raise ValueError(f"{path}: data section is {len(data)} bytes, tensors cover {covered}")
    return tensors, metadata


def load_weights(model, path):
    """Loads flare's initial or trained weights into model: a .safetensors export
    (export_safetensors), the raw flat fp32 buffer (.bin), or "flare:SEED", flare-train's own
    initialisation for that seed, computed here."""
    if path.startswith("flare:"):
        load_flat(model, flare_init_flat(model.c, int(path[len("flare:"):])))
    elif path.endswith(".safetensors"):
        tensors, _ = load_safetensors(path)
        state = from_export(model.c, tensors)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(state[name].to(p.dtype))
    else:
        load_flat(model, read_flat_bin(path, parameter_layout(model.c)))


# ---- token shards and flare's loader (data/shard.h, data/loader.cpp) -----------------------------

SHARD_MAGIC = 20240520
_MASK64 = (1 << 64) - 1


def read_shard(path, vocab_size):
    """A shard's tokens as a numpy array, header and every id checked."""
    header = np.fromfile(path, dtype="<i4", count=256)
    if header.size != 256 or header[0] != SHARD_MAGIC or header[1] not in (1, 2):
        raise ValueError(f"{path}: not a token shard (magic {SHARD_MAGIC}, version 1 or 2)")
    dtype = "<u2" if header[1] == 1 else "<u4"
    tokens = np.fromfile(path, dtype=dtype, offset=1024)
    if tokens.size != header[2]:
        raise ValueError(f"{path}: header says {header[2]} tokens, the file holds {tokens.size}")
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise ValueError(f"{path}: token id {int(tokens.max())} >= vocab_size {vocab_size}")
    return tokens


class SplitMix64:
    def __init__(self, state):
        self.state = state & _MASK64

    def next(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, bound):
        limit = _MASK64 - _MASK64 % bound
        x = self.next()
        while x >= limit:
            x = self.next()
        return x % bound


def _stream_for(seed, epoch, purpose):
    state = SplitMix64(seed).next()
    state ^= SplitMix64((epoch & _MASK64) ^ 0x5851F42D4C957F2D).next()
    state ^= SplitMix64(((purpose * 0x2545F4914F6CDD1D) + 1) & _MASK64).next()
    return SplitMix64(state)


def _shuffle(stream, values):
    for i in range(len(values), 1, -1):
        j = stream.below(i)
        values[i - 1], values[j] = values[j], values[i - 1]


class ShardLoader:
    """flare's DataLoader (data/loader.h) in Python: the same windows in the same order for the
    same (shards, batch, seq, seed, shuffle, rank, world_size)."""

    def __init__(self, pattern_or_paths, batch, seq, vocab_size, seed=1337, shuffle=True,
                 rank=0, world_size=1):
        paths = (sorted(glob.glob(pattern_or_paths)) if isinstance(pattern_or_paths, str)
                 else list(pattern_or_paths))
        if not paths:
            raise ValueError(f"shard pattern '{pattern_or_paths}': no file matches it")
        self.paths, self.B, self.T, self.vocab = paths, batch, seq, vocab_size
        self.seed, self.shuffle, self.rank, self.world = seed, shuffle, rank, world_size
        self.windows = []
        for p in paths:
            count = int(np.fromfile(p, dtype="<i4", count=3)[2])
            self.windows.append((count - 1) // seq if count > seq else 0)
        self.batches_per_epoch = sum(self.windows) // (batch * world_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"shards hold {sum(self.windows)} windows, fewer than one batch")
        self.loaded = (-1, -1)
        self._start_epoch(0)

    def _start_epoch(self, epoch):
        self.epoch, self.batch = epoch, 0
        self.shard_order = list(range(len(self.paths)))
        if self.shuffle:
            _shuffle(_stream_for(self.seed, epoch, 0), self.shard_order)
        self.order_start = [0]
        for s in self.shard_order:
            self.order_start.append(self.order_start[-1] + self.windows[s])

    def reset(self):
        """Back to the first batch of epoch 0 (a validation pass starts here each time)."""
        self._start_epoch(0)

    def _load(self, shard):
        if self.loaded[0] != shard:
            self.tokens = read_shard(self.paths[shard], self.vocab)
            self.loaded = (shard, -1)
        if self.loaded[1] != self.epoch:
            self.window_order = list(range(self.windows[shard]))
            if self.shuffle:
                _shuffle(_stream_for(self.seed, self.epoch, shard + 1), self.window_order)
            self.loaded = (shard, self.epoch)

    def next_batch(self):
        """(inputs, targets), each (B, T) int64 numpy."""
        import bisect
        B, T = self.B, self.T
        inputs = np.empty((B, T), dtype=np.int64)
        targets = np.empty((B, T), dtype=np.int64)
        for b in range(B):
            position = (self.batch * B + b) * self.world + self.rank
            slot = bisect.bisect_right(self.order_start, position) - 1
            shard = self.shard_order[slot]
            self._load(shard)
            first = self.window_order[position - self.order_start[slot]] * T
            window = self.tokens[first:first + T + 1].astype(np.int64)
            inputs[b], targets[b] = window[:-1], window[1:]
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self._start_epoch(self.epoch + 1)
        return inputs, targets


# ---- schedule and optimizer groups (core/schedule.h, core/adamw.h) ----------------------------------

def learning_rate(step, lr, min_lr, warmup, steps):
    """schedule.cpp: lr·(step+1)/warmup during warm-up, then half a cosine from lr at step warmup
    to min_lr at step steps-1 (later steps stay there); no decay steps: the peak until the end."""
    if step < warmup:
        return lr * (step + 1) / warmup
    decay_steps = steps - 1 - warmup
    if decay_steps <= 0:
        return lr if step < steps else min_lr
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def optimizer_groups(model, weight_decay):
    """AdamW parameter groups with the layout's weight-decay mask (matrices decay; embeddings,
    norms and biases do not)."""
    decay = {p.name for p in parameter_layout(model.c).params if p.weight_decay}
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
