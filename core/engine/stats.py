"""What an engine counted while it ran: steps, tokens, seconds, captures and the
speculative rounds' acceptance (``--json``'s stats)."""

from __future__ import annotations

from dataclasses import dataclass, field

from graphrt.core.engine.strategy import StepOutcome


@dataclass
class EngineStats:
    eager_steps: int = 0  # target forwards run eagerly (prefills, decode steps, verifies)
    graph_steps: int = 0  # target forwards replayed from a graph
    generated_tokens: int = 0
    elapsed_s: float = 0.0  # in generate(), prefills and lazy compiles included
    capture_time_s: float = 0.0
    lazy_capture_s: float = 0.0  # captures inside generate() (graphs a step first needed)
    compile_time_s: float = 0.0  # lazy compiles inside elapsed_s (CPU `compile` backend)
    # Prefill steps (each emits a request's first token): on a GPU the first one also pays
    # the eager kernels' JIT compiles, seconds that are no measure of decoding.
    prefill_s: float = 0.0
    prefill_tokens: int = 0
    graph_memory_bytes: int = 0
    captured_sizes: list[int] = field(default_factory=list)
    refused_captures: int = 0  # graphs left uncaptured by max_graph_memory_bytes
    step_timing_s: float = 0.0  # start-up steps timing each kind of step (_time_steps)
    # Steps launched behind one not read yet (EngineConfig.overlap), dropped ones included.
    launched_ahead: int = 0
    # Speculative rounds, one per request per verify forward.
    spec_rounds: int = 0
    graph_rounds: int = 0  # request rounds on graphs (the round's one, or draft's and verify's)
    accept_histogram: list[int] = field(default_factory=list)  # [k] = rounds accepting k drafts
    spec_plain_steps: int = 0  # steps a speculative strategy ran without drafting
    rounds_by_steps: dict[int, int] = field(default_factory=dict)  # draft steps -> rounds
    drafted_per_position: list[int] = field(default_factory=list)  # [i] = rounds drafting i + 1

    def record_accept(self, accepted: int, num_steps: int) -> None:
        if len(self.accept_histogram) < num_steps + 1:
            self.accept_histogram += [0] * (num_steps + 1 - len(self.accept_histogram))
            self.drafted_per_position += [0] * (num_steps - len(self.drafted_per_position))
        self.accept_histogram[accepted] += 1
        for i in range(num_steps):
            self.drafted_per_position[i] += 1
        self.rounds_by_steps[num_steps] = self.rounds_by_steps.get(num_steps, 0) + 1
        self.spec_rounds += 1

    def record_step(self, outcome: StepOutcome) -> None:
        self.graph_steps += outcome.graph_forwards
        self.eager_steps += outcome.eager_forwards
        self.graph_rounds += outcome.graph_rounds
        self.spec_plain_steps += outcome.plain_steps
        for log in outcome.rounds or ():
            self.record_accept(len(log.accepted_tokens), log.num_steps)

    @property
    def accepted_per_position(self) -> list[int]:
        """[i] = rounds whose draft at position i + 1 was accepted (vLLM's
        ``spec_decode_num_accepted_tokens_per_pos``); over ``drafted_per_position[i]``,
        the acceptance rate by position."""
        hist = self.accept_histogram
        return [sum(hist[k] for k in range(i + 1, len(hist))) for i in range(len(hist) - 1)]

    @property
    def accept_length_mean(self) -> float:
        """Tokens emitted per verify round: accepted drafts plus the target's bonus token."""
        total = sum((k + 1) * n for k, n in enumerate(self.accept_histogram))
        return total / self.spec_rounds if self.spec_rounds else 0.0

    @property
    def decoding_s(self) -> float:
        """generate()'s time in decode steps and speculative rounds: prefill steps, lazy
        compiles and the captures of graphs a step first needed are not counted."""
        return self.elapsed_s - self.prefill_s - self.compile_time_s - self.lazy_capture_s

    @property
    def decoded_tokens(self) -> int:
        """The tokens decode steps (or speculative rounds) emitted."""
        return self.generated_tokens - self.prefill_tokens

    @property
    def tokens_per_s(self) -> float:
        """Decoding speed: ``decoded_tokens`` over ``decoding_s``."""
        seconds, tokens = self.decoding_s, self.decoded_tokens
        return tokens / seconds if seconds > 0 and tokens > 0 else 0.0
