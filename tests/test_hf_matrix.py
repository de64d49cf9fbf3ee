"""Tier 3: transformers architectures as users bring them, each split over 2 ranks and trained like
the unsplit model.

Twelve families from tiny configs, chosen so that every path the planner takes with a transformers
model is crossed: tied and untied heads, grouped-query attention, mixture-of-experts layers (with and
without a shared expert), one layer shared by every block, encoder-only, encoder-decoder (relative
and learned positions), ALiBi, parallel attention and MLP. Each is planned on this CPU (measured) and
with ``--gpu-type cpu`` (estimated on the meta device) under interleaved zero-bubble, and each plan trains 2 steps to the unsplit
model's losses and gradient norms (rel 1e-4). docs/hf_models.md has the table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from planner.api import make_plan
from planner.schema.request import PlanRequest
from tests.run_factory import assert_trains_like_unsplit

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 128, 16

_BUILD = """
import torch
import torch.nn.functional as F


def build_model(**_ignored):
    import transformers

    return transformers.{model}(transformers.{config}(**{kwargs!r}))


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
"""

CAUSAL = (
    _BUILD
    + """

def make_batch(batch_size, **_ignored):
    seq = torch.randint(2, {vocab}, (batch_size, {seq} + 1))
    return {{"input_ids": seq[:, :-1]}}, seq[:, 1:]
"""
)

SEQ2SEQ = (
    _BUILD
    + """

def make_batch(batch_size, **_ignored):
    source = torch.randint(2, {vocab}, (batch_size, {seq}))
    target = torch.randint(2, {vocab}, (batch_size, {seq} + 1))
    return {{"input_ids": source, "decoder_input_ids": target[:, :-1]}}, target[:, 1:]
"""
)

NO_DROPOUT = {"attention_dropout": 0.0}


# family -> (what it exercises, a shipped file and size, or (template, model class, config class, config))
FAMILIES: dict[str, tuple[str, Any]] = {
    "gpt2": ("tied head, learned positions", ("models/hf/gpt2.py", "tiny")),
    "llama": ("grouped-query attention, untied head, padding mask", ("models/hf/llama.py", "tiny")),
    "qwen2": ("grouped-query attention with biases, tied head", ("models/hf/qwen.py", "tiny")),
    "bert": ("encoder only, MLM head tied to the embeddings", ("models/hf/bert_mlm.py", "tiny")),
    "albert": ("one layer shared by every block: a tie across stages", ("models/hf/albert.py", "tiny")),
    "mixtral": ("mixture of experts (top 2 of 4)", ("models/hf/mixtral.py", "tiny")),
    "qwen2_moe": ("fine-grained experts beside a shared expert", ("models/hf/qwen_moe.py", "tiny")),
    "t5": ("encoder-decoder, relative position bias", ("models/hf/t5.py", "tiny")),
    "bart": (
        "encoder-decoder, learned positions, tied embeddings",
        (
            SEQ2SEQ,
            "BartForConditionalGeneration",
            "BartConfig",
            dict(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=64,
                dropout=0.0,
                activation_dropout=0.0,
                pad_token_id=0,
                bos_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
                forced_eos_token_id=None,
                **NO_DROPOUT,
            ),
        ),
    ),
    "bloom": (
        "ALiBi position biases",
        (
            CAUSAL,
            "BloomForCausalLM",
            "BloomConfig",
            dict(vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4, hidden_dropout=0.0, **NO_DROPOUT),
        ),
    ),
    "gpt_neox": (
        "parallel attention and MLP, partial rotary",
        (
            CAUSAL,
            "GPTNeoXForCausalLM",
            "GPTNeoXConfig",
            dict(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=3,
                num_attention_heads=4,
                intermediate_size=64,
                max_position_embeddings=64,
                use_parallel_residual=True,
                rotary_pct=0.25,
                hidden_dropout=0.0,
                **NO_DROPOUT,
            ),
        ),
    ),
    "gemma": (
        "multi-query attention, tied head, scaled embeddings",
        (
            CAUSAL,
            "GemmaForCausalLM",
            "GemmaConfig",
            dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=1,
                head_dim=8,
                max_position_embeddings=64,
                **NO_DROPOUT,
            ),
        ),
    ),
}


def _model_file(family: str, tmp_path: Path) -> tuple[Path, str | None]:
    spec = FAMILIES[family][1]
    if len(spec) == 2:
        return ROOT / spec[0], spec[1]
    template, model, config, kwargs = spec
    path = tmp_path / f"{family}.py"
    path.write_text(template.format(model=model, config=config, kwargs=kwargs, vocab=VOCAB, seq=SEQ))
    return path, None


def test_the_matrix_covers_ten_families_and_every_path() -> None:
    assert len(FAMILIES) >= 10
    said = " ".join(what for what, _ in FAMILIES.values())
    for path in (
        "tied",
        "untied",
        "grouped-query",
        "experts",
        "shared by every block",
        "encoder only",
        "encoder-decoder",
        "ALiBi",
        "parallel attention",
    ):
        assert path in said, path


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_split_over_2_ranks_trains_like_the_unsplit_model(family: str, tmp_path: Path) -> None:
    model, size = _model_file(family, tmp_path)
    # measured here, the schedule searched; estimated on the meta device for this CPU, under a zero-bubble
    # schedule (its two-part backward takes each stage's input and weight gradients apart: shared layers,
    # T5's position bias made once and read by every decoder layer)
    for gpu_type, schedule in ((None, "auto"), ("cpu", "interleaved-zb")):
        request = PlanRequest.build(
            model_file=model,
            size=size,
            gpus=2,
            batch_size=4,
            microbatches=2,
            gpu_type=gpu_type,
            schedule=schedule,
            repeats=1,
            warmup=1,
            output=tmp_path / "plan.json",
            progress=False,
        )
        plan = make_plan(request)
        assert plan.n_ranks == 2 and len(plan.stages) >= 2
        assert_trains_like_unsplit(plan, tmp_path, f"{family}, {gpu_type}, {plan.schedule}")
