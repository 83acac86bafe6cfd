"""The names of the sampling settings, apart from `sampling` (which imports torch), so that a
command can read them before torch loads (`multidecode generate --server` decides greedy or
sampled with them, as `sampling.per_branch_sampling` does)."""

from numbers import Real

SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "seed")
"""Every setting `sampling.per_branch_sampling` takes."""
SAMPLING_SWITCHES = ("temperature", "top_k", "top_p", "min_p", "seed")
"""Settings that turn sampling on where `do_sample` is not given; the rest (penalties, bias) change
greedy branches' logits too and never turn sampling on by themselves."""
TINIEST_TEMPERATURE = 1e-30
"""The smallest temperature taken: logits (at most about 1e4 in size) divided by it stay finite in
float32 (below float32's smallest normal number, 1.2e-38, they reach infinity and the draw fails)."""


def divides_logits(temperature: float) -> bool:
    """Whether float32 logits can be divided by `temperature` and still give a distribution: from
    `TINIEST_TEMPERATURE` to a finite number (the library's, the server's and the command's rule)."""
    return TINIEST_TEMPERATURE <= temperature < float("inf")


def greedy_temperature(value) -> bool:
    """Whether a temperature asks for greedy decoding: 0, as OpenAI's API reads it (whatever else
    is given, `do_sample` too)."""
    return isinstance(value, Real) and not isinstance(value, bool) and value == 0


def switches_given(settings: dict) -> list[str]:
    """The `SAMPLING_SWITCHES` that `settings` (one value each) give and that ask for sampling:
    top_k 0 is off and temperature 0 greedy, so neither does."""
    return [key for key in SAMPLING_SWITCHES if settings.get(key) is not None
            and not (key == "top_k" and settings[key] == 0) and not (key == "temperature" and greedy_temperature(settings[key]))]


__all__ = ["SAMPLING_KEYS", "SAMPLING_SWITCHES", "TINIEST_TEMPERATURE", "divides_logits", "greedy_temperature", "switches_given"]
