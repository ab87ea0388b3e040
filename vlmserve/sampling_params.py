"""Per-request sampling parameters, validated at admission."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmserve.errors import InvalidSamplingParamsError


@dataclass
class SamplingParams:
    """How to pick each output token and when to stop.

    temperature 0 is greedy; top_k -1 (or 0) and top_p 1 switch those filters off.
    output_kind: "cumulative" reports the request at every step that gives it tokens (for
    streaming); "final_only" only when it finishes (what `LLM.generate` asks for).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidSamplingParamsError(msg)

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            bad(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            bad(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.output_kind not in ("cumulative", "final_only"):
            bad(f"output_kind must be 'cumulative' or 'final_only', got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
