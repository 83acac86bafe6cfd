"""`MultiDecoder`: a model and its tokenizer, with the user-facing strategies as methods.

Each method runs one strategy from `multidecode.strategies` over a fresh `Engine`; this class
only holds the model, the tokenizer and the compaction policy, and prints nothing. `stream*`
methods yield `TokenEvent`s as tokens are produced; the others return finished results.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from .decoding import CompactionPolicy, PromptsRun, TokenEvent, decode_prompts
from .models import check_supported, load_model_and_tokenizer
from .sampling import per_branch_sampling
from .stopping import eos_ids_of
from .strategies import ask as _ask
from .strategies import complete as _complete
from .strategies import vote as _vote
from .strategies.ask import Answer
from .strategies.beam import Beam
from .strategies.complete import Completion
from .strategies.vote import Vote, extract_answer


class MultiDecoder:
    """A causal LM and its tokenizer, decoded as forests over one shared KV cache.

    model: any transformers causal LM loaded with eager or sdpa attention.
    compaction: when to drop finished branches from the cache (default: a quarter of it dead).
    """

    def __init__(self, model, tokenizer, *, compaction: CompactionPolicy | None = None) -> None:
        check_supported(model)
        self.model = model
        self.tokenizer = tokenizer
        self.compaction = compaction or CompactionPolicy()

    @property
    def eos_ids(self) -> frozenset[int]:
        return eos_ids_of(self.model, None)

    # ------------------------------------------------------------------ token level
    def start(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, stop: Sequence[str] = (),
              eos_token_id=None, **sampling) -> PromptsRun:
        """Start decoding whole prompts (token ids) as one forest; iterate `.events` to decode.

        eos_token_id: the ids that end a branch (default: the model's; [] never stops early).
        """
        return decode_prompts(self.model, prompts, max_new_tokens=max_new_tokens,
                              sampling=per_branch_sampling(len(prompts), sampling), tokenizer=self.tokenizer,
                              stop=stop, eos_token_id=eos_token_id, compaction=self.compaction)

    # ------------------------------------------------------------------ many questions, one document
    def question_prompts(self, document: str, questions: Sequence[str], *, instruction: str | None = None):
        """The whole prompt ids each question would be asked with alone."""
        return _ask.question_prompts(self.tokenizer, document, questions, instruction=instruction)

    def ask(self, document: str, questions: Sequence[str], *, max_new_tokens: int = 48, stop: Sequence[str] = (),
            instruction: str | None = None, **sampling) -> list[Answer]:
        """Answer every question about `document` in one MultiDecode pass.

        Greedy by default; each answer equals greedy generation from its `.prompt_ids` alone.
        Sampling settings (`do_sample`, `temperature`, `top_k`, `top_p`, `min_p`,
        `repetition_penalty`, `seed`) take one value or one per question.
        """
        return _ask.ask(self, document, questions, max_new_tokens=max_new_tokens, stop=stop,
                        instruction=instruction, **sampling)

    def stream(self, document: str, questions: Sequence[str], *, max_new_tokens: int = 48,
               stop: Sequence[str] = (), instruction: str | None = None, **sampling) -> Iterator[TokenEvent]:
        """`TokenEvent`s (branch = question index) as `ask` answers; inputs are checked and the
        prompts prefilled before this returns."""
        return _ask.stream(self, document, questions, max_new_tokens=max_new_tokens, stop=stop,
                           instruction=instruction, **sampling)

    # ------------------------------------------------------------------ parallel completions
    def complete(self, prompt: str | Sequence[int], *, n: int = 1, max_new_tokens: int = 64,
                 stop: Sequence[str] = (), chat: bool | None = None, **sampling) -> list[Completion]:
        """n completions of one prompt from one prefill, sampled by default.

        Sampling settings take one value or a list of n. With `seed=s`, completion i uses seed
        s + i and equals `complete(prompt, n=1, seed=s + i)`; without one, a random base seed is
        drawn and each `Completion.seed` says how to reproduce it. Text prompts go through the
        chat template when the tokenizer has one (chat=False for raw text); ids are used as given.
        """
        return _complete.complete(self, prompt, n=n, max_new_tokens=max_new_tokens, stop=stop, chat=chat,
                                  **sampling)

    def stream_complete(self, prompt: str | Sequence[int], *, n: int = 1, max_new_tokens: int = 64,
                        stop: Sequence[str] = (), chat: bool | None = None, **sampling) -> Iterator[TokenEvent]:
        """`TokenEvent`s (branch = completion index) as `complete` generates."""
        return _complete.stream(self, prompt, n=n, max_new_tokens=max_new_tokens, stop=stop, chat=chat, **sampling)

    # ------------------------------------------------------------------ self-consistency
    def vote(self, question: str, *, n: int = 8, max_new_tokens: int = 256,
             extract: Callable[[str], str | None] = extract_answer, **sampling) -> Vote:
        """n sampled reasoning traces in one forest, an answer extracted from each, and the majority."""
        return _vote.vote(self, question, n=n, max_new_tokens=max_new_tokens, extract=extract, **sampling)

    # ------------------------------------------------------------------ beam search
    def beam_search(self, prompt: str | Sequence[int], *, num_beams: int, max_new_tokens: int,
                    length_penalty: float = 1.0, early_stopping: bool | str = False,
                    num_return_sequences: int = 1, chat: bool | None = None) -> list[Beam]:
        """Beam search with beams as branches of one tree, best first; sequences equal transformers'
        `generate(num_beams=...)` and scores equal its `sequences_scores` to float32 rounding.
        num_beams=1 is greedy search, as in transformers."""
        from .strategies.beam import beam_search

        return beam_search(self, prompt, num_beams=num_beams, max_new_tokens=max_new_tokens,
                           length_penalty=length_penalty, early_stopping=early_stopping,
                           num_return_sequences=num_return_sequences, chat=chat)

    # ------------------------------------------------------------------ writing in the margins
    def margins(self, document: str | Sequence[str], question: str, *, chunk_tokens: int = 300, **settings):
        """Writing in the margins: a note per chunk (all in one pass), relevance, then the answer."""
        from .strategies.margins import margins

        return margins(self, document, question, chunk_tokens=chunk_tokens, **settings)


def load(model: str | None = None, *, dtype=None, device=None) -> MultiDecoder:
    """Load a model by name (nothing for the embedded SmolLM2-135M-Instruct) as a `MultiDecoder`.

    model: None, a local Hugging Face folder, a local .gguf file, or a hub id.
    dtype: float32 (default), bfloat16 or float16; device: "cpu", "cuda", ... (default: cuda if any).
    """
    lm, tokenizer = load_model_and_tokenizer(model, dtype=dtype, device=device)
    return MultiDecoder(lm, tokenizer)
