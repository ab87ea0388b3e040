"""Per-request sampling parameters, validated at admission; the model's defaults for them
(`generation_defaults`)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlmserve.errors import InvalidSamplingParamsError

# A temperature in (0, MIN_TEMPERATURE) is raised to it (as vLLM does): logits divided by a
# smaller one overflow float32 and sampling from them is undefined. 0 means greedy.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 100.0
# a seed is what torch.Generator.manual_seed takes: a signed or an unsigned 64-bit integer
MIN_SEED, MAX_SEED = -(1 << 63), (1 << 64) - 1
# the most log-probabilities a request may ask for per token, besides the sampled one's (as
# vLLM's default max_logprobs and OpenAI's top_logprobs limit)
MAX_LOGPROBS = 20
# the most completions one prompt may ask for (`n`; OpenAI's limit)
MAX_N = 128
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# OpenAI's ranges for presence and frequency penalties and logit biases; vLLM's for the
# repetition penalty
MAX_PENALTY, MAX_BIAS, MAX_REPETITION_PENALTY = 2.0, 100.0, 2.0
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's names; exactly one of them): ``json`` a JSON
    schema (a dict or its JSON text), ``regex`` a regular expression, ``choice`` one of
    these strings, ``grammar`` an EBNF grammar (GBNF: rules ``name ::= ...``, the start rule
    ``root``), ``json_object`` any JSON object. ``disable_any_whitespace``: JSON output
    without whitespace between its tokens (by default any whitespace is allowed there).
    Tokens that would leave the output no way to match are masked out before sampling; the
    end-of-sequence token is allowed only once it matches."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidSamplingParamsError(
                f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}, got "
                f"{', '.join(given) if given else 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise InvalidSamplingParamsError("structured outputs: json must be a JSON schema "
                                             "(an object or its JSON text)")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InvalidSamplingParamsError(
                    f"structured outputs: {name} must be a non-empty string")
        if self.choice is not None and (
                not isinstance(self.choice, list) or not self.choice
                or any(not isinstance(c, str) or not c for c in self.choice)):
            raise InvalidSamplingParamsError(
                "structured outputs: choice must be a non-empty list of non-empty strings")

    @property
    def spec(self) -> tuple[str, str, bool]:
        """(kind, its text, any whitespace): what a grammar is compiled from; a JSON schema
        as canonical JSON text, choices as a JSON list."""
        kind = next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidSamplingParamsError(
                    f"structured outputs: json is not valid JSON: {e}") from None
            except RecursionError:  # deeper than --max-grammar-nesting allows, checked first
                raise InvalidSamplingParamsError(
                    "structured outputs: json is nested too deeply "
                    "(--max-grammar-nesting)") from None
        text = (json.dumps(value, sort_keys=True) if kind in ("json", "choice")
                else "" if kind == "json_object" else value)
        return kind, text, not self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    n (OpenAI's and vLLM's): completions of the prompt, each its own request (`LLM.generate`
    returns them as one `RequestOutput` with n `outputs`; with a seed, the i-th samples with
    seed + i, as the server's `n` and vLLM's). max_tokens None: as many as the context
    length leaves room for. temperature 0 is
    greedy; one in (0, 0.01) is raised to `MIN_TEMPERATURE` (0.01). top_k -1 (or 0) and top_p
    1 switch those filters off (a top_p however small keeps the most likely token). seed: a
    64-bit integer, signed or unsigned.
    logprobs: None (the default) computes none; k in [0, MAX_LOGPROBS] gives each generated
    token a dict {token id: log-probability} of the k most likely tokens and the sampled one
    (k or k + 1 entries, most likely first, the sampled token last if not among them), in
    `CompletionOutput.logprobs`. They are the raw log-probabilities (log_softmax of the
    model's logits before temperature, top-k and top-p: vLLM's default "raw_logprobs").
    prompt_logprobs (vLLM's): None computes none; k in [0, MAX_LOGPROBS] scores every prompt
    token: `RequestOutput.prompt_logprobs` holds None for the first (nothing predicts it) and
    then per token {token id: log-probability} of the k most likely tokens at its position
    and the prompt's own token, and `prompt_logprob_ranks` that token's rank (1: the most
    likely). Such a request computes its whole prompt (it takes nothing from the prefix
    cache), and they come with its first output.
    presence_penalty and frequency_penalty (OpenAI's, in [-2, 2]) subtract from a token's logit
    the penalty once if it was generated before, and the penalty times how often;
    repetition_penalty (vLLM's and transformers', in (0, 2]; 1 is off) divides the positive
    logits and multiplies the negative ones of tokens in the prompt or generated before. All
    three act on the model's logits, before the temperature; then, after it, min_p (in [0, 1])
    drops tokens less likely than min_p times the most likely one, before top-k and top-p.
    logit_bias {token id: bias in [-100, 100]} is added to the logits with the penalties.
    min_tokens (vLLM's): until that many tokens are out, EOS and stop_token_ids cannot be
    sampled and stop strings do not end the request.
    structured_outputs: what the output must match (`StructuredOutputsParams`: a JSON schema,
    a regular expression, a choice, a grammar): the tokens that cannot lead to a match are
    masked out of the logits before the penalties (the log-probabilities see the mask).
    output_kind: "cumulative" reports the whole request so far at every step that gives it
    tokens; "delta" reports only what each such step added (text, token ids, logprobs; with
    stop strings the last len(longest stop) - 1 characters wait for the next output, as a
    stop string found later may still cut them): what the server streams, at a cost per
    token that does not grow with the output; "final_only" reports only the finished
    request (what `LLM.generate` and the server's non-streamed requests ask for).
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: str = "cumulative"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidSamplingParamsError(msg)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_real(v: object) -> bool:
            return is_int(v) or (isinstance(v, float) and math.isfinite(v))

        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            bad(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not is_real(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            bad(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            bad(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed)
                                      or not MIN_SEED <= self.seed <= MAX_SEED):
            bad(f"seed must be a 64-bit integer (in [-2**63, 2**64 - 1]), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not is_int(t) or not 0 <= t < 1 << 31 for t in self.stop_token_ids):
            bad("stop_token_ids must be token ids (non-negative integers below 2**31)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                bad(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_real(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                bad(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        if (not is_real(self.repetition_penalty)
                or not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            bad(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                f"got {self.repetition_penalty!r}")
        if not is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.logit_bias, dict) or any(
                not is_int(t) or t < 0 or not is_real(b) or not -MAX_BIAS <= b <= MAX_BIAS
                for t, b in self.logit_bias.items()):
            bad(f"logit_bias must map token ids (integers >= 0) to biases in "
                f"[-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= (
                self.max_tokens if self.max_tokens is not None else self.min_tokens):
            bad(f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.output_kind not in OUTPUT_KINDS:
            bad(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}")

    def completion(self, i: int) -> SamplingParams:
        """The parameters of completion ``i`` of ``n`` (0 is the first): one completion, and
        with a seed, seed + i (the server's `n` and vLLM's)."""
        seed = None if self.seed is None else self.seed + i
        return dataclasses.replace(self, n=1, seed=seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty depends on the tokens so far (the sampler keeps their counts)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


# what a generation_config.json may set for a request that leaves it unset (vLLM reads the
# same ones), with transformers' own default of each: a file that holds that default has not
# chosen it (transformers writes its defaults out)
_GENERATION_FIELDS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                      "repetition_penalty": 1.0, "max_new_tokens": None}


def generation_defaults(source: str, model_dir: str | Path) -> dict[str, Any]:
    """The default sampling parameters of ``source``: "auto" (``model_dir``'s
    generation_config.json), "vllm" (none), or a folder with a generation_config.json.
    Keys are `SamplingParams` fields (max_new_tokens becomes max_tokens); a value outside
    what `SamplingParams` takes raises a ValueError naming the file."""
    if source == "vllm":
        return {}
    path = Path(model_dir if source == "auto" else source) / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise ValueError(f"generation_config: no generation_config.json in {source}")
        return {}
    with open(path) as f:
        data = json.load(f)
    out = {("max_tokens" if k == "max_new_tokens" else k): data[k]
           for k, default in _GENERATION_FIELDS.items()
           if data.get(k) is not None and data[k] != default}
    try:
        SamplingParams(**out)
    except InvalidSamplingParamsError as e:
        raise ValueError(f"{path}: {e}") from None
    return out

