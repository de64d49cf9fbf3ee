"""Tests for ``models/llama.py``: Llama 3 shapes and parameter counts, fx tracing, training on tiny,
and planning-side tracing of the 70B model on the meta device (no weights allocated)."""

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "models" / "llama.py"

# Published totals (Meta's model cards; also what the reference code builds).
META_PARAMS = {"8b": 8_030_261_248, "70b": 70_553_706_496}


def _load():
    spec = importlib.util.spec_from_file_location("_test_model_llama", LLAMA)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def llama():
    return _load()


def _count(module):
    return sum(p.numel() for p in module.parameters())


def test_contract(llama):
    assert llama.__doc__ and len(llama.__doc__) > 200
    assert {"tiny", "8b", "70b"} <= set(llama.SIZES)
    for cfg in llama.SIZES.values():
        assert all(isinstance(v, (int, float, str, bool)) for v in cfg.values())
        with torch.device("meta"):
            llama.build_model(**cfg, unrelated_key=1)
    cfg = llama.SIZES["tiny"]
    llama.make_batch(2, **cfg, unrelated_key=1)
    next(llama.train_batches(2, **cfg, unrelated_key=1))


def test_ffn_hidden_dim_follows_llama3_rule(llama):
    assert llama.ffn_hidden_dim(4096, 1024, 1.3) == 14336
    assert llama.ffn_hidden_dim(8192, 4096, 1.3) == 28672


@pytest.mark.parametrize("size", ["8b", "70b"])
def test_param_counts_match_meta_on_meta_device(llama, size):
    cfg = llama.SIZES[size]
    with torch.device("meta"):
        model = llama.build_model(**cfg)
    assert all(p.is_meta for p in model.parameters())
    assert _count(model) == META_PARAMS[size]
    # The same total from the config by hand: embedding + head + layers x (attention + SwiGLU + 2 norms) + norm.
    d, nkv, hd = cfg["dim"], cfg["n_kv_heads"], cfg["dim"] // cfg["n_heads"]
    f = llama.ffn_hidden_dim(d, cfg["multiple_of"], cfg["ffn_dim_multiplier"])
    layer = 2 * d * d + 2 * d * nkv * hd + 3 * d * f + 2 * d
    assert _count(model.layers[0]) == layer
    assert 2 * cfg["vocab_size"] * d + cfg["n_layers"] * layer + d == META_PARAMS[size]


def test_gqa_shapes(llama):
    with torch.device("meta"):
        model = llama.build_model(**llama.SIZES["70b"])
    att = model.layers[0].attention
    assert tuple(att.wq.weight.shape) == (8192, 8192)
    assert tuple(att.wk.weight.shape) == (1024, 8192)
    assert tuple(att.wv.weight.shape) == (1024, 8192)
    assert model.output.weight is not model.tok_embeddings.weight  # untied


def test_rope_equals_reference_complex_form(llama):
    """The real cos/sin rotation equals Meta's view_as_complex(x) * polar(1, angles)."""
    torch.manual_seed(0)
    hd, s, theta = 16, 12, 500000.0
    x = torch.randn(2, s, 3, hd)
    cos, sin = llama.rope_tables(hd, s, theta)
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2)[: hd // 2].float() / hd))
    freqs_cis = torch.polar(torch.ones(s, hd // 2), torch.outer(torch.arange(s).float(), freqs))
    ref = torch.view_as_real(torch.view_as_complex(x.reshape(2, s, 3, -1, 2)) * freqs_cis.view(1, s, 1, -1)).flatten(3)
    torch.testing.assert_close(llama.apply_rope(x, cos, sin), ref)


def test_attention_equals_repeat_kv_reference(llama):
    """SDPA with enable_gqa equals the reference's repeat_kv + explicit causal softmax."""
    torch.manual_seed(0)
    cfg = llama.SIZES["tiny"]
    model = llama.build_model(**cfg)
    att = model.layers[0].attention
    b, s, d = 2, 10, cfg["dim"]
    x = torch.randn(b, s, d)
    nh, nkv, hd = att.n_heads, att.n_kv_heads, att.head_dim
    assert nkv < nh
    cos, sin = att.rope_cos[:s], att.rope_sin[:s]
    q = llama.apply_rope(att.wq(x).view(b, s, nh, hd), cos, sin).transpose(1, 2)
    k = llama.apply_rope(att.wk(x).view(b, s, nkv, hd), cos, sin).transpose(1, 2)
    v = att.wv(x).view(b, s, nkv, hd).transpose(1, 2)
    k, v = (t.repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = att.wo((F.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, d))
    torch.testing.assert_close(att(x), ref, rtol=1e-5, atol=1e-5)


def test_make_batch_targets_are_next_tokens(llama):
    cfg = llama.SIZES["tiny"]
    torch.manual_seed(0)
    (x,), y = llama.make_batch(3, **cfg)
    assert x.shape == y.shape == (3, cfg["seq_len"]) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    (xs,), ys = next(llama.train_batches(3, **cfg))
    assert torch.equal(xs[:, 1:], ys[:, :-1]) and xs.shape == x.shape


def test_fx_trace_equals_eager_on_tiny(llama):
    cfg = llama.SIZES["tiny"]
    torch.manual_seed(0)
    model = llama.build_model(**cfg)
    torch.manual_seed(1)
    (x,), _ = llama.make_batch(4, **cfg)
    gm = torch.fx.symbolic_trace(model)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    assert {n for n, _ in gm.named_parameters()} == {n for n, _ in model.named_parameters()}
    # Rotary tables are read as buffers (get_attr) and sliced by narrow, not Python slicing.
    targets = {n.target for n in gm.graph.nodes}
    assert torch.narrow in targets
    assert any(n.op == "get_attr" and "rope_cos" in n.target for n in gm.graph.nodes)


@pytest.mark.slow
def test_tiny_trains(llama):
    cfg = llama.SIZES["tiny"]
    torch.manual_seed(0)
    model = llama.build_model(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    it = llama.train_batches(8, **cfg)
    losses = []
    for _ in range(20):
        (x,), y = next(it)
        loss = llama.loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses


# Run in a fresh interpreter so that ru_maxrss (a high-water mark) measures this work alone.
_META_TRACE = textwrap.dedent(
    """
    import importlib.util, json, resource, sys, time
    import torch
    sys.path.insert(0, {root!r})
    from planner.capture.trace import trace_model

    spec = importlib.util.spec_from_file_location("llama", {path!r})
    llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama)
    cfg = llama.SIZES["70b"]
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = llama.build_model(**cfg)
    (x,), _ = llama.make_batch(1, **cfg)
    traced = trace_model(model, (x.to("meta"),))
    seconds = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(dict(
        seconds=seconds, rss_growth_bytes=(rss1 - rss0) * 1024, method=traced.method,
        blocks=[b.name for b in traced.blocks], legal=[c.legal for c in traced.cuts],
        cut_bytes=[c.nbytes for c in traced.cuts], cut_tensors=[len(c.tensors) for c in traced.cuts],
        meta=all(p.is_meta for p in traced.model.parameters()),
    )))
    """
)


@pytest.mark.slow
def test_trace_model_70b_on_meta_allocates_no_weights():
    code = _META_TRACE.format(root=str(ROOT), path=str(LLAMA))
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"70b on meta: build + trace {r['seconds']:.2f} s, peak RSS growth {r['rss_growth_bytes'] / 2**20:.0f} MiB")
    assert r["method"] == "fx"
    assert r["blocks"] == ["tok_embeddings", *(f"layers.{i}" for i in range(80)), "norm", "output"]
    assert all(r["legal"])
    # Only the hidden state crosses a cut: 1 x 8192 tokens x 8192 dims x 4 bytes (fp32).
    assert r["cut_tensors"] == [1] * 82
    assert r["cut_bytes"] == [1 * 8192 * 8192 * 4] * 82
    assert r["meta"]
    assert r["seconds"] < 60
    assert r["rss_growth_bytes"] < 2 * 2**30


def test_reference_attention_code_equals_the_planners(llama):
    """attention_code="reference" (complex RoPE, repeat_kv copies, as Meta's reference and torchtitan)
    computes what the default code does, forward and every gradient, from the same weights; and fx
    traces it (the planner cuts and costs the model from that graph)."""
    cfg = llama.SIZES["tiny"]
    torch.manual_seed(0)
    planner_code = llama.build_model(**cfg)
    torch.manual_seed(0)
    reference = llama.build_model(**cfg, attention_code="reference")
    assert reference.layers[0].attention.reference and not planner_code.layers[0].attention.reference
    torch.manual_seed(1)
    (x,), y = llama.make_batch(3, **cfg)
    graphs = [torch.fx.symbolic_trace(model) for model in (planner_code, reference)]
    losses = []
    for gm in graphs:
        loss = F.cross_entropy(gm(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-6)
    for (name, a), b in zip(planner_code.named_parameters(), reference.parameters(), strict=True):
        assert a.grad is not None, name  # (assert_close takes None for None)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    targets = {n.target for n in graphs[1].graph.nodes}
    assert torch.view_as_complex in targets and llama.F.scaled_dot_product_attention in targets


def test_reference_attention_code_in_bf16_tables(llama):
    """The tables cast with the model to bf16 (torch.complex takes no bf16): the complex rotation
    still runs, and equals the real one on the same tables."""
    torch.manual_seed(0)
    x = torch.randn(2, 6, 3, 8, dtype=torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in llama.rope_tables(8, 6, 10000.0))
    got = llama.apply_rope_complex(x, cos, sin)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, llama.apply_rope(x, cos, sin))


def test_unknown_attention_code_is_refused(llama):
    with pytest.raises(ValueError, match="attention_code='fused': expected 'planner'"):
        llama.build_model(**llama.SIZES["tiny"], attention_code="fused")
