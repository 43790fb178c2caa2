"""Bad values for every argument of flare's public functions, shared by the NumPy and torch
tests: each case is (function, argument, label, bad value, expected exception), and the message
must start with the argument's name (message_pattern).

Every parameter of every public function must have an entry in KINDS: a parameter added without
one fails test_every_parameter_has_a_kind, so the table cannot fall behind the API.
"""

import inspect
import math

import flare

PUBLIC_FUNCTIONS = [
    flare.attention_forward,
    flare.attention_backward,
    flare.flash_attn_func,
    flare.flash_attn_qkvpacked_func,
    flare.flash_attn_kvpacked_func,
    flare.flash_attn_varlen_func,
    flare.flash_attn_varlen_qkvpacked_func,
    flare.flash_attn_varlen_kvpacked_func,
]

# What each parameter takes. cu_seqlens are required by the varlen functions and optional in
# attention_forward / attention_backward (see kind_of).
KINDS = {
    "q": "tensor", "k": "tensor", "v": "tensor", "qkv": "tensor", "kv": "tensor",
    "dout": "tensor", "out": "tensor", "softmax_lse": "tensor",
    "cu_seqlens_q": "cu_seqlens", "cu_seqlens_k": "cu_seqlens", "cu_seqlens": "cu_seqlens",
    "alibi_slopes": "optional_tensor",
    "dropout_p": "real", "softcap": "real", "softmax_scale": "optional_real",
    "causal": "flag", "deterministic": "flag", "return_attn_probs": "flag",
    "return_rng_state": "flag",
    "window_size": "window", "backend": "backend",
    "seed": "seed", "offset": "int",
    "max_seqlen_q": "max_seqlen", "max_seqlen_k": "max_seqlen", "max_seqlen": "max_seqlen",
    "stream": "stream",
    "block_table": "block_table",
}

# Names the library (C ABI) gives arguments that the Python functions name otherwise: the packed
# tensors are checked as the q / k / v views taken of them, out and softmax_lse as o and lse.
ALIASES = {
    "qkv": ("qkv", "q"), "kv": ("kv", "k"), "out": ("out", "o"),
    "softmax_lse": ("softmax_lse", "lse"), "cu_seqlens": ("cu_seqlens", "cu_seqlens_q"),
    "window_size": ("window_size", "window_left", "window_right"),
}

def kind_of(fn, name):
    kind = KINDS[name]
    if kind == "cu_seqlens":
        return "tensor" if "varlen" in fn.__name__ else "optional_cu_seqlens"
    return kind


def bad_values(kind):
    """(label, value, exception) for one kind of parameter. The value of "wrong_dtype" is made
    per call (see cases)."""
    nan = math.nan
    table = {
        "tensor": [("None", None, TypeError), ("list", [[1.0, 2.0]], TypeError),
                   ("float", 1.0, TypeError), ("str", "q", TypeError),
                   ("wrong_dtype", None, ValueError)],
        "optional_tensor": [("list", [0.5, 0.5], TypeError), ("float", 0.5, TypeError),
                            ("wrong_dtype", None, ValueError)],
        "optional_cu_seqlens": [("list", [0, 8], TypeError), ("int", 8, TypeError)],
        "real": [("None", None, TypeError), ("str", "0.5", TypeError),
                 ("list", [0.1], TypeError), ("bool", True, TypeError),
                 ("nan", nan, ValueError)],
        "optional_real": [("str", "0.5", TypeError), ("list", [0.1], TypeError),
                          ("bool", True, TypeError), ("negative", -1.0, ValueError),
                          ("nan", nan, ValueError)],
        "flag": [("None", None, TypeError), ("str", "yes", TypeError),
                 ("list", [True], TypeError), ("int_2", 2, TypeError)],
        "window": [("None", None, ValueError), ("int", 3, ValueError),
                   ("floats", (1.5, 2), TypeError), ("triple", (1, 2, 3), ValueError),
                   ("below_-1", (-2, 0), ValueError), ("huge", (1 << 40, 0), ValueError)],
        "backend": [("None", None, TypeError), ("float", 1.5, TypeError),
                    ("list", ["auto"], TypeError), ("unknown_name", "fastest", ValueError),
                    ("unknown_code", 7, ValueError)],
        "seed": [("float", 1.5, TypeError), ("str", "3", TypeError), ("list", [3], TypeError),
                 ("bool", True, TypeError)],
        "int": [("None", None, TypeError), ("float", 1.5, TypeError), ("str", "0", TypeError)],
        "max_seqlen": [("float", 5.5, TypeError), ("str", "5", TypeError),
                       ("negative", -1, ValueError)],
        "stream": [("float", 1.5, TypeError), ("str", "0", TypeError),
                   ("negative", -1, ValueError)],
        "block_table": [],  # paged KV: any value but None raises NotImplementedError (tested apart)
    }
    return table[kind]


def cases(make_call):
    """Every (function, parameter, label, value, exception) whose call must be rejected.
    make_call(fn) -> (keyword arguments of a valid call, wrong_dtype), where wrong_dtype(name)
    is an array like that argument in a dtype flare rejects, or None where there is none."""
    out = []
    for fn in PUBLIC_FUNCTIONS:
        good, wrong_dtype = make_call(fn)
        for name in inspect.signature(fn).parameters:
            kind = kind_of(fn, name)
            for label, value, exc in bad_values(kind):
                if label == "wrong_dtype":
                    value = wrong_dtype(name)
                    if value is None:
                        continue
                out.append((fn, name, label, value, exc))
    return out


def message_pattern(name):
    names = ALIASES.get(name, (name,))
    return r"^(" + "|".join(names) + r")(\[\d\])?: "
