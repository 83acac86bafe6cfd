"""Structured output: each branch's tokens held to a JSON schema, a regular expression or a grammar.

Terms. A **constraint** (`Constraint`) is what a user asks for: a JSON schema, any JSON object, a
regular expression, or a grammar (Lark, or llama.cpp's GBNF). It is **compiled** once per
(tokenizer, constraint) by llguidance (the Guidance project's Rust engine; why this one, with the
measurements, in docs/structured.md) into a **matcher** at the grammar's start (`Compiled`). Each
constrained branch holds its own copy of it, a `GrammarState`, which follows the branch's tokens
(`sampling.BranchSampler.observe`) and says which tokens may come next: the branch's **mask**.

Decoding. The masks of every constrained row are filled row by row on the calling thread (a
parallel fill measured slower here) and applied in one `torch.where` (`mask_logits`), after the
repetition penalty and before temperature, top-k, top-p and min-p, so a constrained branch draws
from the model's distribution renormalised over the tokens its grammar allows. When the grammar is complete only
the eos token is allowed (finish reason "stop"); a branch that reaches max_new_tokens first ends
with "length" and what it produced. The reference this equals, token for token (greedy) and in
distribution (sampling), is the plain loop: the model on the whole sequence, mask, choose.

Speculation. `prune` takes every draft node the grammar forbids (and its subtree) out of a draft
tree before it is fed, walking the tree with `validate_tokens` (no state changes). Where the
grammar forces the next tokens (a key name, a closing brace), `forced` gives them (llguidance's
fast-forward tokens: SGLang's *jump-forward*); they are drafted as a chain of certain nodes under
the branch's head (`with_forced`) and verified in the same forward as any draft, so the target
still chooses every token through its mask and the output is unchanged (a model may pick another
tokenization of the forced text, and then it does).
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import InvalidArgument, InvalidInput, check_flag

if TYPE_CHECKING:
    import torch

KINDS = ("json_schema", "json_object", "regex", "grammar")
FORCED = -7
"""`DraftTree.kinds` value of a jump-forward node (a token the grammar forces)."""
FORCED_LIMIT = 32
"""At most this many forced tokens are drafted in one step."""
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How JSON is laid out unless a schema's own "x-guidance" says otherwise: one line, with the
separators of Python's json.dumps (what models write most), so the separators are forced tokens
and a small model cannot wander off into whitespace until max_new_tokens."""
COMPILED_PER_TOKENIZER = 64
"""Compiled constraints kept per tokenizer (least recently used dropped first)."""


def _llguidance():
    import llguidance
    import llguidance.hf
    import llguidance.torch

    return llguidance


@dataclass(frozen=True)
class Constraint:
    """What one branch's output must match. kind: one of `KINDS`; text: the JSON schema (as JSON
    text), the regular expression or the grammar (Lark or GBNF); strict: for a JSON schema, refuse
    keywords llguidance cannot enforce (False: ignore them, best effort); jump_forward: draft the
    tokens the grammar forces (never changes the output; False to measure without it).

    Build one with `json_schema`, `json_object`, `regex` or `grammar`; each is checked when made
    (`InvalidArgument` for a schema, regex or grammar the engine cannot compile)."""

    kind: str
    text: str
    strict: bool = True
    jump_forward: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"unknown constraint kind {self.kind!r}", f"use one of {', '.join(KINDS)}")
        if not isinstance(self.text, str):
            raise InvalidArgument(f"a {self.kind} constraint needs text, got {type(self.text).__name__}")
        llg = _llguidance()
        failed, messages = llg.LLMatcher.validate_grammar_with_warnings(self.compiled_text, None)
        if failed:
            raise self.refusal("cannot be compiled", _first_line(messages))

    @classmethod
    def json_schema(cls, schema: dict | bool | str, *, strict: bool = True, jump_forward: bool = True) -> Constraint:
        """Output that parses as JSON and validates against `schema` (a dict, a boolean schema or
        JSON text; see `read_schema`)."""
        check_flag("strict", strict)
        check_flag("jump_forward", jump_forward)
        return cls("json_schema", _schema_json(read_schema(schema)), strict, jump_forward)

    @classmethod
    def json_object(cls, *, jump_forward: bool = True) -> Constraint:
        """Output that parses as one JSON object, of any shape (OpenAI's {"type": "json_object"})."""
        return cls("json_object", '{"type": "object"}', True, jump_forward)

    @classmethod
    def regex(cls, pattern: str, *, jump_forward: bool = True) -> Constraint:
        r"""Output that matches `pattern` whole (Rust regex syntax: no look-around, no back-references;
        `\d` is an ASCII digit, see `ascii_digits`)."""
        if not isinstance(pattern, str) or not pattern:
            raise InvalidArgument(f"a regular expression must be a non-empty string, got {pattern!r}", _HINTS["regex"])
        if (len(pattern) - len(pattern.rstrip("\\"))) % 2:  # llguidance would drop it silently: "a\\" as "a"
            raise InvalidArgument(f"the regular expression {pattern!r} ends in a lone backslash",
                                  "escape it (\\\\ for a backslash) or remove it")
        return cls("regex", pattern, True, jump_forward)

    @classmethod
    def grammar(cls, text: str, *, jump_forward: bool = True) -> Constraint:
        """Output that the grammar `text` (Lark, or llama.cpp's GBNF with `root ::= ...`) derives."""
        if not isinstance(text, str) or not text.strip():
            raise InvalidArgument("the grammar is empty" if isinstance(text, str) else
                                  f"a grammar must be text, got {type(text).__name__}", _HINTS["grammar"])
        return cls("grammar", text, True, jump_forward)

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    @property
    def description(self) -> str:
        return {"json_schema": "JSON schema", "json_object": "JSON object constraint",
                "regex": "regular expression", "grammar": "grammar"}[self.kind]

    @functools.cached_property
    def compiled_text(self) -> str:
        """The constraint as an llguidance grammar (what a matcher is built from). llguidance
        raises a plain ValueError for what it cannot read (a schema nested 64 levels deep, a
        number beyond a double's range, a lone surrogate, NaN in JSON text, a GBNF rule that is
        not there): every one becomes the `InvalidArgument` that every caller (Python, the
        command line, the server's 400, a batch line's error) already turns into its refusal."""
        llg = _llguidance()
        try:
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(ascii_digits(self.text))
            if self.kind == "grammar":
                return llg.grammar_from("grammar", self.text)
            options = {**JSON_DEFAULTS, "lenient": not self.strict}
            return llg.LLMatcher.grammar_from_json_schema(self.text, defaults=options)
        except ValueError as error:
            raise self.refusal("cannot be read", str(error)) from None

    def refusal(self, what: str, reason: str) -> InvalidArgument:
        """The error for a constraint the engine refuses (`what`: "cannot be compiled", say), with
        llguidance's `reason` and the hint that fits it (`hint_for`)."""
        reason = _ENGINE_POSITION.sub("", reason.strip()) or "unknown error"
        return InvalidArgument(f"the {self.description} {what}: {reason}", hint_for(self.kind, reason))

    def parse(self, text: str):
        """The JSON value of a JSON constraint's output (None when it does not parse: cut short,
        say, or not a JSON constraint)."""
        if not self.is_json:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return None


_HINTS = {
    "json_schema": "give a JSON Schema object, e.g. {\"type\": \"object\", \"properties\": {...}}",
    "json_object": "",
    "regex": "use Rust regex syntax (no look-around or back-references)",
    "grammar": "give a Lark grammar (start: ...) or a GBNF grammar (root ::= ...)",
}
BEST_EFFORT_HINT = ('leave those keywords out, or ask for best effort (Constraint.json_schema(schema, strict=False) '
                    'in Python; "strict": false on the server; --no-strict on the command line)')
"""The fix for a schema keyword the engine cannot enforce; a batch line words it for its own field."""
_DEEP_HINT = ('nest it less deeply (about 60 levels at most): define a part that repeats once in "$defs" and '
              'refer to it with "$ref"')
_SURROGATE_HINT = r"remove the lone surrogate (\ud800 to \udfff without its pair) from its strings"
_SCHEMA_HINTS = (
    (("Unimplemented keys", "Unknown format"), BEST_EFFORT_HINT),
    (("anyOf is empty",), 'give "enum" (or "anyOf", "oneOf") at least one choice'),
    (("decimal literal invalid",), 'keep "minLength", "maxLength" and a pattern\'s repetition counts below 2**32'),
    (("regex parse error", "look-around"), 'fix its "pattern": Rust regex syntax (no look-around or back-references)'),
    (("too big",), 'make it smaller: fewer or shorter "enum" values, fewer properties or alternatives'),
    (("multiple of",), 'give "multipleOf" a number above 0'),
    (("required property",), ('check each required property: some value must satisfy its schema, and where '
                             '"additionalProperties" is false it needs its own entry in "properties"')),
    (("incompatible types",), 'give the parts of "allOf" (or a "type" list and "enum") types that overlap'),
    (("Unsatisfiable",), "loosen the bounds (minLength/maxLength, minItems/maxItems, minimum/maximum...)"),
    (("recursion limit",), _DEEP_HINT),
    (("number out of range",), "keep its numbers within a double's range (up to about 1.8e308)"),
    (("surrogate", "hex escape"), _SURROGATE_HINT),
)
"""(words in llguidance's reason, the fix) for a JSON schema it refuses; the first that matches
wins, and a reason none matches gets the general hint. A schema's problems have different fixes,
and a hint that says "give a JSON Schema object" to one that is one helps nobody."""
_ENGINE_POSITION = re.compile(r"\s+at line \d+ column \d+$|^at \d+\(\d+\): invalid regex \".*\" \(in regex\): ")
"""Where llguidance stopped, in the text we wrote (the JSON of a schema; a regex as a one-rule
grammar, `\\d` rewritten as `[0-9]`), not the user's: no help to a user, so left out of the message."""


def read_schema(schema: dict | bool | str) -> dict:
    """A JSON schema as a dict, from a dict, JSON text or a boolean schema (JSON Schema's `true`
    is any value, `{}`; `false` is none, refused), refused with the fix when it is not one. Torch-
    free: a command sending its work to a server checks its schema here before sending it."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise InvalidArgument(f"the JSON schema is not valid JSON: {error}", _HINTS["json_schema"]) from None
        except RecursionError:
            raise InvalidArgument("the JSON schema is nested too deeply to read", _DEEP_HINT) from None
    if schema is True:
        return {}
    if schema is False:
        raise InvalidArgument("the JSON schema is false, which no value satisfies",
                              "give true or {} for any JSON value, or a schema object")
    if not isinstance(schema, dict):
        raise InvalidArgument(f"a JSON schema must be a JSON object, got {type(schema).__name__}",
                              _HINTS["json_schema"])
    return schema


def hint_for(kind: str, reason: str) -> str:
    """The hint for a `kind` constraint that llguidance refused for `reason`."""
    if kind == "json_schema":
        for words, hint in _SCHEMA_HINTS:
            if any(word in reason for word in words):
                return hint
    return _HINTS[kind]


def parsed_field(constraint: Constraint | None, result) -> dict:
    """{"parsed": a result's JSON value} where a JSON constraint held it (null where it did not
    match it whole: `Completion.parsed`, `Answer.parsed`, `Trace.parsed`), else nothing: the field
    a command's --json output and a batch record carry."""
    return {"parsed": result.parsed} if constraint is not None and constraint.is_json else {}


def _schema_json(schema: dict) -> str:
    r"""`schema` as the JSON text llguidance reads, refused here for what JSON cannot carry:
    NaN and Infinity (Python's json reads and writes them; 1e400 in JSON text reads as Infinity),
    a lone surrogate ("\ud800": Python strings may hold one, UTF-8 cannot), a value that is not
    JSON (a set, say), a dict inside itself, or nesting deeper than Python can walk."""
    try:
        text = json.dumps(schema, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")  # a lone surrogate cannot be UTF-8
    except UnicodeEncodeError as error:
        raise InvalidArgument(f"the JSON schema holds a lone surrogate ({error.object[error.start]!a}) in a string",
                              _SURROGATE_HINT) from None
    except ValueError as error:
        if "Circular reference" in str(error):
            raise InvalidArgument("the JSON schema holds itself (a dict inside itself)",
                                  'for a schema that recurses, define it in "$defs" and refer to it with "$ref"') from None
        raise InvalidArgument("the JSON schema holds NaN or Infinity (or a number beyond a double's range, "
                              "such as 1e400, which reads as Infinity): JSON has no such number",
                              "write a finite number, or leave that keyword out") from None
    except TypeError as error:
        raise InvalidArgument(f"the JSON schema holds a value JSON cannot carry ({error})",
                              "use only dicts, lists, strings, numbers, booleans and None") from None
    except RecursionError:
        raise InvalidArgument("the JSON schema is nested too deeply to read", _DEEP_HINT) from None
    return text


_ASCII_DIGIT_CLASSES = {"d": "[0-9]", "D": "[^0-9]"}


def ascii_digits(pattern: str) -> str:
    r"""`pattern` with `\d` as `[0-9]` and `\D` as `[^0-9]`: what a regular expression constraint
    compiles. In Rust's regex syntax, which llguidance reads, `\d` is any Unicode decimal digit
    (Arabic-Indic, fullwidth, U+1FBF0-U+1FBF9...), and a small model does write them (the embedded
    one answered `\d{3}` with U+1FBF8 three times); users mean 0-9, as in vLLM, outlines and JSON
    Schema's `pattern` (which llguidance already reads so). The engine has no flag for it:
    `(?-u:\d)` is ASCII, but `(?-u:\D)` could match a byte of invalid UTF-8, which it refuses.
    So the two escapes are rewritten, each escape read whole (`\\d` is a backslash and a "d", left
    as it is); a class may stand inside a class, since Rust nests them (`[a\d]` becomes
    `[a[0-9]]`, `[^\D]` `[^[^0-9]]`). `\p{Nd}` still asks for any Unicode digit."""
    return re.sub(r"\\(.)", lambda escape: _ASCII_DIGIT_CLASSES.get(escape[1], escape[0]), pattern, flags=re.DOTALL)


def _first_line(messages: Sequence[str]) -> str:
    """llguidance's message in one line: its first line and the lines that name the error."""
    lines = [line.strip() for m in messages for line in m.splitlines() if line.strip()]
    if not lines:
        return "unknown error"
    said = [lines[0].rstrip(":")] + [line for line in lines[1:] if line.startswith("error:")]
    return "; ".join(said)[:300]


def constraint_of(constraint=None, *, json_schema=None, regex: str | None = None, grammar: str | None = None):
    """The one constraint a call names, by `constraint=` (a `Constraint`) or by one of the
    keywords (`json_schema=` a dict or JSON text, `regex=`, `grammar=`); None when none is
    given. Each of them may also be a list (one per branch, None for a free one): the list of
    `Constraint | None` then comes back."""
    given = {k: v for k, v in dict(constraint=constraint, json_schema=json_schema, regex=regex,
                                    grammar=grammar).items() if v is not None}
    if len(given) > 1:
        raise InvalidArgument(f"{' and '.join(given)} were both given", "constrain a branch one way at a time")
    if not given:
        return None
    (key, value), = given.items()
    if isinstance(value, list):
        return [None if v is None else _one(key, v) for v in value]
    return _one(key, value)


def _one(key: str, value) -> Constraint:
    if isinstance(value, Constraint):
        return value
    if key == "constraint":
        raise InvalidArgument(f"constraint must be a multidecode Constraint, got {type(value).__name__}",
                              "build one with Constraint.json_schema, .json_object, .regex or .grammar")
    return {"json_schema": Constraint.json_schema, "regex": Constraint.regex, "grammar": Constraint.grammar}[key](value)


def per_branch(n: int, constraint) -> list[Constraint | None]:
    """A constraint for all n branches, or a list of one per branch (`Constraint` or None)."""
    if isinstance(constraint, (list, tuple)):
        if len(constraint) != n:
            raise InvalidInput(f"{len(constraint)} constraints for {n} branches (a branch is a question of ask, a "
                               "completion of complete)", "give one for all, or a list of one per branch")
        items = list(constraint)
    else:
        items = [constraint] * n
    for item in items:
        if item is not None and not isinstance(item, Constraint):
            raise InvalidArgument(f"a constraint must be a multidecode Constraint, got {type(item).__name__}",
                                  "build one with Constraint.json_schema, .json_object, .regex or .grammar")
    return items


# ---------------------------------------------------------------------- compiling
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""tokenizer -> {(vocab, eos): (llguidance tokenizer, LRU of compiled constraints), "bytes": the
reading `token_bytes_reader` gives}: building an llguidance tokenizer takes up to a second,
compiling a schema a few milliseconds."""


@dataclass(frozen=True)
class Compiled:
    """A constraint compiled for one tokenizer and vocabulary: its matcher at the start, which
    every branch constrained by it copies (`start`)."""

    constraint: Constraint
    matcher: object  # llguidance.LLMatcher, never advanced
    vocab_size: int
    eos_id: int

    def start(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy(), self)


def compile_constraint(constraint: Constraint, tokenizer, *, vocab_size: int, eos_id: int) -> Compiled:
    """`constraint` for `tokenizer` (a Hugging Face fast tokenizer) over logits `vocab_size` wide,
    `eos_id` the one token allowed once the grammar is complete; compiled once and kept.
    Raises `InvalidArgument` when it cannot be compiled for this tokenizer."""
    lltok, compiled = _tokenizer_entry(tokenizer, vocab_size, eos_id)
    if constraint in compiled:
        compiled.move_to_end(constraint)
        return compiled[constraint]
    llg = _llguidance()
    matcher = llg.LLMatcher(lltok, constraint.compiled_text, log_level=0)
    if matcher.is_error():
        raise constraint.refusal("cannot be compiled for this tokenizer", _first_line([matcher.get_error()]))
    _check_start(constraint, matcher)
    compiled[constraint] = result = Compiled(constraint, matcher, vocab_size, eos_id)
    while len(compiled) > COMPILED_PER_TOKENIZER:
        compiled.popitem(last=False)
    return result


def _per_tokenizer(tokenizer) -> dict:
    """What is kept for `tokenizer` (see `_TOKENIZERS`)."""
    try:
        return _TOKENIZERS.setdefault(tokenizer, {})
    except TypeError:  # not weakly referable or not hashable: built every time
        return {}


def token_bytes_reader(tokenizer):
    """llguidance's reading of `tokenizer`, which knows each token's own bytes whatever the
    tokenizer's way of writing them (byte-level BPE, byte fallback): `.decode_bytes([id])`.
    Built once per tokenizer; None for one it cannot read (not a Hugging Face fast tokenizer)."""
    per = _per_tokenizer(tokenizer)
    if "bytes" not in per:
        try:
            per["bytes"] = _llguidance().hf.from_tokenizer(tokenizer)
        except (ValueError, TypeError, AttributeError):
            per["bytes"] = None
    return per["bytes"]


def _tokenizer_entry(tokenizer, vocab_size: int, eos_id: int):
    llg = _llguidance()
    per = _per_tokenizer(tokenizer)
    key = (vocab_size, eos_id)
    if key not in per:
        try:
            lltok = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_id)
        except ValueError as error:
            raise InvalidArgument(f"constrained decoding needs a Hugging Face fast tokenizer ({error})",
                                  "load the model with its tokenizer.json") from None
        per[key] = (lltok, OrderedDict())
    return per[key]


def compile_for_branches(constraints: Sequence[Constraint | None], tokenizer, *, vocab_size: int,
                         eos_ids) -> list[Compiled | None]:
    """Each branch's constraint compiled (one compile per distinct constraint); refused before
    any decoding when there is none to end on: a constrained branch needs an eos token."""
    if not any(c is not None for c in constraints):
        return [None] * len(constraints)
    if tokenizer is None:
        raise InvalidArgument("a constraint needs the model's tokenizer", "pass tokenizer= (a Hugging Face tokenizer)")
    eos_id = primary_eos(tokenizer, eos_ids)
    return [None if c is None else compile_constraint(c, tokenizer, vocab_size=vocab_size, eos_id=eos_id)
            for c in constraints]


def primary_eos(tokenizer, eos_ids) -> int:
    """The eos token a complete grammar allows: the tokenizer's own when it ends a branch, else
    the lowest of the branch's eos ids."""
    if not eos_ids:
        raise InvalidArgument("a constrained branch needs an end-of-sequence token to end on",
                              "leave eos_token_id unset (the model's) or give one")
    own = getattr(tokenizer, "eos_token_id", None)
    return own if own in eos_ids else min(eos_ids)


def _check_start(constraint: Constraint, matcher) -> None:
    """Refuse, on a copy of a fresh matcher, what would fail at the first step:
    - a language that is empty (`[a&&b]`, a rule that only derives itself first): llguidance finds
      it only when it first computes a mask, and then allows the eos token alone, so the branch
      would end at once with an empty output that does not match;
    - text forced from the start that the parser gives up on: a rule that always calls itself again
      at its end (`root ::= "a" root`, a schema whose required property is itself) forces "aaa..."
      without end, and llguidance's parser runs out of items within the first step's forced
      tokens (a traceback, before this check, and in a batch an "unexpected" error per line)."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise InvalidArgument(f"the {constraint.description} matches no text at all, so no output can satisfy it",
                              _NOTHING_HINTS[constraint.kind])
    probe.consume_tokens(probe.compute_ff_tokens()[:FORCED_LIMIT])
    if probe.is_error():
        raise _gave_up(constraint, probe)


def _gave_up(constraint: Constraint, matcher) -> InvalidArgument:
    """The error for a matcher llguidance stopped following (its parser's or lexer's limits), with
    its reason, and the cause and fix that reason points to (`_GAVE_UP`)."""
    reason = _first_line([matcher.get_error() or "no reason given"])
    cause, hint = next(((cause, hint) for words, cause, hint in _GAVE_UP if any(w in reason for w in words)),
                        (None, "simplify the part of it the reason names"))
    return InvalidArgument(f"the {constraint.description} cannot be followed: the engine gave up on it ({reason})"
                           + (f"; {cause}" if cause else ""), hint)


_GAVE_UP = (
    (("Too many items",),
     ("a rule that always calls itself again at its end (root ::= \"a\" root), or a schema that requires itself, "
      "forces text without end"),
     "give the recursion a way to end: an alternative without it, or an optional property"),
    (("too many expressions",),
     "a regular expression (or a schema's pattern or length bounds) too large for its lexer",
     "make it smaller: fewer or lower repetition counts ((a{1000}){1000} is a million)"),
    (("forced bytes",),
     ("it spells out a special token's text (such as <|im_end|>): the tokenizer reads that text as the one special "
      "token, which the grammar cannot take"),
     "leave special tokens' text out of the constraint (a branch ends with its eos token by itself)"),
)
"""(words in llguidance's reason, what causes it, the fix) for a constraint the engine gives up on;
the first that matches wins, and a reason none matches is given with a general fix."""


_NOTHING_HINTS = {
    "json_schema": "loosen the schema so that some value satisfies it",
    "json_object": "",
    "regex": "check its character classes and repetitions: an intersection such as [a&&b] or a class such as "
             "[^\\s\\S] matches no character",
    "grammar": "check that every rule can end: a rule that only refers to itself (a: a \"x\") derives no text",
}


# ---------------------------------------------------------------------- one branch
class GrammarState:
    """One branch's matcher: where its tokens have taken the grammar."""

    def __init__(self, matcher, compiled: Compiled) -> None:
        self.matcher = matcher
        self.compiled = compiled

    @property
    def jump_forward(self) -> bool:
        return self.compiled.constraint.jump_forward

    def consume(self, token: int) -> None:
        """Advance past a chosen token (chosen through this branch's mask, so always allowed)."""
        if not self.matcher.consume_token(token):
            if self.matcher.is_error():  # the parser gave up (its limits), before or at this token
                raise _gave_up(self.compiled.constraint, self.matcher)
            raise RuntimeError(f"token {token} was chosen against its grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Whether the grammar is complete: only the eos token may follow."""
        return self.matcher.is_stopped()

    @property
    def matched(self) -> bool:
        """Whether the tokens consumed are a whole match: the grammar complete (ended by its eos
        where it could end, or with nothing left to add), and not stopped by an error. A branch cut
        at max_new_tokens where it could still go on ("100" for an integer) has not matched."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (no state change)."""
        return self.matcher.validate_tokens(list(tokens))

    def forced(self, limit: int = FORCED_LIMIT) -> list[int]:
        """The tokens the grammar forces next (possibly none), at most `limit`."""
        if limit < 1 or self.complete:
            return []
        forced = self.matcher.compute_ff_tokens()[:limit]
        if self.matcher.is_error():
            raise _gave_up(self.compiled.constraint, self.matcher)
        return forced


def mask_logits(scores: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """Forbidden tokens of every constrained row set to -inf: the rows' bitmasks filled by
    llguidance one row after the other on this thread, unpacked by numpy (bit k of 32-bit word w
    is token 32w + k), applied in one `torch.where`. scores [n, V] -> [n, V] (a new tensor;
    unconstrained rows as they were).

    Not llguidance's parallel fill: right after a forward, torch's worker threads still spin on
    the cores, and the pool's threads contend with them (8 rows of the support-call schema here:
    1.2 ms a step in parallel, 0.3 ms in one thread)."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return scores
    import numpy as np  # here, not at the top: a command sending a schema to a server reads it torch-free
    import torch

    n, vocab = scores.shape
    width = states[rows[0]].compiled.vocab_size
    bitmask = torch.full((len(rows), (width + 31) // 32), -1, dtype=torch.int32)  # [rows, words]
    llt = _llguidance().torch
    for j, i in enumerate(rows):
        llt.fill_next_token_bitmask(states[i].matcher, bitmask, j)
    words = bitmask.numpy().astype("<i4", copy=False)  # little-endian words (no copy on x86 and ARM)
    bits = np.unpackbits(words.view(np.uint8), axis=1, count=min(width, vocab), bitorder="little")
    allowed = torch.from_numpy(bits.view(np.bool_))  # [rows, min(width, V)]
    if allowed.shape[1] < vocab:  # logits wider than the tokenizer's vocabulary: the rest forbidden
        allowed = torch.cat([allowed, allowed.new_zeros(len(rows), vocab - allowed.shape[1])], dim=1)
    forbidden = torch.tensor(-float("inf"), dtype=scores.dtype, device=scores.device)
    if len(rows) == n:
        return torch.where(allowed.to(scores.device), scores, forbidden)
    out = scores.clone()
    out[rows] = torch.where(allowed.to(scores.device), scores[rows], forbidden)
    return out


def allowed_nodes(state: GrammarState, tokens: Sequence[int], parents: Sequence[int],
                  drawn: Sequence[int] = ()) -> list[int]:
    """The nodes of a draft tree the grammar allows, in order: node i guesses tokens[i] under node
    parents[i] (-1: under the branch's head, whose token `state` has consumed), parents first.
    A node is allowed when its whole path is; a forbidden node takes its subtree with it, and
    under a parent in `drawn` (candidates drawn in order from a distribution) its later siblings
    too, so what is kept under it stays a first run of the draws."""
    paths: dict[int, list[int]] = {-1: []}
    cut: set[int] = set()  # parents in `drawn` under which a candidate was forbidden
    kept = []
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if parent not in paths or parent in cut:
            continue
        path = paths[parent] + [token]
        if state.accepted_prefix(path) == len(path):
            paths[i] = path
            kept.append(i)
        elif parent in drawn:
            cut.add(parent)
    return kept
