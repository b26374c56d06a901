"""Request bodies of the OpenAI-compatible API (pydantic v2); the responses are in response_models.py.

Requests accept the OpenAI fields plus vLLM's sampling extensions (top_k, min_p, repetition_penalty,
stop_token_ids, ignore_eos, ...). A field this server does not implement is rejected with a 400 that names
it, never silently ignored: a client relying on it would otherwise get a quiet, wrong answer. Numbers must be
finite (no NaN or Infinity) and text must be valid Unicode (no lone surrogates). Types are strict: a value of the
wrong JSON type is a 400 naming its field, never converted.
"""
from __future__ import annotations

import array
import json
from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictInt, ValidationError, ValidationInfo, field_validator,
                      model_validator)

from specdecode.sampling_params import SamplingParams, check_text
from specdecode.structured import StructuredOutputsParams


def _check_strings(value: Any, path: str) -> None:
    if isinstance(value, str):
        check_text(value, path or "the request")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, path or "a field name")
            _check_strings(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        try:
            array.array("q", value)  # a C loop: a list of integers (a prompt's ids, millions of them) holds no text
            return
        except (TypeError, OverflowError):
            pass
        for i, v in enumerate(value):
            _check_strings(v, f"{path}[{i}]")


MAX_STOP_STRINGS = 256  # per request, for stop and for bad_words (OpenAI takes 4 stop strings)


class ParamError(ValueError):
    """A value the server refuses (HTTP 400), with the request field it is about (OpenAI's ``param``), so the
    error names the field instead of a word guessed from the message."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class _Request(BaseModel):
    # strict: JSON types as OpenAI reads them. No number from a string or a bool ("0.5", true), no bool from a
    # number or a word (1, "yes"), no int from a float (1e12); an int is still a float.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        _check_strings(data, "")
        return data


# ---------------------------------------------------------------- shared request fields
class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """OpenAI's response_format.json_schema. ``strict`` is accepted either way: output always follows the
    schema exactly (the grammar masks every token)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_only_with_its_type(self) -> "ResponseFormat":
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f"response_format.json_schema is read only with type 'json_schema', got type "
                             f"{self.type!r}; the schema would be ignored.")
        return self


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs`` request field: the fields of StructuredOutputsParams."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class _SamplingRequest(_Request):
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (a string key) -> bias in [-100, 100]
    min_tokens: int = Field(0, ge=0)  # vLLM: EOS, stop_token_ids and stop strings count only after this many
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM: keep the prompt's last k tokens (-1: all that fit)
    allowed_token_ids: list[int] | None = None  # vLLM: only these tokens may be generated
    bad_words: list[str] | None = None  # vLLM: words that must not be generated
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    speculative_decoding: bool = True  # specdecode's: false decodes this request without drafts (to compare)

    @field_validator("stop", "bad_words")
    @classmethod
    def _few_strings(cls, value: str | list[str] | None, info: ValidationInfo) -> str | list[str] | None:
        # On the engine thread that runs every stream, each stop string is searched for after every step, and each
        # bad word is tokenized when the request is added and checked at every verified row.
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"{info.field_name} holds {len(value)} strings; this server takes at most "
                             f"{MAX_STOP_STRINGS}.")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # Python's int() also reads other scripts' digits ("١" is 1) and raises on "²": only ASCII ids are ids.
        for key in bias or ():
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError(f"logit_bias keys must be token ids in decimal digits, got {key[:20]!r}.")
        return bias

    def _constraint_fields(self) -> list[str]:
        """The request fields that ask for an output constraint."""
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        return given + [f for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                        if getattr(self, f) is not None]

    def constraint_param(self) -> str | None:
        """The request field a compiled constraint comes from: what a constraint that does not compile names."""
        given = self._constraint_fields()
        if not given:
            return None
        rf = self.response_format
        if given[0] == "response_format" and rf.type == "json_schema":
            return "response_format.json_schema.schema"
        return given[0]

    def _constraint(self, tool_parser: str = "auto") -> StructuredOutputsParams | None:
        """The one output constraint this request asks for, from whichever field it used."""
        given = self._constraint_fields()
        if not given:
            return None
        if len(given) > 1:
            raise ParamError(given[1], f"Give one output constraint, not several ({', '.join(given)}).")
        try:
            if given[0] == "response_format":
                rf = self.response_format
                if rf.type == "json_schema":
                    if rf.json_schema is None:
                        raise ParamError("response_format.json_schema",
                                         "response_format.json_schema is required when type is 'json_schema'.")
                    if rf.json_schema.json_schema is not None:
                        return StructuredOutputsParams(json=rf.json_schema.json_schema)
                return StructuredOutputsParams(json_object=True)
            if given[0] == "structured_outputs":
                so = self.structured_outputs
                return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                               json_object=so.json_object,
                                               disable_any_whitespace=so.disable_any_whitespace)
            kind = given[0].removeprefix("guided_")
            return StructuredOutputsParams(**{kind: getattr(self, given[0])})
        except ParamError:
            raise
        except ValueError as e:
            raise ParamError(self.constraint_param() or given[0], str(e)) from None

    def _sampling(self, max_tokens: int | None, logprobs: int | None, tool_parser: str = "auto",
                  prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError (reported as 400) for values SamplingParams rejects."""
        if self.stream_options is not None and not self.stream:
            # vLLM refuses it too: stream options without a stream are a client mistake, not a no-op
            raise ParamError("stream_options", "stream_options can only be given when stream is true.")
        kw: dict[str, Any] = dict(n=self.n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                  min_tokens=self.min_tokens, truncate_prompt_tokens=self.truncate_prompt_tokens,
                                  allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
                                  logit_bias=self.logit_bias or None,
                                  ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
                                  include_stop_str_in_output=self.include_stop_str_in_output, seed=self.seed,
                                  stop=self.stop, stop_token_ids=self.stop_token_ids,
                                  structured_outputs=self._constraint(tool_parser),
                                  speculative_decoding=self.speculative_decoding)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        return SamplingParams(**kw)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------- /v1/completions
class CompletionRequest(_SamplingRequest):
    # Tried in this order, ids strictly: a list of ids is validated in one pass (smart unions tried every member:
    # 1.7 s for 4M ids, on the event loop), and neither "1" nor true is read as a token id.
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]] = Field(union_mode="left_to_right")
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None  # fill in the middle: the text after the gap (specdecode.fim); "" is none
    best_of: int | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt back (with its logprobs, if asked), nothing generated. This is how
        evaluation harnesses score a text (lm-eval's loglikelihood requests)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix and self.echo:
            raise ParamError("echo", "echo cannot be combined with suffix: a fill-in-the-middle answer is not a "
                                     "continuation of the prompt.")
        if self.echo and self.truncate_prompt_tokens is not None:
            raise ParamError("echo", "echo cannot be combined with truncate_prompt_tokens: echo returns the prompt "
                                     "as sent.")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens must be at least 1 (0 only with echo, to score the prompt).")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (got best_of={self.best_of}, n={self.n}); "
                             "best-of-n selection is not supported.")
        # echo with logprobs scores the prompt's tokens too (OpenAI's and vLLM's meaning); with max_tokens 0 one
        # token is generated and not returned, as vLLM does
        return self._sampling(1 if self.echo_only else self.max_tokens, self.logprobs,
                              prompt_logprobs=self.logprobs if self.echo else None)


# ---------------------------------------------------------------- /v1/chat/completions
class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        # whatever tool_choice is: "auto" calls are checked against it too (specdecode.structured.json_calls)
        from specdecode.structured.json_calls import schema_problem

        problem = None if schema is None else schema_problem(schema)
        if problem is not None:
            raise ValueError(f"the parameters schema {problem}")
        return schema


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


# The roles a chat template knows. "developer" is OpenAI's newer name for "system" (templates only know the
# latter, and drop a role they do not know without a word).
ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, shown to the template
    tool_call_id: str | None = None           # a tool message answers this call

    def as_template_dict(self, path: str = "message") -> dict[str, Any]:
        """The message as chat templates take it; ParamError (naming the field under ``path``, e.g.
        ``messages.0``) for what a template would drop or misread without a word."""
        if self.role not in ROLES:
            raise ParamError(f"{path}.role", f"{path}.role: unknown role {self.role!r}; use one of "
                                             f"{', '.join(ROLES)}.")
        content = self.content
        if content is None and not (self.role == "assistant" and self.tool_calls):
            # OpenAI: content is required, except in an assistant message that carries tool_calls
            raise ParamError(f"{path}.content", f"{path}.content is required for role {self.role!r}"
                             + (" (unless the message has tool_calls)." if self.role == "assistant" else "."))
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text":
                    raise ParamError(f"{path}.content.{j}.type", "Only text content parts are supported, got a "
                                                                  f"{part.type!r} part ({path}.content.{j}).")
                if part.text is None:
                    raise ParamError(f"{path}.content.{j}.text",
                                     f"{path}.content.{j} is a 'text' part without its 'text' field.")
                texts.append(part.text)
            content = "".join(texts)
        d: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            # The spec sends arguments as a JSON string; templates (Qwen2.5's, Llama 3.1's) print them with
            # tojson and expect the object, so parse them first, as vLLM does.
            d["tool_calls"] = [{"id": c.id, "type": c.type,
                                "function": {"name": c.function.name,
                                             "arguments": _arguments(c.function.arguments,
                                                                     f"{path}.tool_calls.{k}.function.arguments")}}
                               for k, c in enumerate(self.tool_calls)]
        return d


def _arguments(text: str, path: str) -> dict[str, Any]:
    try:
        args = json.loads(text)
    except ValueError as e:
        raise ParamError(path, f"{path} is not valid JSON ({e}).") from None
    if not isinstance(args, dict):
        raise ParamError(path, f"{path} must be a JSON object, got {type(args).__name__}.")
    return args


class Prediction(_Request):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat for the most part."""
    type: Literal["content"]
    content: str | list[ContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ParamError(f"prediction.content.{j}", f"prediction.content.{j} must be a 'text' part with "
                                                            "its 'text' field.")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    prediction: Prediction | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply goes on from the last message (vLLM's)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the chat template (Qwen3's enable_thinking)
    # specdecode's: each choice (and each stream chunk's) carries its text cut into its tokens' pieces, each with
    # where the token came from (outputs.TokenOrigin); the web page colours them
    return_token_origins: bool = False

    @property
    def tool_mode(self) -> str:
        """"none" (no tools in play), "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def max_tool_calls(self) -> int | None:
        """parallel_tool_calls false: one call at most (required / named modes also constrain the output)."""
        return 1 if self.parallel_tool_calls is False else None

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (none when tool_choice is "none": the model is not to call any)."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint_param(self) -> str | None:
        return "tools" if self.tool_mode in ("required", "named") else super().constraint_param()

    def _constraint(self, tool_parser: str = "auto") -> StructuredOutputsParams | None:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ParamError("tool_choice", "tool_choice needs tools: give the functions the model may call.")
        mode = self.tool_mode
        if mode in ("none", "auto"):
            return super()._constraint()
        if super()._constraint() is not None:
            raise ParamError(super().constraint_param(),
                             f"tool_choice {self.tool_choice if mode == 'required' else 'naming a function'} "
                             "already constrains the output; drop the other output constraint.")
        from specdecode.structured.tools import resolve_tool_parser

        name = self.tool_choice.function.name if mode == "named" else None
        if name is not None and name not in {t.function.name for t in self.tools}:
            raise ParamError("tool_choice.function.name",
                             f"tool_choice names the function {name!r}, which is not among the tools "
                             f"({', '.join(t.function.name for t in self.tools)}).")
        parser = resolve_tool_parser(tool_parser)
        parallel = self.parallel_tool_calls is not False
        try:
            return parser.constraint(self.tool_dicts(), name, parallel=parallel)
        except ValueError as e:
            # a parameters schema the grammar cannot take: find which tool's, to name it
            for i, tool in enumerate(self.tool_dicts()):
                if name is not None and tool["function"]["name"] != name:
                    continue
                try:
                    parser.constraint([tool], None, parallel=parallel)
                except ValueError:
                    raise ParamError(f"tools.{i}.function.parameters", str(e)) from None
            raise ParamError("tools", str(e)) from None

    def to_sampling_params(self, tool_parser: str = "auto") -> SamplingParams:
        """``tool_parser``: the server's --tool-call-parser, whose format tool_choice required / named enforces."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs=true.")
        if self.return_token_origins and self.tool_mode != "none":
            raise ParamError("return_token_origins", "return_token_origins cannot be combined with tools: the "
                                                     "origins describe the answer's text, and tool calls leave it.")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        params = self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, tool_parser)
        if self.prediction is not None:
            params = params.clone(prediction=self.prediction.text() or None)
        return params


# ---------------------------------------------------------------- tokenizer endpoints (vLLM's /tokenize, /detokenize)
class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True  # true: the ids a completion request with this prompt feeds the model
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = True  # true: the ids a chat request with these messages feeds the model
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat_request(self) -> ChatCompletionRequest:
        """The chat request whose prompt this is (the template sees the same messages and tools)."""
        return ChatCompletionRequest(messages=self.messages, add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message, tools=self.tools,
                                     chat_template_kwargs=self.chat_template_kwargs)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def chat_request_from(fields: dict[str, Any]) -> ChatCompletionRequest:
    """The chat completion request another API's body translates to (the Responses API, Anthropic's Messages),
    from its fields (None: not given); a ParamError naming the first value it refuses."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        path = ".".join(str(x) for x in err.get("loc", ()))
        raise ParamError(path, f"{path}: {err.get('msg', 'invalid value')}") from None
