"""The OpenAI request schema, checked and turned into engine jobs, and the response shapes.

Two request kinds, as OpenAI's API has them: **completions** (`prompt`: text, token ids, or a
list of either) and **chat completions** (`messages`, rendered with the tokenizer's chat
template). Sampling follows OpenAI's defaults: temperature 1 samples, temperature 0 is greedy (by
`sampling_params.greedy_temperature`, the library's and the command line's rule too; any temperature
above 0 samples); choice i samples with seed + i. Our extensions ride in the request
body (the openai client's `extra_body`):

- `speculate`: a mode of `speculation.MODES` ("draft" where the server has a draft model) or
  "off": every branch carries a draft tree; the server's own settings fill in the details;
- `use_beam_search`: beam search with n beams, all n returned best first (with `return_token_ids`,
  each beam's ids); what beams would pass over is refused (`_beams`): penalties, bias, sampling
  settings, stop strings, speculation, streaming, logprobs;
- `questions`: questions about the one prompt (the document; for chat, the last user message,
  after the messages before it, a system message and earlier turns, which every question keeps),
  each answered as its own branch of one forest and returned as one choice per question;
- `trace`: the stream also carries the forest nodes the request fed each step (the live page);
- `return_token_ids`: each choice (each streamed chunk's choice) also carries `token_ids`, the
  ids it generated, and a whole reply's choices their `prompt_token_ids` (vLLM's names), so that
  a client can check them against another run.

OpenAI's sampling extras are honoured per branch: `presence_penalty` and `frequency_penalty`
(-2 to 2, over each choice's generated tokens), `repetition_penalty` (transformers'), and
`logit_bias` ({"token id": bias from -100 to 100}); they apply at temperature 0 too, in the order
of `sampling`'s module notes. `echo` (completions) starts each choice's text with its prompt; with
`logprobs` it is refused, since prompt tokens' log-probabilities are not computed (a prompt found
in the prefix cache is never run again).

Chat messages go to the chat template as `_template_message` shapes them: a developer message as
a system one, and the calls of a conversation's past turns (an assistant's `tool_calls`, a tool
result's `tool_call_id`) kept for a template that renders them, else written into the content.
Log-probabilities report each token's own bytes (`TokenLogprob`), which may be part of a character.
Integer and number fields refuse booleans (`Int`, `Float`), and a body nested past Python's recursion
limit is invalid JSON, never a server error.

`tools` with `tool_choice` naming a function, or "required": the reply is a call of that function
(or of one of the tools, the model choosing), its `arguments` held to the function's `parameters`
schema by the same constraint engine (`ToolChoice`); "none" leaves the tools out. "auto" (the model
choosing between text and a call) is refused with a 400 that says what to use instead, and so is a
call asked for without tools. A call cut short (by max_tokens) is returned as far as it came: the
function's name once it is known, and the arguments decoded so far (`ToolChoice.call`).

`response_format` is OpenAI's: {"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}} (name and schema required, as OpenAI has them) holds every choice to
it (`constraints`; strict false ignores the schema keywords the engine cannot enforce instead of
refusing them); completions take it too. Other servers' ways of asking for structured output
(vLLM's `guided_json` and kin, llama.cpp's `grammar`, `json_schema` and json_object with a
"schema": `OTHER_SERVERS_FORMATS`) are refused, saying what to send instead: passed over, they
would get unconstrained text with a 200. Seeds go up to 2**64 - 1, as the library takes them
(`sampling.seeded_generator`).

Every problem a client can cause raises `BadRequest` (HTTP 400) naming the parameter.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from ..constraints import Constraint, compile_for_branches, token_bytes_reader
from ..errors import InvalidArgument, MultiDecodeError, is_int
from ..prompts import common_prefix_length, has_chat_template, question_message, tokenize_prompt
from ..runtime import Job
from ..sampling_params import (
    MAX_BIAS,
    MAX_PENALTY,
    SEED_LIMIT,
    TINIEST_TEMPERATURE,
    SamplingParams,
    divides_logits,
    drawn_seed,
    greedy_temperature,
)
from ..speculation import LEARNED, PROPOSER_MODES, SpeculationSettings, speculation_mode

MAX_LOGPROBS = 20
MIN_PENALTY = 0.01
"""repetition_penalty lies in [MIN_PENALTY, 1 / MIN_PENALTY]: past that, penalized logits overflow."""


def _not_a_boolean(value):
    """Refuse true and false where a number is expected: pydantic would take them as 1 and 0, and
    `"max_tokens": true` would be answered as if the client had meant a number."""
    if isinstance(value, bool):  # a "_type" error: refused as the wrong type (code invalid_type), naming it
        raise PydanticCustomError("bool_not_number_type", "a number is expected")
    return value


def _divisible_temperature(value: float) -> float:
    """Refuse a temperature above 0 too small to divide float32 logits by (they would overflow: no
    distribution is left to sample); 0 is greedy decoding, which is what such a value comes close to."""
    if value > 0 and not divides_logits(value):  # (the field's bounds keep it at 2 or below)
        raise PydanticCustomError("temperature_too_small",
                                  f"{{value}} is too small to divide float32 logits by (the smallest is "
                                  f"{TINIEST_TEMPERATURE:g}); 0 decodes greedily", {"value": repr(value)})
    return value


Int = Annotated[int, BeforeValidator(_not_a_boolean)]
"""An integer field of a request: a JSON integer (the models are strict, as OpenAI's API is: not
3.0, not "3"), never a boolean."""
Float = Annotated[float, BeforeValidator(_not_a_boolean)]
"""A number field of a request: a JSON number (not its text), never a boolean."""
STRICT = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)
"""Every request model's: unknown fields allowed (other clients' extensions), and each field of its
own JSON type, as OpenAI's API takes them ("n": "2" and "stream": 1 are 400s, not 2 and true)."""


class BadRequest(MultiDecodeError, ValueError):
    """A request the server cannot take as it is (HTTP 400); param names the field at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Body(BaseModel):
    """Fields both request kinds share."""

    model_config = STRICT

    model: str
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)  # chat's newer name; taken by completions too
    temperature: Annotated[Float, AfterValidator(_divisible_temperature)] = Field(1.0, ge=0, le=2)
    top_p: Float = Field(1.0, gt=0, le=1)
    top_k: Int | None = None
    min_p: Float = Field(0.0, ge=0, le=1)
    repetition_penalty: Float = Field(1.0, ge=MIN_PENALTY, le=1 / MIN_PENALTY)
    stop: str | list[str] | None = None
    seed: Int | None = Field(None, ge=0)  # below SEED_LIMIT: `_unsupported` says so in whole digits
    n: Int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: Float | None = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: Float | None = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, Float] | None = None
    user: str | None = None
    # extensions
    speculate: str | None = None
    use_beam_search: bool = False
    questions: list[str] | None = None
    trace: bool = False
    return_token_ids: bool = False
    response_format: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data):
        """OpenAI's optional parameters are nullable, and its client sends `null` for a `None` a
        caller passes: `null` asks for the default, as leaving the field out does (a required field
        keeps its null, and is refused as the wrong type)."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}


class CompletionBody(_Body):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None


class Message(BaseModel):
    model_config = STRICT

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class ChatBody(_Body):
    messages: list[Message]
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: Any = None  # its shapes are checked by `tool_choice`, whose 400 says which are taken
    parallel_tool_calls: bool | None = None


TOO_DEEP = ("the body is not valid JSON for this server: its arrays or objects are nested too deeply to be read "
            "(a request needs a few levels; flatten it)")


def parse_body(raw: bytes, content_type: str | None, kind: type[_Body]) -> _Body:
    """The request body, checked: JSON of the right shape, or `BadRequest`."""
    if content_type is None or content_type.split(";")[0].strip().lower() != "application/json":
        raise BadRequest(f"the body must be JSON (Content-Type: application/json), got {content_type or 'none'}",
                         code="invalid_content_type")
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not valid JSON: {error}", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested past Python's recursion limit
        raise BadRequest(TOO_DEEP, code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    _refuse_lone_surrogates(raw, data)
    try:
        return kind.model_validate(data)
    except RecursionError:
        raise BadRequest(TOO_DEEP, code="invalid_json") from None
    except ValidationError as error:
        first = error.errors()[0]
        if first["loc"][:1] == ("prompt",):  # a union: pydantic names the first of its forms ("prompt.str")
            raise BadRequest(f"prompt must be {PROMPT_FORMS}, got {_json_kind(data.get('prompt'))}", "prompt") from None
        where = ".".join(str(p) for p in first["loc"])
        message, code = first["msg"], None
        if first["type"].endswith("_type"):  # the wrong JSON type: say which came, as OpenAI's 400 does
            message, code = f"{message}, got {_json_value(first['input'])}", "invalid_type"
        raise BadRequest(f"{where}: {message}" if where else message, str(first["loc"][0]) if first["loc"] else None,
                         code) from None


PROMPT_FORMS = "a string, a list of strings, a list of token ids, or a list of lists of token ids"


def _json_value(value) -> str:
    """A value as JSON where it is short and plain ("2", 3.0, true), else what it is (`_json_kind`)."""
    written = json.dumps(value) if isinstance(value, (bool, int, float, str)) else ""
    return written if written and len(written) <= 40 else _json_kind(value)


def _json_kind(value) -> str:
    """What a JSON value is, in JSON's words: "a number", "an object", "a list of lists and strings"."""
    one = {bool: "a boolean", int: "a number", float: "a number", str: "a string", dict: "an object",
           type(None): "null"}
    many = {bool: "booleans", int: "numbers", float: "numbers", str: "strings", dict: "objects", list: "lists",
            type(None): "nulls"}
    if isinstance(value, list):
        return "a list of " + " and ".join(sorted({many.get(type(v), "values") for v in value}))
    return one.get(type(value), "a value")


def _refuse_lone_surrogates(raw: bytes, data: dict) -> None:
    r"""Refuse a string (a value or a key) holding half of a surrogate pair ("\ud800" alone):
    JSON's escapes let a client send one, but it is no character, UTF-8 cannot carry it and the
    tokenizer fails on it (a 500, before this check). The 400 names where it is, escaped. Only a
    body that can hold one is walked (`_SURROGATE_ESCAPE`), and a path is written only for the
    string found."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack: list[tuple[tuple, object]] = [((), data)]
    while stack:
        path, value = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if isinstance(key, str) and _SURROGATE.search(key) or isinstance(item, str) and _SURROGATE.search(item):
                where = ".".join(json.dumps(str(k))[1:-1] for k in (*path, key))  # \udXXX written out
                raise BadRequest(f"{where} holds a lone surrogate, which is not a character: remove it, or send "
                                 "the whole pair (a character past U+FFFF is two \\u escapes in JSON)",
                                 json.dumps(str((*path, key)[0]))[1:-1])
            if isinstance(item, (dict, list)):
                stack.append(((*path, key), item))


_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point: in a Python string read from JSON, always a lone one (json pairs the rest)."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
"""A JSON escape of a surrogate code point, paired or not, or one written in bytes as UTF-8 would
write it (json reads bytes with "surrogatepass"): a body with neither holds none."""


# ---------------------------------------------------------------------- body -> job
SEND_A_SCHEMA = ('send response_format {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} '
                 "instead")
NO_REGEX = ("this server does not hold a reply to a regular expression: use the Python API (regex=) or the "
            "command line's --regex, which run the model locally")
NO_GRAMMAR = ("this server does not hold a reply to a grammar: use the Python API (grammar=) or the command "
              "line's --grammar, which run the model locally")
NO_CHOICES = ('send response_format json_schema with the schema {"enum": [...]} (the reply is then the choice as a '
              "JSON string), or use the command line's --regex locally")
ONE_ENGINE = "this server has one constraint engine (llguidance): leave it out, and ask for JSON with response_format"
NO_WHITESPACE = "leave it out: this server writes JSON with the separators of Python's json.dumps"
NOT_ALL_OUTPUTS = (f"for a JSON schema, {SEND_A_SCHEMA}; a regular expression, a grammar or a list of choices is not "
                   "held by this server: use the Python API or the command line's --regex or --grammar locally")
USE_TOOLS = ('send tools, [{"type": "function", "function": {"name": ..., "parameters": {...}}}], and tool_choice, '
             '{"type": "function", "function": {"name": ...}} or "required"')
OTHER_SERVERS_FORMATS = {  # field: (whose and what it is, what to send instead)
    "guided_json": ("vLLM's JSON schema", SEND_A_SCHEMA),
    "guided_regex": ("vLLM's regular expression", NO_REGEX),
    "guided_grammar": ("vLLM's grammar", NO_GRAMMAR),
    "guided_choice": ("vLLM's list of choices", NO_CHOICES),
    "guided_decoding_backend": ("vLLM's choice of constraint engine", ONE_ENGINE),
    "guided_whitespace_pattern": ("vLLM's whitespace in guided JSON", NO_WHITESPACE),
    "structured_outputs": ("vLLM's structured output", NOT_ALL_OUTPUTS),
    "grammar": ("llama.cpp's grammar", NO_GRAMMAR),
    "json_schema": ("llama.cpp's JSON schema", SEND_A_SCHEMA),
    "regex": ("SGLang's regular expression", NO_REGEX),
    "ebnf": ("SGLang's grammar", NO_GRAMMAR),
    "functions": ("OpenAI's deprecated form of tools", USE_TOOLS),
    "function_call": ("OpenAI's deprecated form of tool_choice", USE_TOOLS),
}
"""Other servers' ways of asking for structured output, which this server would otherwise pass
over (unknown fields are allowed) and answer unconstrained, with a 200 the client takes for a
reply held to its format: each is refused, naming what to send instead."""


MISSPELT = 0.85
"""How alike (difflib's ratio) an unknown field's name must be to a known one's to be taken for a
typo of it and refused ("max_token", "temprature"); other unknown fields are passed over, as other
clients' extensions are (vLLM's `min_tokens` is 0.8 from `max_tokens`, and passes)."""


def _unsupported(body: _Body) -> None:
    if body.seed is not None and body.seed >= SEED_LIMIT:
        raise BadRequest(f"seed must be below 2**64 ({SEED_LIMIT}), got {body.seed}", "seed")
    if body.stream_options is not None and not body.stream:  # as OpenAI answers it
        raise BadRequest("stream_options is only allowed when stream is true", "stream_options")
    if isinstance(body, ChatBody) and body.top_logprobs and not body.logprobs:
        raise BadRequest("top_logprobs needs logprobs: true (as OpenAI requires)", "top_logprobs")
    checks = []
    if isinstance(body, CompletionBody):
        checks += [("suffix", body.suffix is not None), ("best_of", body.best_of not in (None, 1, body.n))]
    for name, used in checks:
        if used:
            raise BadRequest(f"{name} is not supported by this server", name, "unsupported_parameter")
    for name, value in (body.model_extra or {}).items():
        if name in OTHER_SERVERS_FORMATS and value not in (None, "", [], {}):  # empty: nothing asked for
            what, instead = OTHER_SERVERS_FORMATS[name]
            raise BadRequest(f"{name} ({what}) is not read by this server, which would answer unconstrained: "
                             f"{instead}", name, "unsupported_parameter")
        if name not in OTHER_SERVERS_FORMATS and (meant := difflib.get_close_matches(name, type(body).model_fields,
                                                                                     n=1, cutoff=MISSPELT)):
            raise BadRequest(f"unrecognized parameter {name!r}: did you mean {meant[0]!r}? (a parameter this "
                             "server does not know is passed over, so this one would change nothing)", name,
                             "unknown_parameter")


def _sampling(body: _Body, count: int, vocab_size: int) -> list[SamplingParams]:
    """One SamplingParams per branch: greedy at temperature 0, else seeded draws (seed + i)."""
    if body.top_k is not None and body.top_k not in (-1, 0) and body.top_k < 1:
        raise BadRequest(f"top_k must be -1 (off) or a positive integer, got {body.top_k}", "top_k")
    top_k = body.top_k if body.top_k and 0 < body.top_k < vocab_size else None  # the whole vocabulary: off
    penalties = _penalties(body, vocab_size)
    if greedy_temperature(body.temperature):
        return [SamplingParams(**penalties)] * count
    seed = drawn_seed() if body.seed is None else body.seed
    if seed + count - 1 >= SEED_LIMIT:
        raise BadRequest(f"seed {seed} is too large for {count} choices: choice i uses seed + i, which must stay "
                         f"below 2**64 (use a seed of at most {SEED_LIMIT - count})", "seed")
    return [SamplingParams(do_sample=True, temperature=body.temperature, top_k=top_k,
                           top_p=None if body.top_p == 1.0 else body.top_p,
                           min_p=body.min_p or None, seed=seed + i, **penalties)
            for i in range(count)]


def _penalties(body: _Body, vocab_size: int) -> dict:
    """The penalties and logit bias a request sets (those at their neutral value left out)."""
    out = {"repetition_penalty": None if body.repetition_penalty == 1.0 else body.repetition_penalty,
           "presence_penalty": body.presence_penalty or None, "frequency_penalty": body.frequency_penalty or None,
           "logit_bias": _logit_bias(body.logit_bias, vocab_size)}
    return {k: v for k, v in out.items() if v is not None}


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias ({"token id": bias}) with integer ids, checked against the vocabulary."""
    out = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()):
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise BadRequest(f"logit_bias names token id {token}, outside the model's vocabulary of {vocab_size}",
                             "logit_bias")
        if not -MAX_BIAS <= value <= MAX_BIAS:
            raise BadRequest(f"the logit_bias of token {token} must be from -{MAX_BIAS:g} to {MAX_BIAS:g}, got {value}",
                             "logit_bias")
        if token in out:
            raise BadRequest(f"logit_bias names token id {token} twice", "logit_bias")
        out[token] = value
    return out or None


def _stop(body: _Body) -> list[str]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise BadRequest("stop strings must not be empty", "stop")
    return stop


def _prompt_items(prompt) -> list:
    """A completions prompt as a list of prompts, each text or token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(is_int(t) for t in prompt):
        return [prompt]
    return list(prompt)


def echo_texts(body: _Body, tokenizer) -> list[str]:
    """What each choice's text starts with: its prompt as text with `echo`, else nothing ([])."""
    if not isinstance(body, CompletionBody) or not body.echo:
        return []
    texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in _prompt_items(body.prompt)]
    return [text for text in texts for _ in range(body.n)]


def _text_prompts(tokenizer, body: CompletionBody, vocab_size: int) -> list[list[int]]:
    prompts = _prompt_items(body.prompt)
    if not prompts:
        raise BadRequest("the prompt is empty", "prompt")
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise BadRequest("the prompt is empty", "prompt")
            p = list(tokenizer(p, add_special_tokens=True)["input_ids"])
        if not p:
            raise BadRequest("the prompt has no tokens", "prompt")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the model's vocabulary of {vocab_size}", "prompt")
        ids.append(list(p))
    return ids


def _content(message: Message) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported", "messages")
        parts.append(part["text"])
    return "".join(parts)


TOOL_CALLS_FORM = '[{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}]'


def _template_message(message: Message, at: int, *, calls_in_template: bool) -> dict:
    """One chat message as the chat template gets it. A developer message is a system one, as
    OpenAI reads it (templates know the system role, not the developer one). An assistant's
    `tool_calls` and a tool result's `tool_call_id` go along, for a template that renders them;
    where the template does not render calls (it would show an empty assistant turn), they are
    written into the content as JSON, one a line, in the form a "required" call is decoded in
    ({"name": ..., "arguments": {...}}), so that the model still sees what it called."""
    out = {"role": "system" if message.role == "developer" else message.role, "content": _content(message)}
    extra = message.model_extra or {}
    if message.role == "tool" and extra.get("tool_call_id") is not None:
        out["tool_call_id"] = extra["tool_call_id"]
    calls = _tool_calls(extra.get("tool_calls"), at) if message.role == "assistant" else []
    if calls and calls_in_template:
        out["tool_calls"] = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                             for call_id, name, arguments in calls]
    elif calls:
        written = "\n".join(json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
                            for _, name, arguments in calls)
        out["content"] = f"{out['content']}\n{written}" if out["content"] else written
    return out


def _tool_calls(calls, at: int) -> list[tuple[str | None, str, Any]]:
    """An assistant message's `tool_calls` (OpenAI's shape) as (id, function name, arguments),
    checked; the arguments parsed from their JSON text where they parse (chat templates render
    them as objects), else kept as the text that came."""
    if calls is None:
        return []
    where = f"messages[{at}].tool_calls"
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list, {TOOL_CALLS_FORM}", "messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest(f"each of {where} must be {TOOL_CALLS_FORM}", "messages")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except (ValueError, RecursionError):
                pass  # not JSON (or too deep to read): the model sees the text it wrote
        out.append((call.get("id"), function["name"], arguments))
    return out


def _chat_messages(tokenizer, messages: list[Message]) -> list[dict]:
    """The request's messages as the chat template gets them (`_template_message`); calls go to
    the template as `tool_calls` only where its text renders them."""
    calls_in_template = "tool_calls" in str(getattr(tokenizer, "chat_template", None) or "")
    return [_template_message(m, at, calls_in_template=calls_in_template) for at, m in enumerate(messages)]


def _chat_prompt(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The chat's prompt ids; `tools` go to the chat template (one that ignores them is told of the
    call's schema by the constraint alone). A template that cannot render the messages (most
    raise on a role or an order they do not take, and rendering recurses into every value) is a
    400 naming messages, not a server error."""
    if not has_chat_template(tokenizer):
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    if _nesting([messages, tools]) > TEMPLATE_NESTING:  # refused the same way whatever the stack's depth
        raise BadRequest(TEMPLATE_TOO_DEEP, "messages")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False, add_generation_prompt=True)
    except TemplateError as error:
        raise BadRequest(f"the model's chat template cannot render these messages: {error}", "messages") from None
    except RecursionError:
        raise BadRequest(TEMPLATE_TOO_DEEP, "messages") from None
    return tokenize_prompt(tokenizer, text)


TEMPLATE_NESTING = 200
"""The deepest messages and tools a chat template is given (real tool schemas nest a few dozen
levels at most). Past some depth rendering recurses beyond Python's limit, but where depends on
the stack at the time: a fixed bound answers one way every time."""
TEMPLATE_TOO_DEEP = "the messages or tools are nested too deeply for the model's chat template to render: flatten them"


def _nesting(value) -> int:
    """How deep lists and dicts nest in `value`, walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in item)
    return deepest


def _question_prompts(tokenizer, document: str, questions: Sequence[str], *, chat: bool,
                      before: Sequence[dict] = ()) -> list[list[int]]:
    """A prompt per question about `document`; in a chat, after the messages `before` the document's
    (a system message, earlier turns), which each question's prompt keeps."""
    if not document.strip():
        raise BadRequest("the document (prompt) is empty: questions need a document to be about", "prompt")
    if not questions or any(not isinstance(q, str) or not q.strip() for q in questions):
        raise BadRequest("questions must be a non-empty list of non-empty strings", "questions")
    if chat and has_chat_template(tokenizer):
        return [_chat_prompt(tokenizer, [*before, {"role": "user", "content": question_message(document, q)}])
                for q in questions]
    return [list(tokenizer(question_message(document, q), add_special_tokens=True)["input_ids"])
            for q in questions]


def _check_branches(body: _Body, prompts: int, max_branches: int | None) -> None:
    """Refuse a request of more branches than the server ever runs, before building them: a branch
    per question, or n per prompt (`prompts`: how many the request holds), naming what to lower."""
    questions = body.questions is not None
    count = len(body.questions) if questions else prompts * body.n
    if max_branches is None or count <= max_branches:
        return
    if questions:
        made, param = f"{count} questions, each a branch", "questions"
    else:
        made, param = f"{count} branches (n={body.n} for each of {prompts} prompts)", "n" if body.n > 1 else "prompt"
    raise BadRequest(f"the request needs {made}, over this server's limit of {max_branches} branches", param,
                     "too_many_branches")


def to_job(body: _Body, tokenizer, *, vocab_size: int, max_positions: int | None, window_note: str = "",
           speculate_default: SpeculationSettings | None = None, has_draft: bool = False,
           max_branches: int | None = None, eos_ids=frozenset()) -> Job:
    """A checked request as a runtime job (its sink is set by the caller). speculate_default:
    the server's speculation, for requests that name no mode of their own; has_draft: whether the
    server has a draft model (for "draft"); max_branches: the server's cap on branches, checked
    before n copies of a prompt are made; window_note: why `max_positions` stops short of the
    model's own, for the refusal of a request past it; eos_ids: what ends a branch (a `response_format`
    needs one, and is compiled for the tokenizer here, so a bad one is refused before any
    decoding)."""
    _unsupported(body)
    chat = isinstance(body, ChatBody)
    _check_echo(body)
    _check_branches(body, 1, max_branches)
    tool = tool_choice(body)
    prompts = _prompts(body, tokenizer, vocab_size, chat=chat, max_branches=max_branches, tool=tool)
    max_tokens = _max_tokens(body, prompts, max_positions, window_note, chat=chat)
    if chat:
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    beams = _beams(body, prompts, logprobs)
    prompts = prompts[:1] if beams else prompts
    if logprobs is not None:
        token_bytes_reader(tokenizer)  # built here, off the event loop, which reads tokens' bytes from it
    if tool is not None and body.response_format and body.response_format.get("type", "text") != "text":
        raise BadRequest("response_format and a tool call cannot both shape the reply: give one of them",
                         "response_format")
    if tool is not None:
        constraint = _compiled(tool.constraint, tokenizer, "tools", vocab_size=vocab_size, eos_ids=eos_ids,
                               hint=tool.mixed_strictness())
    else:
        constraint = _constraint(body.response_format, tokenizer, vocab_size=vocab_size, eos_ids=eos_ids)
    if constraint is not None and beams:
        raise BadRequest("use_beam_search does not take a response_format or a tool call",
                         "tool_choice" if tool is not None else "response_format")
    return Job(prompts=prompts, max_new_tokens=max_tokens, sampling=_sampling(body, len(prompts), vocab_size),
               stop=_stop(body), speculate=_speculation(body.speculate, speculate_default, has_draft),
               logprobs=logprobs, beams=beams, trace=body.trace, constraint=constraint,
               copies=1 if beams else body.n)


def _constraint(response_format: dict | None, tokenizer, *, vocab_size: int, eos_ids) -> Constraint | None:
    """OpenAI's `response_format` as a constraint (None for text), compiled for the tokenizer."""
    if response_format is not None and "type" not in response_format:  # answered as text, its schema would be ignored
        raise BadRequest('response_format.type is missing: give "text", "json_object" or "json_schema"',
                         "response_format")
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None

    def made() -> Constraint:
        if kind == "json_object":
            if response_format.get("schema") is not None:  # llama.cpp's form: answered as any object, it would pass
                raise BadRequest(f"response_format json_object takes no schema (llama.cpp's form): {SEND_A_SCHEMA}",
                                 "response_format", "invalid_json_schema")
            return Constraint.json_object()
        if kind != "json_schema":
            raise BadRequest(f"response_format type {kind!r} is not supported: use text, json_object or json_schema",
                             "response_format")
        schema, strict = _json_schema(response_format.get("json_schema"))
        return Constraint.json_schema(schema, strict=strict)
    return _compiled(made, tokenizer, "response_format", vocab_size=vocab_size, eos_ids=eos_ids)


def _json_schema(spec) -> tuple[dict | bool, bool]:
    """OpenAI's `response_format.json_schema`, checked as OpenAI checks it: its name and its schema
    must be there (a missing schema would otherwise let any JSON through), as (schema, strict)."""
    form = '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
    if not isinstance(spec, dict):
        raise BadRequest(f"response_format json_schema must be {form}", "response_format", "invalid_json_schema")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise BadRequest(f"response_format.json_schema.name is missing: name the schema, as in {form}",
                         "response_format", "invalid_json_schema")
    if not isinstance(spec.get("schema"), dict | bool):  # JSON Schema's `true` is any value (`false` is refused)
        what = "missing" if spec.get("schema") is None else "not an object"
        raise BadRequest(f"response_format.json_schema.schema is {what}: give the JSON schema the reply must follow, "
                         f'as in {form}, or use {{"type": "json_object"}} for any JSON object',
                         "response_format", "invalid_json_schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise BadRequest("response_format.json_schema.strict must be true or false", "response_format")
    return spec["schema"], bool(strict)


def _compiled(make: Callable[[], Constraint], tokenizer, param: str, *, vocab_size: int, eos_ids,
              hint: str | None = None) -> Constraint:
    """The constraint `make` builds, once it is known to compile for the tokenizer: a 400 naming
    `param` (where the schema came from) when it cannot be built or compiled, with the engine's
    hint or `hint`."""
    try:
        constraint = make()
        compile_for_branches([constraint], tokenizer, vocab_size=vocab_size, eos_ids=eos_ids)
    except InvalidArgument as error:
        fix = f"; {hint or error.hint}" if hint or error.hint else ""  # a client sees no hint field: in the message
        raise BadRequest(f"{param}: {error.message}{fix}", param, "invalid_json_schema") from None
    return constraint


# ---------------------------------------------------------------------- tools
@dataclass(frozen=True)
class ToolChoice:
    """The call a reply must be. functions: name -> its `parameters` schema, for every tool the
    reply may call; named: whether `tool_choice` named one (the reply is then its arguments alone)
    or said "required" (the reply is {"name": ..., "arguments": {...}}, the model choosing); strict:
    the functions whose `strict` is true (OpenAI's default is false: keywords the engine cannot
    enforce are then ignored, as `response_format`'s strict false ignores them)."""

    functions: dict[str, dict]
    named: bool
    strict: frozenset[str] = frozenset()

    def constraint(self) -> Constraint:
        strict = bool(self.strict & self.functions.keys())  # one compile: strict where any function asks it
        if self.named:
            (schema,) = self.functions.values()
            return Constraint.json_schema(schema, strict=strict)
        calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name, schema in self.functions.items()]
        return Constraint.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls}, strict=strict)

    def mixed_strictness(self) -> str | None:
        """The fix for a "required" call whose tools differ in `strict` (held to one schema, strict
        where any asks it), when that schema is refused; None where they agree."""
        asking = sorted(self.strict & self.functions.keys())
        if not asking or len(asking) == len(self.functions):
            return None
        return (f"a \"required\" call is held to one schema of all its tools, strict because {', '.join(asking)} "
                "asks strict: true; give every tool the same strict (false for best effort), or leave out the "
                "keywords the engine cannot enforce")

    def call(self, text: str) -> Call | None:
        """The call a reply's text is, or as far as it came (cut short by max_tokens or a stop
        string): the function's name once known, and only its arguments, never the
        {"name", "arguments"} object a "required" reply is written in. None where not even the
        name was decoded: there is no call to report."""
        if self.named:
            return Call(next(iter(self.functions)), text, whole=_parses(text))
        try:
            value = json.loads(text)
            return Call(value["name"], json.dumps(value["arguments"], ensure_ascii=False), whole=True)
        except (ValueError, KeyError, TypeError, RecursionError):
            name, arguments = _cut_call(text)
            return Call(name, arguments, whole=False) if name in self.functions else None


@dataclass(frozen=True)
class Call:
    """A reply's function call: the function's name, its arguments as JSON text, and whether it is
    whole (else cut short: `arguments` is the prefix decoded, possibly empty)."""

    name: str
    arguments: str
    whole: bool


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):  # a reply may nest as deep as max_tokens lets it
        return False
    return True


def _cut_call(text: str) -> tuple[str | None, str]:
    """A "required" reply cut short, read as far as it came: (the function's name, None until its
    string is whole; the raw text of the arguments value decoded so far). The reply is the object
    `ToolChoice.constraint` holds it to, whatever the order of its two keys."""
    decoder, at = json.JSONDecoder(), _skip_space(text, 0)
    if not text.startswith("{", at):
        return None, ""
    name, arguments, at = None, "", at + 1
    while True:
        at = _skip_space(text, at)
        if text.startswith(",", at):
            at = _skip_space(text, at + 1)
        try:
            key, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # no key, or one cut short
            return name, arguments
        at = _skip_space(text, at)
        if not text.startswith(":", at):
            return name, arguments
        at = _skip_space(text, at + 1)
        try:
            value, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):  # the value cut short (or too deep to read): arguments are what came
            return name, text[at:] if key == "arguments" else arguments
        if key == "name" and isinstance(value, str):
            name = value
        elif key == "arguments":
            arguments = text[at:end]
        at = end


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def tool_choice(body: _Body) -> ToolChoice | None:
    """The call `body` asks for (None: a text reply), checked: `BadRequest` naming what is wrong.
    A call asked for without tools is refused, as OpenAI does, rather than answered in text that
    the client would take for a call that was never made ("none" and "auto" ask for no call there)."""
    if not isinstance(body, ChatBody):
        return None
    _check_tool_choice_shape(body.tool_choice)
    if not body.tools:
        if body.tool_choice not in (None, "none", "auto"):
            raise BadRequest(f"tool_choice {body.tool_choice!r} needs tools, and the request gives none: list the "
                             'functions the reply may call in tools, [{"type": "function", "function": {"name": ..., '
                             '"parameters": {...}}}], or leave tool_choice out', "tool_choice")
        return None
    if body.tool_choice == "none":
        return None
    functions, strict = {}, set()
    for tool in body.tools:
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise BadRequest('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}',
                             "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise BadRequest(f"tools: the parameters of {function['name']!r} must be a JSON schema object", "tools")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise BadRequest(f"tools: the strict of {function['name']!r} must be true or false", "tools")
        functions[function["name"]] = parameters
        if function.get("strict"):
            strict.add(function["name"])
    choice = body.tool_choice
    if choice == "required":
        return ToolChoice(functions, named=False, strict=frozenset(strict))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise BadRequest(f"tool_choice names {name!r}, which is not among the tools ({', '.join(functions)})",
                             "tool_choice")
        return ToolChoice({name: functions[name]}, named=True, strict=frozenset(strict))
    raise BadRequest(f"tool_choice {choice if choice is not None else 'auto'!r} is not supported (the model choosing "
                     'between text and a call): name a function, {"type": "function", "function": {"name": ...}}, '
                     'or give "required" (a call of one of the tools) or "none" (text)', "tool_choice",
                     "unsupported_parameter")


TOOL_CHOICES = ('"none" (text), "required" (a call of one of the tools) or {"type": "function", "function": '
                '{"name": ...}} (a call of that function)')


def _check_tool_choice_shape(choice) -> None:
    """Refuse a tool_choice of no shape this server reads, saying which it takes: a malformed one
    (a named function without its "function" object, "any") is not the "auto" that is not offered."""
    if choice in (None, "none", "auto", "required"):
        return
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if isinstance(function, dict) and isinstance(function.get("name"), str):
        return
    raise BadRequest(f"tool_choice {json.dumps(choice)} is not a tool choice this server reads: give {TOOL_CHOICES} "
                     '("auto", the model choosing between text and a call, is not offered)', "tool_choice")


def _prompts(body: _Body, tokenizer, vocab_size: int, *, chat: bool, max_branches: int | None,
             tool: ToolChoice | None) -> list[list[int]]:
    """Whole prompt ids, one per branch: a prompt per question, or n copies of each prompt. tool:
    the call the reply must be (`tool_choice`), whose tools the chat template then shows."""
    if body.questions is not None:
        if body.n != 1:
            raise BadRequest("n must be 1 with questions: each question is one choice", "n")
        before: list[dict] = []
        if chat:  # the last user message is the document; what comes before it (a system message) is kept
            users = [at for at, m in enumerate(body.messages) if m.role == "user"]
            if not users:
                raise BadRequest("messages must hold a user message (the document)", "messages")
            document = _content(body.messages[users[-1]])
            before = _chat_messages(tokenizer, body.messages[: users[-1]])
        else:
            if not isinstance(body.prompt, str):
                raise BadRequest("with questions, the prompt must be the document as text", "prompt")
            document = body.prompt
        return _question_prompts(tokenizer, document, body.questions, chat=chat, before=before)
    if chat:
        if not body.messages:
            raise BadRequest("messages must not be empty", "messages")
        messages = _chat_messages(tokenizer, body.messages)
        tools = body.tools if tool is not None else None
        return [_chat_prompt(tokenizer, messages, tools)] * body.n
    texts = _text_prompts(tokenizer, body, vocab_size)
    _check_branches(body, len(texts), max_branches)
    return [p for p in texts for _ in range(body.n)]


def _max_tokens(body: _Body, prompts: list[list[int]], max_positions: int | None, window_note: str, *,
                chat: bool) -> int:
    """The tokens to generate: as asked, or a default that fits the model's window (window_note: why
    that window is short of the model's own, or ""). A prompt of P tokens takes P + max_tokens - 1
    positions (the last new token is never fed back), as the library and `generate` count them."""
    default = 16 if not chat else 256
    max_tokens = body.max_completion_tokens or body.max_tokens
    longest = max(map(len, prompts))
    if max_positions is not None:
        if longest > max_positions:
            document = "messages" if chat else "prompt"
            what, param = "the prompt", document
            if body.questions is not None:  # the question that overflows, unless the document alone does
                index = max(range(len(prompts)), key=lambda i: len(prompts[i]))
                what = f"the document with question {index + 1}"
                # the document sits in the prompts' shared prefix (of two or more: one prompt is all prefix)
                document_fits = len(prompts) > 1 and common_prefix_length(prompts) < max_positions
                param = "questions" if document_fits or min(map(len, prompts)) <= max_positions else document
            raise BadRequest(f"{what} is {longest} tokens, but the model's context window is {max_positions} "
                             f"tokens{window_note}", param, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(default, max_positions - longest + 1)
        elif longest + max_tokens - 1 > max_positions:
            named = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
            raise BadRequest(f"the prompt ({longest} tokens) plus {named} ({max_tokens}) is over the model's "
                             f"context window of {max_positions} tokens{window_note}", named, "context_length_exceeded")
    return max_tokens or default


def _speculation(requested: str | None, default: SpeculationSettings | None, has_draft: bool):
    """The request's speculation: the server's, or the mode it names with the server's details
    for that mode (lookahead's settings, the draft model)."""
    default = default or SpeculationSettings()
    if requested is None:
        return default
    try:
        mode = speculation_mode(requested)
    except InvalidArgument as error:
        raise BadRequest(f"speculate: {error}", "speculate") from None
    if mode is not None and PROPOSER_MODES[mode].needs_draft and not has_draft:
        raise BadRequest(f"speculate {mode!r} needs a draft model, and this server has none (start it with "
                         "--draft-model or --draft-skip-layers)", "speculate")
    if mode in LEARNED and mode != default.mode:  # its head is loaded once, when the server starts
        raise BadRequest(f"speculate {mode!r} drafts with a learned head, and this server did not load one "
                         f"(start it with --speculate {mode})", "speculate")
    return default.with_mode(mode)


def _check_echo(body: _Body) -> None:
    if not isinstance(body, CompletionBody) or not body.echo:
        return
    if body.logprobs is not None:
        raise BadRequest("echo with logprobs is not supported: this server does not compute the prompt tokens' "
                         "log-probabilities (leave logprobs out, or echo the prompt yourself)", "echo")
    if body.questions is not None:
        raise BadRequest("echo is not supported with questions (each question's prompt is built by the server)", "echo")


def _beams(body: _Body, prompts: list[list[int]], logprobs: int | None) -> int:
    """The number of beams of a `use_beam_search` request (n), else 0."""
    if not body.use_beam_search:
        return 0
    if body.questions is not None:
        raise BadRequest("use_beam_search does not take questions: a beam search is of one prompt (ask each "
                         "question in a request of its own)", "use_beam_search")
    if len(prompts) != body.n:  # n copies of each prompt given: one prompt
        raise BadRequest("use_beam_search takes one prompt (n is the number of beams)", "use_beam_search")
    if body.stream or logprobs is not None:
        raise BadRequest("use_beam_search returns finished beams: stream and logprobs are not supported with it",
                         "use_beam_search")
    used = [name for name, on in (("repetition_penalty", body.repetition_penalty != 1.0),
                                  ("presence_penalty", bool(body.presence_penalty)),
                                  ("frequency_penalty", bool(body.frequency_penalty)),
                                  ("logit_bias", bool(body.logit_bias)),
                                  ("temperature", body.temperature not in (0.0, 1.0)),
                                  ("top_p", body.top_p != 1.0),
                                  ("top_k", body.top_k not in (None, -1, 0)),
                                  ("min_p", bool(body.min_p))) if on]
    for name in used[:1]:
        raise BadRequest(f"{name} is not supported with use_beam_search (beams are scored by the model's own "
                         "log-probabilities)", name)
    if _stop(body):
        raise BadRequest("stop is not supported with use_beam_search (beams end on the model's end of sequence or "
                         "at max_tokens): leave it out, or cut the returned beams yourself", "stop")
    try:
        drafted = speculation_mode(body.speculate) is not None
    except InvalidArgument:  # an unknown mode: refused here all the same
        drafted = True
    if drafted:
        raise BadRequest("speculate is not supported with use_beam_search (beams are not drafted): leave it out",
                         "speculate")
    return body.n


# ---------------------------------------------------------------------- responses
def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_dict(usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class Choice:
    """One choice as it fills in: its text, its tokens' log-probabilities, why it ended."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.finish_reason: str | None = None
        self.logprobs: list[TokenLogprob] = []
        self.token_ids: list[int] = []


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token as a reply's log-probabilities report it: its own bytes (a token may
    hold part of a character: an emoji's first bytes, say), its log-probability, the likeliest
    tokens there as (bytes, log-probability), and `offset`: the length of the choice's text before
    it, which is where the text it completes begins (a token that leaves a character unfinished
    adds no text, and the tokens of that character share the offset where its text begins)."""

    data: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...]
    offset: int


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes (a special token's: its name). Without llguidance's reading of the
    tokenizer, its decoded text's: right for tokens of whole characters only."""
    return _bytes_of(tokenizer)(token_id)


def _bytes_of(tokenizer) -> Callable[[int], bytes]:
    """token id -> its bytes (`token_bytes`), the tokenizer's reading looked up once."""
    reader = token_bytes_reader(tokenizer)
    if reader is None:
        return lambda token_id: tokenizer.decode([token_id]).encode()
    return lambda token_id: reader.decode_bytes([token_id])


def openai_token(data: bytes) -> str:
    """A token as OpenAI names it in logprobs: its text where its bytes are UTF-8 on their own,
    else "bytes:" and each byte as \\xNN (part of a character)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def token_entry(tokenizer, event, offset: int) -> TokenLogprob:
    """`event`'s token (a `TokenEvent` with log-probabilities) at `offset` in its choice's text."""
    of = _bytes_of(tokenizer)  # once for the token and its top candidates
    return TokenLogprob(of(event.token_id), event.logprob, tuple((of(t), lp) for t, lp in event.top_logprobs), offset)


def completion_logprobs(entries: list[TokenLogprob]) -> dict:
    """The completions API's log-probabilities (its legacy shape); text_offset: each token's
    `TokenLogprob.offset`, a character offset into the choice's text. As OpenAI's, each
    `top_logprobs` holds the chosen token too, last where it is not among the top ones (up to
    logprobs + 1 entries); the chat API's stay the top ones only, as OpenAI's do."""
    def top(e: TokenLogprob) -> dict[str, float]:
        chosen = () if any(data == e.data for data, _ in e.top) else ((e.data, e.logprob),)
        return {openai_token(data): lp for data, lp in (*e.top, *chosen)}
    return {"tokens": [openai_token(e.data) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(e) for e in entries], "text_offset": [e.offset for e in entries]}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    """The chat API's log-probabilities: each token's bytes are its own, so that joined they are
    the content's UTF-8 (with the end-of-sequence token's name last, where one ended it)."""
    def item(data: bytes, lp: float) -> dict:
        return {"token": openai_token(data), "logprob": lp, "bytes": list(data)}
    return {"content": [{**item(e.data, e.logprob), "top_logprobs": [item(d, lp) for d, lp in e.top]}
                        for e in entries],
            "refusal": None}


__all__ = [
    "BadRequest",
    "Call",
    "ChatBody",
    "Choice",
    "CompletionBody",
    "TokenLogprob",
    "ToolChoice",
    "chat_logprobs",
    "completion_logprobs",
    "echo_texts",
    "error_body",
    "openai_token",
    "parse_body",
    "to_job",
    "token_bytes",
    "token_entry",
    "tool_choice",
    "usage_dict",
]
