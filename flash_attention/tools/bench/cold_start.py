"""``bench --mode cold-start``: what a new process pays for its first calls, as a new user meets it.

Each measurement runs in a fresh Python process whose kernel cache (and host library, which lives in it) is
a new empty folder, and whose ``XDG_CACHE_HOME`` is one too (a peer's own disk cache starts empty as well).
A row is one first call, timed from just before it to the GPU's end of it (the interpreter's start and the
imports are recorded beside it, ``import_seconds``), beside the same call's time once warm:

* ours (``flash_attention``): the first forward, the first forward+backward (of the issue's shape, bf16
  (2, 1024, 16, 128), causal), the first decode call (``attention_with_kvcache``, one token against a 4k
  cache), and the first ``generate()`` of a random Llama-style transformers model (batch 4, a 4k prompt, 64
  new tokens): its first token, and its passes' time per new token, the first and a second pass, without
  and with ``precompile_model`` first (the issue's bar: the first pass within 1.5x of the second when
  precompiled). Each with a C++ compiler and without one (``CXX`` pointing nowhere: the host library is
  then unavailable and the calls take the Python path);
* ``sdpa_cudnn`` and, where it is installed, ``fa4``: their first forward and forward+backward.

Rows: ``impl``, ``what``, ``compiler`` (whether a C++ compiler was there), ``seconds``, ``warm_seconds``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

__all__ = ["CHILD", "run_cold_start", "cold_start_text"]

# One measurement in a fresh process: argv[1] is (impl, what); prints one JSON row.
CHILD = r"""
import json, os, sys, time
t_start = time.perf_counter()
impl, what = json.loads(sys.argv[1])
import torch
import flash_attention as fa
torch.cuda.init()
torch.empty(1, device="cuda")  # the context, outside every row
t_imported = time.perf_counter()

def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0

gen = torch.Generator(device="cuda").manual_seed(0)
def rand(*shape):
    return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)

row = {"impl": impl, "what": what, "import_seconds": round(t_imported - t_start, 3)}
if what in ("forward", "forward+backward"):
    q, k, v, do = (rand(2, 1024, 16, 128) for _ in range(4))
    train = what == "forward+backward"
    leaves = [x.requires_grad_(train) for x in (q, k, v)]
    if impl == "flash_attention":
        call = lambda: fa.attention(*leaves, causal=True)
    elif impl == "sdpa_cudnn":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        def call():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                t = [x.transpose(1, 2) for x in leaves]
                return torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True).transpose(1, 2)
    else:
        from flash_attn.cute import flash_attn_func
        call = lambda: flash_attn_func(*leaves, causal=True)[0]
    def step():
        out = call()
        if train:
            torch.autograd.grad(out, leaves, do)
    row["seconds"] = timed(step)
    row["warm_seconds"] = min(timed(step) for _ in range(3))
elif what == "decode":
    q, kc, vc = rand(1, 1, 32, 128), rand(1, 4096, 8, 128), rand(1, 4096, 8, 128)
    step = lambda: fa.attention_with_kvcache(q, kc, vc, cache_seqlens=4000)
    row["seconds"] = timed(step)
    row["warm_seconds"] = min(timed(step) for _ in range(3))
else:  # generate, generate (precompiled)
    from transformers import LlamaConfig, LlamaForCausalLM
    from flash_attention.integrations.transformers import precompile_model, register
    register()
    config = LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    model.set_attn_implementation("fa_scratch")
    if what == "generate (precompiled)":
        row["precompile_seconds"] = timed(lambda: precompile_model(model, seqlens=[4096]))
    # Tokens from 1 and an explicit mask: a prompt holding the pad token would make generate() infer padding
    # and take another attention route.
    prompt = torch.randint(1, 32000, (4, 4096), device="cuda", generator=gen)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(prompt))
    with torch.no_grad():
        row["seconds"] = timed(lambda: model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw))
        passes = []
        for _ in range(2):
            full = timed(lambda: model.generate(prompt, max_new_tokens=64, min_new_tokens=64, **kw))
            first = timed(lambda: model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw))
            passes.append((full - first) / 63)
    # (the first token was already paid above: "first pass" is the first 64-token pass after it)
    row["per_token_pass1"], row["per_token_pass2"] = passes
    row["warm_seconds"] = first
row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
print(json.dumps(row))
"""

OURS_WHAT = ("forward", "forward+backward", "decode", "generate", "generate (precompiled)")
PEER_WHAT = ("forward", "forward+backward")


def _fa4_installed() -> bool:
    try:
        import flash_attn.cute  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure to import means not installed here
        return False
    return True


def _child(impl: str, what: str, compiler: bool, timeout: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="fa_cold_") as tmp:
        env = dict(os.environ, XDG_CACHE_HOME=tmp, FLASH_ATTENTION_CACHE_DIR=os.path.join(tmp, "fa"))
        env.pop("FLASH_ATTENTION_HOST_LIBRARY", None)
        if not compiler:
            env["CXX"] = os.path.join(tmp, "no-c++-compiler-here")
        run = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps([impl, what])],
            capture_output=True, text=True, env=env, timeout=timeout,
        )  # fmt: skip
    if run.returncode != 0:
        return {"impl": impl, "what": what, "compiler": compiler, "error": run.stderr.strip()[-2000:]}
    row = json.loads(run.stdout.strip().splitlines()[-1])
    row["compiler"] = compiler
    row["stderr_lines"] = [line for line in run.stderr.splitlines() if line.startswith("flash_attention")]
    return row


def run_cold_start(whats=OURS_WHAT, timeout: float = 600.0) -> list[dict]:
    """Every row of the module docstring, each from its own fresh process (printed as it lands)."""
    rows = []
    jobs = [("flash_attention", w, c) for c in (True, False) for w in whats]
    peers = ["sdpa_cudnn"] + (["fa4"] if _fa4_installed() else [])
    jobs += [(impl, w, True) for impl in peers for w in PEER_WHAT]
    for impl, what, compiler in jobs:
        row = _child(impl, what, compiler, timeout)
        rows.append(row)
        print(cold_start_text([row], header=False), flush=True)
    return rows


def cold_start_text(rows: list[dict], header: bool = True) -> str:
    """A table: impl, what, compiler, first call and warm call seconds (and per-token generate times)."""
    lines = []
    if header:
        lines.append(f"{'impl':<16} {'what':<24} {'c++':<4} {'first s':>9} {'warm s':>9}  notes")
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<16} {r['what']:<24} {'yes' if r['compiler'] else 'no':<4} failed: "
                         f"{r['error'].splitlines()[-1] if r['error'] else '?'}")  # fmt: skip
            continue
        notes = []
        if "per_token_pass1" in r:
            notes.append(f"per token: pass 1 {1e3 * r['per_token_pass1']:.2f} ms, pass 2 "
                         f"{1e3 * r['per_token_pass2']:.2f} ms")  # fmt: skip
        if "precompile_seconds" in r:
            notes.append(f"precompile_model {r['precompile_seconds']:.1f} s")
        lines.append(
            f"{r['impl']:<16} {r['what']:<24} {'yes' if r['compiler'] else 'no':<4} {r['seconds']:>9.3f} "
            f"{r['warm_seconds']:>9.4f}  {'; '.join(notes)}"
        )
    return "\n".join(lines)
