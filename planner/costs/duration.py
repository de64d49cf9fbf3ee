"""How long measuring the costs will take, said before it starts.

A measured profile runs every block forward and backward ``warmup + repeats`` times, again with the
input and weight gradients apart (the zero-bubble schedules' I and W), the whole model as one stage
(``planner.costs.context``), the optimizer step per block, and, when the search tries other
microbatch sizes, the whole model at a second size (``planner.costs.scaling``). On a laptop's CPU one
forward of a real-size model takes seconds to tens of seconds (GPT-2 small, 124 M parameters, 8
sequences of 1,024 tokens: about 40 s on 2 cores), so the profile takes many minutes, and its bar
showed that only once the first blocks were done. ``profile_seconds`` predicts it from the one forward
``planner plan`` runs anyway to check the model file; ``duration_advice`` is the line said up front,
with the quicker choices and what each gives up.

The factors are forwards' worth of work, fitted on this project's 2-core CPU machine to profiles of
GPT-2 (4 layers, width 768, 256 tokens: 97 forwards at 1 timed run + 2 warm-ups, 170 at 5 + 2) and
checked on GPT-2 small (12 layers, 1,024 tokens, 1 timed run: 338 s measured, 423 s predicted); they make the prediction
right within a factor of about 1.5, which is what a user deciding whether to wait needs.
"""

from __future__ import annotations

# The block profile and the whole-model timing, in forwards of the whole model: a fixed part (the
# optimizer step and gradient passes per block, set-up) and a part per warm-up or timed run (forward,
# backward, the I-only backward with its own forward, the whole model as one stage).
PROFILE_FIXED_FORWARDS = 40.0
PROFILE_FORWARDS = 18.0
# Per run of the size fit (warm-up + max(3, repeats)): forward and backward at the profiled size and
# at half of it.
SCALING_FORWARDS = 4.5
# A profile predicted to take this long or longer is said up front, with the quicker choices.
LONG_S = 60.0


def profile_seconds(forward_s: float, warmup: int, repeats: int, fits_sizes: bool) -> float:
    """The predicted wall time of a measured profile.

    Args:
        forward_s: one forward of the whole model on one microbatch, seconds (no gradients).
        warmup: untimed runs per block.
        repeats: timed runs per block.
        fits_sizes: whether the search tries other microbatch sizes (then the whole model is also
            timed at a second size).

    Returns:
        Seconds.
    """
    seconds = forward_s * (PROFILE_FIXED_FORWARDS + PROFILE_FORWARDS * (warmup + repeats))
    if fits_sizes:
        seconds += forward_s * SCALING_FORWARDS * (warmup + max(3, repeats))
    return seconds


def duration_advice(
    forward_s: float,
    *,
    warmup: int,
    repeats: int,
    fits_sizes: bool,
    n_blocks: int,
    microbatch_size: int,
    device: str,
) -> str | None:
    """The line said before a long measured profile starts, or None when it will be short.

    Args:
        forward_s: one forward of the whole model on one microbatch, seconds.
        warmup: untimed runs per block (``--warmup``).
        repeats: timed runs per block (``--repeats``).
        fits_sizes: as ``profile_seconds``.
        n_blocks: the blocks to profile.
        microbatch_size: samples per microbatch, the size profiled.
        device: where it runs ("cpu", "cuda:0").

    Returns:
        e.g. "measuring 14 blocks on the cpu will take about 18 min (one forward of a microbatch of 8
        took 41.3 s); quicker: ...", or None under ``LONG_S``.
    """
    seconds = profile_seconds(forward_s, warmup, repeats, fits_sizes)
    if seconds < LONG_S:
        return None
    choices = ["--gpu-type cpu (seconds: costs estimated from each operator's FLOPs and bytes, not measured)"]
    if repeats > 1:
        fewer = profile_seconds(forward_s, warmup, 1, fits_sizes)
        choices.append(f"--repeats 1 (about {_minutes(fewer)}: noisier times)")
    if microbatch_size > 1:
        one = profile_seconds(forward_s / microbatch_size, warmup, repeats, fits_sizes)
        choices.append(
            f"more --microbatches or a smaller -b (about {_minutes(one)} at 1 sample per microbatch: the costs "
            "at the size the search picks are scaled from the profiled one)"
        )
    samples = "sample" if microbatch_size == 1 else "samples"
    return (
        f"measuring {n_blocks} blocks on the {device} will take about {_minutes(seconds)} (one forward of a "
        f"microbatch of {microbatch_size} {samples} took {forward_s:.1f} s); quicker: {'; '.join(choices)}"
    )


def _minutes(seconds: float) -> str:
    """A duration as a person reads it: "40 s", "3 min", "1.5 h"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["LONG_S", "duration_advice", "profile_seconds"]
