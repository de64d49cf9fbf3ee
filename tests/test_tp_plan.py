"""Tensor-parallel plans: resolution, checks, per-block shares and the plan end to end (CPU, meta device)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from torch import nn

from planner.api import make_plan
from planner.capture.load import load_model_file
from planner.capture.tp_plan import check_tp_plan, match, matched_modules, resolve_tp_plan
from planner.capture.trace import trace_model
from planner.core.levers.hardware import get_hardware
from planner.costs.tensor_parallel import tensor_parallel_shares
from planner.errors import InfeasibleError, ModelFileError, PlannerError
from planner.report.tables import layout_line
from planner.schema.plan import Plan
from planner.schema.request import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "models" / "llama.py"
GPT = ROOT / "models" / "gpt.py"
TOY = ROOT / "models" / "toy.py"
HF_LLAMA = ROOT / "models" / "hf" / "llama.py"
HF_ALBERT = ROOT / "models" / "hf" / "albert.py"


def _meta_model(path: Path, size: str | None = "tiny"):
    mf = load_model_file(path, size)
    with torch.device("meta"):
        model = mf.build()
    return mf, model


def _fake_file(tp_plan: object) -> object:
    """A stand-in ModelFile whose module declares ``tp_plan``."""
    return types.SimpleNamespace(module=types.SimpleNamespace(tp_plan=tp_plan), path=Path("m.py"), config={})


def test_match_star_is_one_part() -> None:
    assert match("layers.*.w", "layers.3.w")
    assert not match("layers.*.w", "layers.3.x.w")
    assert not match("layers.*", "layers.3.w")


def test_llama_file_plan_matches_seven_linears_per_layer_and_the_head() -> None:
    mf, model = _meta_model(LLAMA)
    resolved = resolve_tp_plan(mf, model)
    assert resolved.plan == mf.module.tp_plan and resolved.source == "model file"
    matched = matched_modules(model, resolved.plan)
    assert len(matched) == 7 * 4 + 2
    assert all(isinstance(m, nn.Linear) for n, (_, m, _) in matched.items() if n != "tok_embeddings")
    assert matched["output"][0] == matched["tok_embeddings"][0] == "colwise_rep"
    assert isinstance(matched["tok_embeddings"][1], nn.Embedding)
    check_tp_plan(model, resolved.plan, 2)


def test_plan_function_gets_the_config() -> None:
    mf, model = _meta_model(LLAMA)
    fake = _fake_file(lambda **config: {"layers.*.attention.wq": "colwise"})
    assert resolve_tp_plan(fake, model).plan == {"layers.*.attention.wq": "colwise"}  # type: ignore[arg-type]


def test_transformers_name_for_a_gathered_head_is_colwise_rep() -> None:
    mf, model = _meta_model(LLAMA)
    fake = _fake_file({"output": "colwise_gather_output"})
    assert resolve_tp_plan(fake, model).plan == {"output": "colwise_rep"}  # type: ignore[arg-type]


def _hf_tiny() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=128,
        max_position_embeddings=16,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def test_hf_plan_prefixed_with_base_model() -> None:
    model = _hf_tiny()
    resolved = resolve_tp_plan(_fake_file(None), model)  # type: ignore[arg-type]
    assert resolved.source == "Hugging Face config"
    assert resolved.plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert resolved.plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert resolved.plan["lm_head"] == "colwise_rep"  # the model's own _tp_plan (untied): colwise_gather_output
    # and (transformers 5.24) its embedding_rowwise input embedding, split by its width instead
    assert resolved.plan["model.embed_tokens"] == "colwise_rep"
    assert len(matched_modules(model, resolved.plan)) == 7 * 2 + 2
    check_tp_plan(model, resolved.plan, 2)
    with pytest.raises(ModelFileError, match=r"num_key_value_heads is 2, not a multiple of 4"):
        check_tp_plan(model, resolved.plan, 4)


def test_hf_model_inside_a_wrapper() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = _hf_tiny()

    wrapped = Wrapper()
    plan = resolve_tp_plan(_fake_file(None), wrapped).plan  # type: ignore[arg-type]
    assert plan["lm.model.layers.*.self_attn.o_proj"] == "rowwise" and plan["lm.lm_head"] == "colwise_rep"
    assert len(matched_modules(wrapped, plan)) == 16 and plan["lm.model.embed_tokens"] == "colwise_rep"


def test_a_tied_hugging_face_head_stays_whole() -> None:
    model = _hf_tiny()
    model.lm_head.weight = model.model.embed_tokens.weight
    plan = resolve_tp_plan(_fake_file(None), model).plan  # type: ignore[arg-type]
    assert "lm_head" not in plan and plan["model.layers.*.self_attn.q_proj"] == "colwise"
    check_tp_plan(model, plan, 2)


def test_hugging_face_embedding_styles_split_the_width_and_a_tied_embedding_stays_whole() -> None:
    """transformers 5's embedding_rowwise / embedding_colwise are read as colwise_rep (the width split,
    capture.tp_plan says why not the rows); an embedding tied to the head is left whole, the rest of
    the plan kept."""
    for style in ("embedding_rowwise", "embedding_colwise"):
        model = _hf_tiny()
        model.config.base_model_tp_plan = {"embed_tokens": style, "layers.*.self_attn.q_proj": "colwise"}
        plan = resolve_tp_plan(_fake_file(None), model).plan  # type: ignore[arg-type]
        assert plan["model.embed_tokens"] == "colwise_rep"
        check_tp_plan(model, plan, 2)
    model.lm_head.weight = model.model.embed_tokens.weight
    plan = resolve_tp_plan(_fake_file(None), model).plan  # type: ignore[arg-type]
    assert "model.embed_tokens" not in plan and "lm_head" not in plan
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    check_tp_plan(model, plan, 2)


@pytest.mark.parametrize("style", ["packed_colwise", "rowwise_rep", "sequence_parallel"])
def test_unsupported_styles_give_a_reason(style: str) -> None:
    model = _hf_tiny()
    model.config.base_model_tp_plan = {"layers.*.self_attn.q_proj": style}
    resolved = resolve_tp_plan(_fake_file(None), model)  # type: ignore[arg-type]
    assert resolved.plan == {} and style in resolved.reason and "\n" not in resolved.reason


def test_no_plan_at_all() -> None:
    mf, model = _meta_model(TOY, None)
    assert resolve_tp_plan(mf, model).plan == {}


@pytest.mark.parametrize(
    "plan, tp, message",
    [
        ({"layers.*.attention.wx": "colwise"}, 1, r"'layers\.\*\.attention\.wx' matches no module"),
        ({"layers.*.attention": "colwise"}, 1, r"'layers\.\*\.attention' matches layers\.0\.attention, a Attention"),
        ({"layers.*.feed_forward.w1": "colwise"}, 5, r"feed_forward\.w1 .*out_features is 192, not a multiple of 5"),
        ({"layers.*.attention.wo": "rowwise"}, 128, r"attention\.wo .*in_features is 64, not a multiple of 128"),
        ({"layers.*.attention.wq": "colwise"}, 4, r"layers\.0\.attention, whose n_kv_heads is 2, not a multiple of 4"),
        (
            {"tok_embeddings": "rowwise"},
            2,
            r"splits the embedding tok_embeddings rowwise; an nn\.Embedding splits only",
        ),
        ({"tok_embeddings": "colwise_rep"}, 128, r"tok_embeddings\), whose embedding_dim is 64, not a multiple of 128"),
    ],
)
def test_check_errors_name_the_pattern(plan: dict[str, str], tp: int, message: str) -> None:
    _, model = _meta_model(LLAMA)
    with pytest.raises(ModelFileError, match=message) as info:
        check_tp_plan(model, plan, tp)
    assert "\n" not in str(info.value)


def _shares(path: Path, batch: int = 2, plan: dict[str, str] | None = None):
    mf, model = _meta_model(path)
    inputs, _ = mf.batch(batch)
    inputs = tuple(x.to("meta") for x in inputs)
    traced = trace_model(model, inputs)
    return traced, tensor_parallel_shares(traced, inputs, plan or resolve_tp_plan(mf, model).plan)


ALBERT_LAYER = "albert.encoder.albert_layer_groups.0.albert_layers.0"
ALBERT_PLAN = {f"{ALBERT_LAYER}.ffn": "colwise", f"{ALBERT_LAYER}.ffn_output": "rowwise"}


def test_llama_layer_share_exact() -> None:
    traced, shares = _shares(LLAMA, batch=2)
    # the final norm: only its sequence share (no split layer)
    assert set(shares) == {f"layers.{i}" for i in range(4)} | {"tok_embeddings", "output", "norm"}
    dim, kv, hidden, tokens, fp32 = 64, 2 * 16, 192, 2 * 32, 4  # tiny: head_dim 16, SwiGLU 192
    share = shares["layers.0"]
    assert share.sharded_params == dim * dim * 2 + dim * kv * 2 + dim * hidden * 3
    assert share.sharded_param_bytes == share.sharded_params * fp32
    assert share.fwd_allreduces == 2 and share.fwd_allreduce_bytes == 2 * tokens * dim * fp32
    # one all-reduce per column-wise layer (torch's ColwiseParallel): q, k, v, w1, w3
    assert share.bwd_allreduces == 5 and share.bwd_allreduce_bytes == 5 * tokens * dim * fp32
    assert share.divisor == 2  # n_kv_heads
    # the matmuls (linear layers and attention, all split) against the elements the two norms and
    # two residual adds touch (~4 x 64 x ~3 per token): the split share is the matmul share, ~0.99
    matmul = tokens * (2 * share.sharded_params + 2 * 2 * 32 * dim)  # x W, and q k^T, p v over 32 positions
    whole = tokens * dim * 12
    assert 0 < share.sharded_compute < 1
    assert share.sharded_compute == pytest.approx(matmul / (matmul + whole), abs=0.01)
    assert share.sharded_activation_bytes > 0
    # saved whole on every tp rank: each of the two RMSNorms' input, its normalised input and its
    # output (the column-wise layers' input, which q, k, v or w1, w3 save as one tensor), and its
    # reciprocal root (one per token); not the weights, their transposes, nor the rotary tables
    assert share.unsplit_activation_bytes == 2 * (3 * tokens * dim + tokens) * fp32


def test_split_activations_are_at_most_what_the_block_saves_less_the_whole_ones() -> None:
    """The watched forward runs SDPA's math form on the meta device (it saves the attention
    probabilities), so its split count can exceed the block's own activations; the whole tensors
    must still count whole."""
    from plan_factory import block as plan_block
    from test_tensor_parallel import share as layer_share

    from planner.costs.tp_blocks import _fitted

    share = layer_share(10, act=5_000).model_copy(update={"unsplit_activation_bytes": 300})
    block = plan_block("b", 1.0, 2.0, 10).model_copy(update={"activation_bytes": 1_000})
    fitted = _fitted(block, share).tp
    assert fitted is not None
    assert (fitted.sharded_activation_bytes, fitted.unsplit_activation_bytes) == (700, 300)
    small = share.model_copy(update={"sharded_activation_bytes": 200})
    fitted = _fitted(block, small).tp
    assert fitted is not None and (fitted.sharded_activation_bytes, fitted.unsplit_activation_bytes) == (200, 300)
    # autocast's weight copies (of the activations) are split as the weights are, not as activations:
    # the split part is at most 1000 - 300 whole - 400 copies
    cast = block.model_copy(update={"weight_cast_bytes": 400})
    fitted = _fitted(cast, share).tp
    assert fitted is not None and (fitted.sharded_activation_bytes, fitted.unsplit_activation_bytes) == (300, 300)
    # one of 4 tp ranks: the 300 whole, a quarter of the 300 split, and its share of the copies (the
    # block's parameters all split: a quarter)
    from planner.core.levers.tensor_parallel import at_degree
    from planner.schema.costs import LinkCost

    split = cast.model_copy(update={"tp": fitted.model_copy(update={"sharded_params": 10, "sharded_param_bytes": 40})})
    rank = at_degree(
        [split.model_copy(update={"param_bytes": 40})], 4, LinkCost(name="l", latency_s=0.0, bandwidth_Bps=1e9)
    )[0]
    assert (rank.activation_bytes, rank.weight_cast_bytes) == (300 + 75 + 100, 100)


def test_llama_output_head_share_exact() -> None:
    """The head (colwise_rep): its rows split, its logits all-gathered in forward, its input's
    gradient all-reduced in backward, any degree (torch shards a vocabulary the degree does not
    divide unevenly)."""
    _, shares = _shares(LLAMA, batch=2)
    dim, vocab, tokens, fp32 = 64, 512, 2 * 32, 4
    head = shares["output"]
    assert head.sharded_params == dim * vocab and head.sharded_param_bytes == dim * vocab * fp32
    assert head.fwd_allgather_bytes == tokens * vocab * fp32
    assert (head.head_allgather_bytes, head.head_rows) == (tokens * vocab * fp32, tokens)  # loss parallelism's
    assert (head.fwd_allreduces, head.fwd_allreduce_bytes) == (0, 0)
    assert (head.bwd_allreduces, head.bwd_allreduce_bytes) == (1, tokens * dim * fp32)
    assert head.divisor == 0 and head.sharded_compute == 1.0
    assert head.sharded_activation_bytes == 0  # it saves its whole input; its output is gathered whole
    assert head.unsplit_activation_bytes == tokens * dim * fp32


def test_llama_input_embedding_share_exact() -> None:
    """The input embedding (colwise_rep): its width split, the looked-up slices all-gathered in
    forward; its input is token ids, so no gradient is all-reduced in backward."""
    _, shares = _shares(LLAMA, batch=2)
    dim, vocab, tokens, fp32 = 64, 512, 2 * 32, 4
    emb = shares["tok_embeddings"]
    assert emb.sharded_params == vocab * dim and emb.sharded_param_bytes == vocab * dim * fp32
    assert emb.fwd_allgather_bytes == tokens * dim * fp32
    assert (emb.head_allgather_bytes, emb.head_rows) == (0, 0)  # no head: its vectors stay gathered
    assert (emb.fwd_allreduces, emb.fwd_allreduce_bytes, emb.bwd_allreduces, emb.bwd_allreduce_bytes) == (0, 0, 0, 0)
    assert emb.sharded_compute == 1.0 and emb.divisor % 64 == 0 or 64 % emb.divisor == 0


def test_tied_split_layer_is_refused() -> None:
    _, model = _meta_model(LLAMA)
    model.output.weight = model.tok_embeddings.weight
    with pytest.raises(
        ModelFileError,
        match=r"splits output colwise_rep \('output'\), whose weight is tied to tok_embeddings: torch gives",
    ):
        check_tp_plan(model, {"output": "colwise_rep"}, 2)


def test_gpt_shares_the_feed_forward_only() -> None:
    _, shares = _shares(GPT)
    share = shares["layers.0"]
    dim, ffn, tokens, fp32 = 64, 256, 2 * 32, 4
    assert share.sharded_params == dim * ffn + ffn + ffn * dim  # linear1's bias is split, linear2's is not
    assert (share.fwd_allreduces, share.bwd_allreduces) == (1, 1)
    assert share.fwd_allreduce_bytes == share.bwd_allreduce_bytes == tokens * dim * fp32
    assert 0.2 < share.sharded_compute < 0.8  # the attention stays whole
    assert share.divisor == 256


def test_block_without_split_layers_has_no_share() -> None:
    mf, model = _meta_model(LLAMA)
    inputs, _ = mf.batch(1)
    inputs = tuple(x.to("meta") for x in inputs)
    traced = trace_model(model, inputs)
    shares = tensor_parallel_shares(traced, inputs, {"layers.0.attention.wq": "colwise"})
    assert set(shares) == {"layers.0"} and shares["layers.0"].fwd_allreduces == 0


class _TwoLinears(nn.Module):
    """A column-wise then a row-wise 8192 x 8192 GEMM over 8192 tokens (2-D: nothing but the two mm)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8192, 8192, bias=False), nn.Linear(8192, 8192, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_estimated_shares_carry_the_sharded_gemms_slowdown() -> None:
    with torch.device("meta"):
        model = _TwoLinears().to(torch.bfloat16)
    inputs = (torch.empty(8192, 8192, device="meta", dtype=torch.bfloat16),)
    traced = trace_model(model, inputs)
    plan = {"layers.0": "colwise", "layers.1": "rowwise"}
    h100 = get_hardware("h100")
    shares = tensor_parallel_shares(traced, inputs, plan, hardware=h100, dtype="bf16")
    # the whole split part is one GEMM, compute-bound at degree 8 too (n or k 1024): the slowdown is
    # the efficiency of 8192 x 8192 x 8192 over that of the sharded 8192 x 1024 x 8192 (8192 x 8192 x 1024)
    expected = h100.gemm_efficiency(8192, 8192, 8192) / h100.gemm_efficiency(8192, 1024, 8192)
    assert expected == pytest.approx((8192 / (8192 + 128)) / (1024 / (1024 + 128)), rel=1e-12)  # 1.1077
    for name in plan:
        share = shares[name]
        assert share.sharded_compute == 1.0
        assert set(share.slowdown) == {2, 4, 8, 16, 32, 64}  # the divisors of 8192 up to 64
        assert share.slowdown[8] == pytest.approx(expected, rel=1e-12)
        assert 1 < share.slowdown[2] < share.slowdown[4] < share.slowdown[8]
    # measured costs (no hardware): no slowdown
    assert tensor_parallel_shares(traced, inputs, plan)["layers.0"].slowdown == {}


def test_llama_70b_layer_slowdown_grows_with_the_degree() -> None:
    mf = load_model_file(LLAMA, "70b", {"n_layers": 1})
    with torch.device("meta"):
        model = mf.build().to(torch.bfloat16)
    inputs = tuple(x.to("meta") for x in mf.batch(1)[0])
    traced = trace_model(model, inputs)
    share = tensor_parallel_shares(
        traced, inputs, resolve_tp_plan(mf, model).plan, hardware=get_hardware("h100"), dtype="bf16"
    )["layers.0"]
    assert share.divisor == 8 and set(share.slowdown) == {2, 4, 8}
    # wq and wo at 1024 features, w1 w2 w3 at 3584, wk wv at 128 (memory-bound) at degree 8; diluted by
    # attention's share of the split work, which keeps its per-head shapes
    assert 1 < share.slowdown[2] < share.slowdown[4] < share.slowdown[8] < 1.1
    assert share.slowdown[8] == pytest.approx(1.047, abs=0.001)


def _plan(path: Path, tp: int | str, gpus: int = 4, size: str | None = "tiny"):
    return make_plan(PlanRequest.build(model_file=path, size=size, gpus=gpus, gpu_type="h100", tp=tp, batch_size=8))


@pytest.mark.parametrize("batch", [1, 64])
def test_sequence_parallelism_auto_is_the_faster_of_on_and_off(batch: int) -> None:
    """--sequence-parallel auto (the default): the search tries each tensor-parallel layout both ways
    and keeps the faster that fits, so its step is the better of the two forced plans', its plan and
    its search table saying which it ran."""

    def plan_with(sequence: bool | str, **extra: object) -> Plan:
        request = dict(model_file=LLAMA, size="8b", gpus=8, gpu_type="h100", tp=4, batch_size=batch, progress=False)
        return make_plan(PlanRequest.build(**request, sequence_parallel=sequence, **extra))  # type: ignore[arg-type]

    on, off, auto = plan_with(True), plan_with(False), plan_with("auto")
    assert on.sequence_parallel and not off.sequence_parallel
    best = min((on, off), key=lambda p: p.prediction.step_time_s)
    assert auto.prediction.step_time_s == best.prediction.step_time_s
    assert auto.sequence_parallel == best.sequence_parallel
    # both tried: solved and listed (one sample: the two are close), or the slower way's layouts ruled
    # out by their lower bound, unsolved (64: sequence parallelism is 6 % faster), which the choice says
    listed = {c.sequence_parallel for c in auto.search}
    if batch == 1:
        assert listed == {True, False}
    else:
        assert listed == {auto.sequence_parallel} and "ruled out unsolved" in auto.choice
    chosen = [c for c in auto.search if c.step_time_s == auto.prediction.step_time_s]
    assert chosen and all(c.sequence_parallel == auto.sequence_parallel for c in chosen)
    assert ("with sequence parallelism" in auto.choice.split(":")[0]) == auto.sequence_parallel  # the chosen one


def test_a_compiled_block_splits_what_it_saves_as_its_eager_forward_does() -> None:
    """The share counts the eager forward's tensors; a compiled block saves less (here half): both
    parts scale to it in the eager proportion, where capping the whole part at the compiled count
    would leave nothing split (every tp rank charged the whole block)."""
    from plan_factory import block as plan_block
    from test_tensor_parallel import share as layer_share

    from planner.costs.tp_blocks import _fitted

    share = layer_share(10, act=5_000).model_copy(update={"unsplit_activation_bytes": 600})
    eager = plan_block("b", 1.0, 2.0, 10).model_copy(update={"activation_bytes": 1_000})
    compiled = eager.model_copy(update={"activation_bytes": 500, "eager_activation_bytes": 1_000})
    split = _fitted(eager, share).tp
    assert split is not None and (split.sharded_activation_bytes, split.unsplit_activation_bytes) == (400, 600)
    split = _fitted(compiled, share).tp
    assert split is not None and (split.sharded_activation_bytes, split.unsplit_activation_bytes) == (200, 300)
    # a compiled estimate records its eager count, and each layer's tp share is what it saves, split
    from planner.api import estimated_costs, tensor_parallel_split

    request = PlanRequest.build(model_file=LLAMA, size="tiny", gpus=2, gpu_type="h100", tp=2, compile=True)
    mf = load_model_file(LLAMA, "tiny")
    costs = estimated_costs(mf, request, 1)
    layers = [b for b in tensor_parallel_split(mf, request, costs, costs.blocks).blocks if b.name.startswith("layers.")]
    assert layers
    for b in layers:
        assert b.tp is not None and b.eager_activation_bytes is not None
        assert b.activation_bytes < b.eager_activation_bytes
        held = b.tp.sharded_activation_bytes + b.tp.unsplit_activation_bytes
        assert b.tp.sharded_activation_bytes > 0 and held <= b.activation_bytes - b.weight_cast_bytes


def test_costs_reused_for_other_microbatches_split_as_costs_made_for_them() -> None:
    """The shares are counted at the size the blocks were costed at (``ProfileInfo.microbatch_size``),
    so costs reused for a request of smaller microbatches (bench/common.plan_on_costs: one estimate,
    many layouts) split their blocks as costs made at that size do. Counted at the request's size
    they were fitted to blocks of another size and then rescaled with them (torchtitan's 405B Float8
    row, costed at 2 samples a microbatch: a layer's whole part at 1 and at 4 samples a microbatch
    half and twice its bytes, 0.34 and 5.5 GiB where it holds 0.69 and 2.8)."""
    from planner.api import estimated_costs, tensor_parallel_split
    from planner.core.levers.microbatch import blocks_at

    mf = load_model_file(LLAMA, "tiny")
    common = dict(model_file=LLAMA, size="tiny", gpus=2, gpu_type="h100", tp=2, batch_size=8, dp=1)
    big = PlanRequest.build(**common, microbatches=2)  # microbatches of 4 samples
    small = PlanRequest.build(**common, microbatches=8)  # of 1
    assert (big.microbatch_size, small.microbatch_size) == (4, 1)
    costs = estimated_costs(mf, big, 1)
    assert costs.profile.microbatch_size == 4
    reused = blocks_at(tensor_parallel_split(mf, small, costs, costs.blocks).blocks, 4, 1, 0.0)
    fresh = estimated_costs(mf, small, 1)
    made = tensor_parallel_split(mf, small, fresh, fresh.blocks).blocks
    split = [(a.tp, b.tp) for a, b in zip(reused, made, strict=True) if b.tp is not None]
    assert split
    for got, want in split:
        assert got is not None
        # the same bytes, to the rounding of a rescale
        assert abs(got.unsplit_activation_bytes - want.unsplit_activation_bytes) <= 1
        assert abs(got.sharded_activation_bytes - want.sharded_activation_bytes) <= 1


def test_sequence_parallelism_auto_stays_off_when_compiled_and_at_tp_1() -> None:
    base = dict(model_file=LLAMA, size="tiny", gpus=4, gpu_type="h100", batch_size=8, progress=False)
    compiled = make_plan(PlanRequest.build(**base, tp=2, compile=True))  # type: ignore[arg-type]
    assert compiled.tp == 2 and not compiled.sequence_parallel
    assert not any(c.sequence_parallel for c in compiled.search)
    whole = make_plan(PlanRequest.build(**base, tp=1))  # type: ignore[arg-type]
    assert not whole.sequence_parallel and not any(c.sequence_parallel for c in whole.search)


def test_end_to_end_llama_auto_and_forced() -> None:
    plan = _plan(LLAMA, 2)
    assert plan.tp == 2 and plan.tp_plan == load_model_file(LLAMA, "tiny").module.tp_plan
    # estimated: dim 64 split in 2 (wk, wv 16) sits in the GEMMs' overhead floor, about twice 1/2 the time
    layer = plan.blocks[1].tp
    assert layer is not None and set(layer.slowdown) == {2} and 1.5 < layer.slowdown[2] <= 2.0
    assert Plan.model_validate_json(plan.model_dump_json()) == plan  # int degrees round-trip through JSON
    # the head too, and the final norm (its sequence share alone: held whole, split with sequence parallelism)
    assert [b.tp is not None for b in plan.blocks] == [True] * 7  # the embedding split too
    auto = _plan(LLAMA, "auto")
    assert auto.tp in (1, 2) and all(b.tp is not None for b in auto.blocks if b.name.startswith("layers."))
    with pytest.raises(ModelFileError, match="--tp 4: tp_plan splits"):
        _plan(LLAMA, 4)


def test_loss_parallelism_splits_the_heads_output_and_loss_where_a_head_is_split() -> None:
    """--loss-parallel: llama 8B on 8 H100 at tp 4, the vocabulary's logits (128,256 wide) left split:
    the last block's output and loss at a quarter, less memory and no slower than gathering them; a
    model whose plan splits no head, or --tp 1, is refused in one line."""
    request = dict(model_file=LLAMA, size="8b", gpus=8, gpu_type="h100", tp=4, batch_size=8, progress=False)
    whole = make_plan(PlanRequest.build(**request))  # type: ignore[arg-type]
    split = make_plan(PlanRequest.build(**request, loss_parallel=True))  # type: ignore[arg-type]
    assert split.loss_parallel and not whole.loss_parallel
    a, b = whole.blocks[-1], split.blocks[-1]
    assert a.name == b.name == "output" and b.output_bytes * 4 == a.output_bytes > 0
    assert (
        a.loss_bytes is not None and b.loss_bytes is not None and b.loss_bytes * 4 == pytest.approx(a.loss_bytes, abs=4)
    )
    assert b.loss_s is not None and a.loss_s is not None and b.loss_s * 4 == pytest.approx(a.loss_s, rel=1e-9)
    assert b.fwd_s < a.fwd_s and b.activation_bytes < a.activation_bytes
    assert split.prediction.max_memory_bytes < whole.prediction.max_memory_bytes
    assert split.prediction.step_time_s <= whole.prediction.step_time_s
    assert "(loss parallelism)" in layout_line(split)
    with pytest.raises(ModelFileError, match="--loss-parallel: the tp_plan splits no output head"):
        make_plan(PlanRequest.build(model_file=GPT, size="tiny", gpus=4, tp=2, batch_size=8, loss_parallel=True))
    with pytest.raises(PlannerError, match="--loss-parallel computes the loss .* but --tp is 1"):
        PlanRequest.build(model_file=LLAMA, gpus=4, tp=1, loss_parallel=True)


def test_end_to_end_gpt_mlp_plan() -> None:
    plan = _plan(GPT, 2)
    assert plan.tp == 2 and plan.tp_plan == {"layers.*.linear1": "colwise", "layers.*.linear2": "rowwise"}


def test_end_to_end_toy_without_plan() -> None:
    plan = _plan(TOY, "auto", gpus=2, size=None)
    assert plan.tp == 1 and plan.tp_plan == {} and "tensor parallelism: none" in plan.choice
    with pytest.raises(InfeasibleError, match="--tp 2: the model declares no tensor-parallel plan"):
        _plan(TOY, 2, gpus=2, size=None)


def test_an_exported_hugging_face_model_is_split_by_its_config_plan() -> None:
    # torch.export inlines the linear layers; their shares are read off the graph's nodes, and the
    # runner calls them as modules again (planner.run.tensor_shard.shardable_trace)
    base = dict(model_file=str(HF_LLAMA), size="tiny", gpus=4, gpu_type="h100", batch_size=8, progress=False)
    plan = make_plan(PlanRequest.build(**base, tp=2))
    assert plan.tp == 2 and plan.model.trace_method == "export"
    from transformers import LlamaConfig

    base_plan = {f"model.{k}": v for k, v in LlamaConfig().base_model_tp_plan.items()}
    # with the model's own _tp_plan: its head gathered, its embedding (embedding_rowwise) split by width
    assert plan.tp_plan == base_plan | {"lm_head": "colwise_rep", "model.embed_tokens": "colwise_rep"}
    # the final norm too: held whole, its sequence shards split under sequence parallelism
    named = ("lm_head", "model.norm", "model.embed_tokens")
    split = [b.name.startswith("model.layers.") or b.name in named for b in plan.blocks]
    assert [b.tp is not None for b in plan.blocks] == split
    head = plan.blocks[-1].tp
    assert head is not None and plan.blocks[-1].name == "lm_head"
    # read off the export graph's nodes: the logits (vocabulary 512) gathered, the input (dim 64)'s gradient reduced
    assert (head.fwd_allreduces, head.bwd_allreduces, head.divisor) == (0, 1, 0)
    assert head.fwd_allgather_bytes == head.bwd_allreduce_bytes * 512 // 64 > 0
    # loss parallelism's: all of it, over its rows (a microbatch's tokens; bf16 logits 512 wide)
    assert head.head_allgather_bytes == head.fwd_allgather_bytes == head.head_rows * 512 * 2
    emb = plan.blocks[0].tp
    assert emb is not None and plan.blocks[0].name == "model.embed_tokens"
    # an aten.embedding on the token ids: its weight split (vocabulary 512 x dim 64), the lookups gathered,
    # no input gradient to reduce
    assert emb.sharded_params == 512 * 64 and emb.fwd_allgather_bytes > 0
    assert (emb.fwd_allreduces, emb.bwd_allreduces, emb.bwd_allreduce_bytes) == (0, 0, 0)
    share = next(b.tp for b in plan.blocks if b.tp is not None and b.name.startswith("model.layers."))
    dim, kv, ffn = 64, 2 * 16, 172  # tiny: 4 heads of 16, 2 key/value heads, SwiGLU 172
    assert share.sharded_params == dim * dim * 2 + dim * kv * 2 + dim * ffn * 3
    assert (share.fwd_allreduces, share.bwd_allreduces) == (2, 5)  # o, down; q, k, v, gate, up
    with pytest.raises(ModelFileError, match="--tp 4: .*not a multiple of 4|--tp 4: .*divide"):
        make_plan(PlanRequest.build(**base, tp=4))  # 2 key/value heads


@pytest.mark.parametrize("path", [LLAMA, GPT, HF_LLAMA, HF_ALBERT])
def test_twin_blocks_replayed_give_the_shares_a_run_of_every_block_gives(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The share run replays twin layers on the meta device (one run per distinct layer); the shares
    are those of running every block, also for ALBERT, whose one layer module runs in every block
    (its split layers are counted once, so its blocks are never replayed)."""
    from planner.costs import tensor_parallel

    plan = ALBERT_PLAN if path is HF_ALBERT else None
    ran: list[bool] = []
    original = tensor_parallel._ShareRun._begin

    def counting(self: tensor_parallel._ShareRun, k: int) -> None:
        original(self, k)
        ran.append(self.replay is None)

    monkeypatch.setattr(tensor_parallel._ShareRun, "_begin", counting)
    traced, replayed = _shares(path, plan=plan)
    assert replayed
    layers = sum(1 for b in traced.blocks if b.name in replayed and b.is_layer)  # the head is no twin
    if path is HF_ALBERT:
        assert ran.count(False) == 0
    else:
        # every layer after the second was replayed (the first reads no sequence shard, the second does)
        assert ran.count(False) >= layers - 2 >= 1
    monkeypatch.setattr(tensor_parallel._ShareRun, "_begin", lambda self, k: None)
    _, plain = _shares(path, plan=plan)
    assert plain == replayed


def test_plans_on_costs_made_once_equal_make_plan(tmp_path: Path) -> None:
    """The benches plan many requests on one profile through ``plan_from_costs``: the same plan as
    ``make_plan`` gives, tensor-parallel shares counted in the planning dtype (they once were fp32
    there, doubling every all-reduce of a bf16 estimate)."""
    from planner.api import default_threads, estimated_costs, plan_from_costs
    from planner.core.step.predict import with_links

    request = PlanRequest.build(
        model_file=str(LLAMA),
        size="tiny",
        gpus=4,
        gpu_type="h100",
        tp=2,
        batch_size=8,
        output=tmp_path / "plan.json",
        progress=False,
    )
    want = make_plan(request)
    mf = load_model_file(request.model_file, request.size, request.overrides)
    costs = estimated_costs(mf, request, default_threads(request.gpus))
    got = with_links(
        plan_from_costs(
            request, mf, costs, costs.blocks, costs.link, created=want.created, memory_limit_bytes=costs.memory_bytes
        ),
        costs.link,
    )
    assert got.tp == want.tp == 2 and got.profile.dtype == "bf16"
    assert got.prediction == want.prediction
    assert got.blocks == want.blocks
    split = next(b for b in got.blocks if b.tp is not None and b.name.startswith("layers."))
    # a layer all-reduces two outputs of the hidden state's size forward, in bf16 as the cut after it
    assert split.tp is not None and split.tp.fwd_allreduce_bytes == 2 * split.cut_bytes


def test_a_split_an_exported_model_cannot_run_is_refused_at_plan_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the runner's check (planner.capture.tp_graph), made once for the search's choice: --tp auto
    # plans the model whole and says why, --tp 2 is one line. The toy's layers are so small that an
    # H100's host would set their pace and make splitting them pointless: with no host time, the
    # search's choice is the split the check refuses.
    from planner.core.levers import hardware

    monkeypatch.setitem(hardware.GPUS, "h100", hardware.GPUS["h100"].model_copy(update={"dispatch_s": 0.0}))
    toy = (ROOT / "models" / "toy.py").read_text()
    from run_factory import TOY_FULL_WIDTH

    split = toy.replace(*TOY_FULL_WIDTH)
    assert split != toy
    path = tmp_path / "split.py"
    path.write_text(split)
    base = dict(model_file=str(path), size="wide", gpus=2, gpu_type="h100", batch_size=8, progress=False)
    plan = make_plan(PlanRequest.build(**base, tp="auto"))
    assert plan.tp == 1 and plan.model.trace_method == "export"
    assert "tensor parallelism: none, the model does not trace with its tp_plan layers split" in plan.choice
    with pytest.raises(ModelFileError, match=r"--tp 2: the model does not trace .* give --tp 1"):
        make_plan(PlanRequest.build(**base, tp=2))


def test_llama_sequence_shares_exact() -> None:
    # under sequence parallelism each RMSNorm on a sequence shard saves its input, its normalised input
    # (2 x tokens x dim) and its reciprocal root (tokens) split, and the column-wise layers keep their
    # input as the shard, gathered again in backward once per gathered value (q, k, v share one, w1 and
    # w3 another); layers.0's attention norm reads the embedding, not a shard
    _, shares = _shares(LLAMA, batch=2)
    dim, tokens, fp32 = 64, 2 * 32, 4
    hidden = tokens * dim * fp32
    per_norm = (2 * tokens * dim + tokens) * fp32
    first, later, norm, head = (shares[k].sequence for k in ("layers.0", "layers.1", "norm", "output"))
    assert first is not None and later is not None and norm is not None and head is not None
    assert later.activation_bytes == 2 * per_norm + 2 * hidden
    assert first.activation_bytes == per_norm + hidden and norm.activation_bytes == per_norm
    assert (later.gathers, later.gather_bytes, later.whole_inputs) == (2, 2 * hidden, 0)
    assert (later.regathers, later.regather_bytes, later.column_bytes) == (2, 2 * hidden, 2 * hidden)
    assert (first.gathers, first.whole_inputs, first.whole_input_bytes, first.regathers) == (1, 1, hidden, 1)
    assert (later.param_grads, later.param_grad_bytes, first.param_grads) == (2, 2 * dim * fp32, 1)
    assert later.cut_share == 1.0 and norm.compute == 1.0 and 0 < later.compute < 0.01
    assert (head.gathers, head.regathers, head.activation_bytes, head.cut_share) == (1, 1, hidden, 0.0)
    assert not later.mixed and not norm.mixed
    assert shares["norm"].sharded_params == 0 and shares["norm"].divisor == 0  # held whole, any degree
    assert shares["tok_embeddings"].sequence is None  # before any row-wise layer: nothing is a shard


def test_a_row_wise_output_not_laid_out_batch_seq_features_is_no_sequence_shard() -> None:
    # [tokens, features]: dimension 1 would split the features, so sequence parallelism is refused
    from torch import nn

    from planner.capture.trace import trace_model

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))
    inputs = (torch.randn(6, 8),)
    traced = trace_model(model, inputs)
    shares = tensor_parallel_shares(traced, inputs, {"0": "colwise", "2": "rowwise"})
    mixed = [s.sequence.mixed for s in shares.values() if s.sequence is not None and s.sequence.mixed]
    assert mixed and "a row-wise output of shape (6, 8), not [batch, seq, features]" in mixed[0]


def test_the_runner_checks_a_plans_tp_against_the_heads_too() -> None:
    """A plan's tp edited by hand (2 to 4 on tiny Llama's 2 key-value heads) passed the runner's width
    checks and failed at the first step, every rank started; refused before launch now."""
    from planner.errors import PlanFileError
    from planner.run.tensor_shard import check_tp_degree

    mf = load_model_file(LLAMA, size="tiny")
    model = mf.build(seed=0)
    plan = dict(resolve_tp_plan(mf, model).plan)
    check_tp_degree(model, plan, 2)
    check_tp_degree(model, plan, 1)
    with pytest.raises(PlanFileError, match="tp 4 cannot split this model: .* n_kv_heads is 2, not a multiple of 4; "):
        check_tp_degree(model, plan, 4)


def test_a_refused_degree_names_the_degrees_that_work_and_what_limits_them() -> None:
    """It said "give a degree that divides 2" right after naming a width of 64 (issue 66): the limit,
    tiny Llama's 2 key-value heads, is named now."""
    mf = load_model_file(LLAMA, size="tiny")
    model = mf.build(seed=0)
    plan = dict(resolve_tp_plan(mf, model).plan)
    with pytest.raises(ModelFileError) as caught:
        check_tp_plan(model, plan, 3)
    assert str(caught.value).endswith(
        "the degrees that divide every split size: 2 (layers.0.attention's n_kv_heads is 2); give one of them, "
        "or --tp auto"
    )


def test_fewer_gpus_than_a_node_holds_are_one_node_for_tp() -> None:
    # 6 GPUs of an 8-GPU node: tp 3 stays inside it (was "does not divide the 8 ranks of a node")
    request = PlanRequest.build(model_file="m.py", gpus=6, tp=3, gpu_type="h100", batch_size=6)
    assert request.tp == 3
    with pytest.raises(PlannerError, match="--tp 3 does not divide the 8 ranks of a node"):
        PlanRequest.build(model_file="m.py", gpus=12, tp=3, gpu_type="h100", batch_size=12)
